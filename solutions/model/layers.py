"""The building blocks of a Llama-family decoder: RMSNorm, rotary embeddings, GQA head sharing, SwiGLU.

Shapes use one set of letters everywhere in the course:
T tokens (flattened over every sequence in the batch), D_model hidden width, Hq query heads,
Hkv key/value heads, D head width, V vocabulary. Activations are in the weights' dtype (float32 by default;
bfloat16 or float16 on request), with Hugging Face's float32 islands: RMSNorm's statistics and RoPE's angles.

Where this lives in vLLM: `vllm/model_executor/layers/layernorm.py` (RMSNorm),
`vllm/model_executor/layers/rotary_embedding/` (get_rope), `vllm/model_executor/models/llama.py` (LlamaMLP).
"""

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Scale each row of `x` (..., D_model) to unit root-mean-square, then by `weight` (D_model,).

    Unlike LayerNorm there is no mean subtraction and no bias: x / sqrt(mean(x²) + eps) * weight. The statistics
    are taken in float32 whatever x's dtype (a bf16 mean of squares loses the small terms), as Hugging Face does.
    """
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)  # (..., 1)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)  # (..., D_model)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair rotation speeds (D/2,): pair i turns by position * theta^(-2i/D) radians.

    `scaling` stretches the slow (long-wavelength) pairs so a model reaches past its training length:
    "linear" divides every speed by `factor`; "llama3" divides only the slow ones and blends the middle band.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim  # (D/2,)
    inv_freq = 1.0 / (theta**exponents)  # (D/2,)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: wavelengths longer than the original context are slowed by `factor`, shorter ones are kept,
    # and the band in between is interpolated smoothly.
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Turns token positions into the cos/sin tables that `apply_rope` rotates q and k with.

    One instance is shared by every layer (vLLM's `get_rope` caches it the same way).
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # (T, D/2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (T, D): the same angle drives dims i and i + D/2
        return angles.cos(), angles.sin()  # (T, D), (T, D)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate every head of `x` (T, H, D) by its token's angles, `cos`/`sin` (T, D).

    Dimension i is paired with i + D/2 (the "rotate half" layout of Hugging Face checkpoints):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (T, H, D)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # angles are float32; the product stays in x's dtype (as HF)
    return x * cos[:, None, :] + rotated * sin[:, None, :]  # (T, H, D)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (T, D_model)

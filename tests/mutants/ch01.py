"""Plausible wrong answers to chapter 01's exercises. Each must fail at least one test of its exercise."""

import torch

from solutions.baselines import naive
from solutions.model import layers
from solutions.attention.causal import causal_attention


def rms_norm_without_eps(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / x.pow(2).mean(-1, keepdim=True).sqrt()


def rms_norm_subtracts_mean(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x - x.mean(-1, keepdim=True)  # LayerNorm's centring does not belong in RMSNorm
    return layers.rms_norm(x, weight, eps)


def apply_rope_adjacent_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # GPT-J's interleaved pairing (0,1), (2,3)... instead of the checkpoint's (i, i + D/2)
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def repeat_kv_tiled(x: torch.Tensor, num_queries_per_kv: int) -> torch.Tensor:
    return x.repeat(1, num_queries_per_kv, 1)  # head order k0 k1 k0 k1: wrong query heads share


def causal_attention_without_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    k, v = layers.repeat_kv(k, q.shape[1] // k.shape[1]), layers.repeat_kv(v, q.shape[1] // k.shape[1])
    probs = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * scale, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def causal_attention_without_scale(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return causal_attention(q, k, v, 1.0)


def generate_naive_returns_prompt_too(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    return list(prompt_ids) + naive.generate_naive(model, prompt_ids, max_new_tokens)


def decoder_layer_post_norm(layer, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    # the original Transformer's post-norm: normalise after adding, instead of before each block
    out = naive.decoder_layer(layer, positions, hidden)
    return layer.post_attention_layernorm(out)


MUTANTS = {
    "rms_norm_without_eps": {"rms_norm": rms_norm_without_eps},
    "rms_norm_subtracts_mean": {"rms_norm": rms_norm_subtracts_mean},
    "apply_rope_adjacent_pairs": {"apply_rope": apply_rope_adjacent_pairs},
    "repeat_kv_tiled": {"repeat_kv": repeat_kv_tiled},
    "causal_attention_without_mask": {"causal_attention": causal_attention_without_mask},
    "causal_attention_without_scale": {"causal_attention": causal_attention_without_scale},
    "decoder_layer_post_norm": {"decoder_layer": decoder_layer_post_norm},
    "generate_naive_returns_prompt_too": {"generate_naive": generate_naive_returns_prompt_too},
}

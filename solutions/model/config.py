"""The model's shape, read from a Hugging Face `config.json`.

One flat record holds every number the forward pass needs, so the modules never read a raw dict.
vLLM keeps the same facts in `ModelConfig` (`vllm/config/model.py`).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The architectures whose forward pass is the Llama one (pre-norm, RoPE, GQA, SwiGLU).
# Qwen2 adds a bias to the q/k/v projections; Qwen2 and Mistral may window some layers (Llama's model never does).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
WINDOWED_CONFIG_CLASSES = {"Qwen2ForCausalLM": "Qwen2Config", "MistralForCausalLM": "MistralConfig"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int  # D_model: width of the residual stream
    intermediate_size: int  # width of the SwiGLU hidden layer
    num_hidden_layers: int
    num_attention_heads: int  # Hq: query heads
    num_key_value_heads: int  # Hkv: K/V heads; Hq % Hkv == 0 (grouped-query attention)
    head_dim: int  # D: width of one head
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None, or {"rope_type": "linear" | "llama3", ...}
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2, or Llama with attention_bias)
    o_proj_bias: bool  # the output projection carries a bias (Llama with attention_bias only)
    mlp_bias: bool  # the SwiGLU projections carry a bias (Llama with mlp_bias)
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    max_position_embeddings: int
    eos_token_id: int | None
    # Per layer, how many positions a query sees, its own and those just before it; None: every earlier one.
    # Empty: no layer is windowed.
    sliding_windows: tuple[int | None, ...] = ()

    @property
    def num_queries_per_kv(self) -> int:
        """How many query heads read each K/V head."""
        return self.num_attention_heads // self.num_key_value_heads

    def sliding_window(self, layer_idx: int) -> int | None:
        """How many positions layer `layer_idx`'s queries see, their own included; None: every earlier one."""
        return self.sliding_windows[layer_idx] if self.sliding_windows else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed `config.json`, rejecting what our forward pass does not implement."""
        architectures = raw.get("architectures") or ["LlamaForCausalLM"]
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        # transformers 5 writes `rope_parameters`; older checkpoints write `rope_theta` + `rope_scaling`.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        num_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qkv_bias=architecture == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            o_proj_bias=architecture != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            sliding_windows=_binding_windows(architecture, raw),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelConfig":
        return cls.from_dict(json.loads((folder / "config.json").read_text()))


def _binding_windows(architecture: str, raw: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's sliding window, None for a layer that sees every earlier position; () when no window binds.

    Which layers are windowed is read through Hugging Face's own config class (transformers 5.23.0: Qwen2 turns
    `sliding_window` off unless `use_sliding_window`, and derives `layer_types` from `max_window_layers` unless they
    are given; Mistral windows every layer), so the engine masks what the oracle masks. A window at least
    `max_position_embeddings` wide never binds, and is dropped.
    """
    if architecture not in WINDOWED_CONFIG_CLASSES:
        return ()
    import transformers

    hf = getattr(transformers, WINDOWED_CONFIG_CLASSES[architecture])(**raw)
    window = hf.sliding_window
    if window is None or window >= hf.max_position_embeddings:
        return ()
    layer_types = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    return windows if any(w is not None for w in windows) else ()

"""A Llama-family causal LM in plain PyTorch, with the attention step handed to a backend.

The module tree and parameter names mirror Hugging Face's `LlamaForCausalLM`, so a checkpoint's
safetensors load with `load_state_dict` as they are. Every forward works on a flat batch of T tokens
(all sequences concatenated, as vLLM does); what those tokens attend to — nothing but themselves
(chapter 1), a contiguous cache (chapter 2) or a paged cache (chapter 3) — is the backend's business.

Where this lives in vLLM: `vllm/model_executor/models/llama.py`; the backend plays the role of
`vllm/model_executor/layers/attention/attention.py::Attention` with its per-step metadata passed explicitly
(the backend is an argument of `forward`). Only the compiled fast path looks its backend up in a forward context,
because the compiled graph cannot take one as an argument (`solutions/worker/compiled_forward.py`).
"""

import torch
from torch import nn

from solutions.attention.backend import AttentionBackend
from solutions.model.config import ModelConfig
from solutions.model.layers import MLP, RMSNorm, RotaryEmbedding, apply_rope


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_emb = rotary_emb  # shared by every layer; not a parameter
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """`rope`: the step's (cos, sin), (T, D) each, made once per forward pass by the model's `rotary_emb`."""
        T = hidden.shape[0]
        q = self.q_proj(hidden).view(T, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = self.k_proj(hidden).view(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = self.v_proj(hidden).view(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = backend.forward(self.layer_idx, q, k, v)  # (T, Hq, D)
        return self.o_proj(out.reshape(T, -1))  # (T, D_model)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, rotary_emb)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), backend)  # (T, D_model)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))  # (T, D_model)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.rotary_emb) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, D_model)."""
        hidden = self.embed_tokens(input_ids)  # (T, D_model)
        rope = self.rotary_emb(positions)  # (cos, sin), (T, D) each: the same for every layer, so made once
        for layer in self.layers:
            hidden = layer(rope, hidden, backend)
        return self.norm(hidden)  # (T, D_model)


class LlamaForCausalLM(nn.Module):
    """Embeddings -> decoder layers -> final norm; `compute_logits` applies the LM head separately,
    so an engine can project only the rows it samples from (the last token of each sequence)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, D_model)."""
        return self.model(input_ids, positions, backend)  # (T, D_model)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # (T, V)

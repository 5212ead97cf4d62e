"""Chapter 1: the whole forward pass written out, and generation that recomputes everything each step.

No cache: to produce token t+1 the model re-reads all t tokens, so step t costs O(t) matmul work and
O(t²) attention work, and a whole generation grows quadratically. Chapter 2 removes the recomputation.
"""

import torch

from solutions.attention.causal import causal_attention
from solutions.model.layers import apply_rope, rms_norm
from solutions.model.llama import DecoderLayer, LlamaForCausalLM


class NaiveAttention:
    """The backend with no cache: the T new tokens are the whole sequence and attend only to each other."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, k, v, scale=q.shape[-1] ** -0.5)  # (T, Hq, D)


def decoder_layer(layer: DecoderLayer, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """One pre-norm decoder block over a single sequence (T, D_model), written out step by step."""
    attn, T = layer.self_attn, hidden.shape[0]
    x = rms_norm(hidden, layer.input_layernorm.weight, layer.input_layernorm.eps)  # (T, D_model)
    q = attn.q_proj(x).view(T, attn.num_heads, attn.head_dim)  # (T, Hq, D)
    k = attn.k_proj(x).view(T, attn.num_kv_heads, attn.head_dim)  # (T, Hkv, D)
    v = attn.v_proj(x).view(T, attn.num_kv_heads, attn.head_dim)  # (T, Hkv, D)
    cos, sin = attn.rotary_emb(positions)  # (T, D)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = causal_attention(q, k, v, scale=attn.head_dim**-0.5)  # (T, Hq, D)
    hidden = hidden + attn.o_proj(out.reshape(T, -1))  # (T, D_model)
    x = rms_norm(hidden, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
    return hidden + layer.mlp(x)  # (T, D_model)


@torch.inference_mode()
def forward(model: LlamaForCausalLM, token_ids: torch.Tensor) -> torch.Tensor:
    """Logits (T, V) for every position of one sequence of token ids (T,)."""
    positions = torch.arange(token_ids.shape[0])  # (T,)
    hidden = model.model.embed_tokens(token_ids)  # (T, D_model)
    for layer in model.model.layers:
        hidden = decoder_layer(layer, positions, hidden)
    norm = model.model.norm
    return model.lm_head(rms_norm(hidden, norm.weight, norm.eps))  # (T, V)


def generate_naive(model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding that runs the full forward over prompt + everything generated so far, every step.

    Returns only the new token ids. Never stops early (no EOS check): the chapter compares lengths and costs.
    """
    token_ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = forward(model, torch.tensor(token_ids))  # (T, V): all T rows computed, one used
        token_ids.append(int(logits[-1].argmax()))
    return token_ids[len(prompt_ids) :]

"""Plausible wrong answers to chapter 01's exercises. Each must fail at least one test of its exercise.

Each mutant is written out whole, the way a learner would write it, and calls only the reference pieces imported
below by value: the capstone swaps the learner's objects into `solutions/` modules, so a mutant that looked a name
up there at call time (`layers.rms_norm`) could end up calling itself.
"""

import torch

from solutions.attention.causal import causal_attention
from solutions.baselines.naive import decoder_layer, forward
from solutions.attention.causal import repeat_kv
from solutions.model.layers import apply_rope, rms_norm

# --- rms_norm ------------------------------------------------------------------------------------------------


def rms_norm_without_eps(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / x.pow(2).mean(-1, keepdim=True).sqrt()


def rms_norm_subtracts_mean(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x - x.mean(-1, keepdim=True)  # LayerNorm's centring does not belong in RMSNorm
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_eps_outside_the_sqrt(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps)  # x / (rms + eps): eps in the wrong place


def rms_norm_over_the_whole_tensor(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean() + eps)  # forgot dim=-1: one RMS for every token together


def rms_norm_statistics_in_the_input_dtype(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)  # in float16, x² of a value above 256 overflows to inf
    return weight * (x * torch.rsqrt(variance + eps))


# --- apply_rope ----------------------------------------------------------------------------------------------


def apply_rope_adjacent_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # GPT-J's interleaved pairing (0,1), (2,3)... instead of the checkpoint's (i, i + D/2)
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rope_rotates_backwards(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], -x[..., :half]), dim=-1)  # the minus sign on the wrong half
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rope_swaps_cos_and_sin(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * sin[:, None, :] + rotated * cos[:, None, :]


def apply_rope_broadcasts_over_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    # (T, D) against (T, H, D) aligns T with H: an error when T != H, silently the wrong angles when T == H
    return x * cos + rotated * sin


# --- repeat_kv -----------------------------------------------------------------------------------------------


def repeat_kv_tiled(x: torch.Tensor, num_queries_per_kv: int) -> torch.Tensor:
    return x.repeat(1, num_queries_per_kv, 1)  # head order k0 k1 k0 k1: wrong query heads share


def repeat_kv_along_tokens(x: torch.Tensor, num_queries_per_kv: int) -> torch.Tensor:
    return x.repeat_interleave(num_queries_per_kv, dim=0)  # dim 0 is T, not the heads: (T*n, Hkv, D)


def repeat_kv_along_head_width(x: torch.Tensor, num_queries_per_kv: int) -> torch.Tensor:
    return x.repeat_interleave(num_queries_per_kv, dim=-1)  # the last dim is D: (T, Hkv, D*n)


# --- causal_attention ----------------------------------------------------------------------------------------


def _attention(q, k, v, scale, *, mask_from: int = 1, softmax_dim: int = -1, tile_kv: bool = False, masked=True):
    """Causal attention with one of a learner's knobs turned: the diagonal the mask starts on, the softmax's dim,
    and GQA by tiling instead of interleaving."""
    n = q.shape[1] // k.shape[1]
    if tile_kv:
        k, v = k.repeat(1, n, 1), v.repeat(1, n, 1)
    else:
        k, v = repeat_kv(k, n), repeat_kv(v, n)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # (Hq, T, T)
    if masked:
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(mask_from)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=softmax_dim), v)


def causal_attention_without_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return _attention(q, k, v, scale, masked=False)


def causal_attention_without_scale(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return causal_attention(q, k, v, 1.0)


def causal_attention_masks_the_diagonal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return _attention(q, k, v, scale, mask_from=0)  # triu(0): a token may not see itself; row 0 sees nothing (NaN)


def causal_attention_sees_the_next_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return _attention(q, k, v, scale, mask_from=2)  # triu(2): the diagonal off by one the other way


def causal_attention_softmax_over_queries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return _attention(q, k, v, scale, softmax_dim=-2)  # (Hq, Tq, Tk): dim -2 normalises over queries


def causal_attention_tiles_kv_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return _attention(q, k, v, scale, tile_kv=True)  # GQA by k.repeat: query head h reads kv head h % Hkv


# --- decoder_layer -------------------------------------------------------------------------------------------


def _layer(layer, positions, hidden, *, post_norm=False, residual_from_normed=False, scale_power=0.5,
           own_positions=True, rotate_v=False):
    """One decoder layer with one of a learner's mistakes switched on."""
    attn, T = layer.self_attn, hidden.shape[0]
    x = hidden if post_norm else rms_norm(hidden, layer.input_layernorm.weight, layer.input_layernorm.eps)
    q = attn.q_proj(x).view(T, attn.num_heads, attn.head_dim)  # (T, Hq, D)
    k = attn.k_proj(x).view(T, attn.num_kv_heads, attn.head_dim)  # (T, Hkv, D)
    v = attn.v_proj(x).view(T, attn.num_kv_heads, attn.head_dim)  # (T, Hkv, D)
    cos, sin = attn.rotary_emb(positions if own_positions else torch.arange(T))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if rotate_v:
        v = apply_rope(v, cos, sin)
    out = causal_attention(q, k, v, scale=attn.head_dim**-scale_power)
    hidden = (x if residual_from_normed else hidden) + attn.o_proj(out.reshape(T, -1))
    if post_norm:  # the original Transformer: add first, normalise the sum
        hidden = rms_norm(hidden, layer.input_layernorm.weight, layer.input_layernorm.eps)
        hidden = hidden + layer.mlp(hidden)
        return rms_norm(hidden, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
    x = rms_norm(hidden, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
    return (x if residual_from_normed else hidden) + layer.mlp(x)


def decoder_layer_post_norm(layer, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    return _layer(layer, positions, hidden, post_norm=True)


def decoder_layer_residual_from_the_normed_input(layer, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    return _layer(layer, positions, hidden, residual_from_normed=True)  # x + attn(x) with x = norm(hidden)


def decoder_layer_scales_by_head_dim(layer, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    return _layer(layer, positions, hidden, scale_power=1.0)  # 1/D instead of 1/sqrt(D)


def decoder_layer_rotates_by_token_index(layer, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    return _layer(layer, positions, hidden, own_positions=False)  # arange(T), not the positions it was given


def decoder_layer_rotates_v_too(layer, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    return _layer(layer, positions, hidden, rotate_v=True)  # RoPE is for q and k: v carries content, not position


# --- forward -------------------------------------------------------------------------------------------------


@torch.inference_mode()
def forward_without_final_norm(model, token_ids: torch.Tensor) -> torch.Tensor:
    positions, hidden = torch.arange(token_ids.shape[0]), model.model.embed_tokens(token_ids)
    for layer in model.model.layers:
        hidden = decoder_layer(layer, positions, hidden)
    return model.lm_head(hidden)  # model.model.norm forgotten


@torch.inference_mode()
def forward_skips_the_last_layer(model, token_ids: torch.Tensor) -> torch.Tensor:
    positions, hidden = torch.arange(token_ids.shape[0]), model.model.embed_tokens(token_ids)
    for i in range(len(model.model.layers) - 1):  # off by one: range(n - 1)
        hidden = decoder_layer(model.model.layers[i], positions, hidden)
    norm = model.model.norm
    return model.lm_head(rms_norm(hidden, norm.weight, norm.eps))


@torch.inference_mode()
def forward_returns_the_last_row_only(model, token_ids: torch.Tensor) -> torch.Tensor:
    positions, hidden = torch.arange(token_ids.shape[0]), model.model.embed_tokens(token_ids)
    for layer in model.model.layers:
        hidden = decoder_layer(layer, positions, hidden)
    norm = model.model.norm
    return model.lm_head(rms_norm(hidden[-1], norm.weight, norm.eps))  # (V,): generation's row, not all T rows


# --- generate_naive ------------------------------------------------------------------------------------------


def generate_naive_returns_prompt_too(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    token_ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        token_ids.append(int(forward(model, torch.tensor(token_ids))[-1].argmax()))
    return token_ids  # the prompt included


def generate_naive_one_token_too_many(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    token_ids = list(prompt_ids)
    for _ in range(max_new_tokens + 1):  # "the first token, then max_new_tokens more"
        token_ids.append(int(forward(model, torch.tensor(token_ids))[-1].argmax()))
    return token_ids[len(prompt_ids) :]


def generate_naive_feeds_only_the_last_token(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    token_ids = list(prompt_ids)
    for step in range(max_new_tokens):
        fed = token_ids if step == 0 else token_ids[-1:]  # as if the model remembered the rest: it has no cache
        token_ids.append(int(forward(model, torch.tensor(fed))[-1].argmax()))
    return token_ids[len(prompt_ids) :]


def generate_naive_argmax_over_every_row(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    token_ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = forward(model, torch.tensor(token_ids))  # (T, V)
        token_ids.append(int(logits.argmax()) % logits.shape[-1])  # the best (row, token) anywhere, not in row -1
    return token_ids[len(prompt_ids) :]


MUTANTS = {
    "rms_norm_without_eps": {"rms_norm": rms_norm_without_eps},
    "rms_norm_subtracts_mean": {"rms_norm": rms_norm_subtracts_mean},
    "rms_norm_eps_outside_the_sqrt": {"rms_norm": rms_norm_eps_outside_the_sqrt},
    "rms_norm_over_the_whole_tensor": {"rms_norm": rms_norm_over_the_whole_tensor},
    "rms_norm_statistics_in_the_input_dtype": {"rms_norm": rms_norm_statistics_in_the_input_dtype},
    "apply_rope_adjacent_pairs": {"apply_rope": apply_rope_adjacent_pairs},
    "apply_rope_rotates_backwards": {"apply_rope": apply_rope_rotates_backwards},
    "apply_rope_swaps_cos_and_sin": {"apply_rope": apply_rope_swaps_cos_and_sin},
    "apply_rope_broadcasts_over_heads": {"apply_rope": apply_rope_broadcasts_over_heads},
    "repeat_kv_tiled": {"repeat_kv": repeat_kv_tiled},
    "repeat_kv_along_tokens": {"repeat_kv": repeat_kv_along_tokens},
    "repeat_kv_along_head_width": {"repeat_kv": repeat_kv_along_head_width},
    "causal_attention_without_mask": {"causal_attention": causal_attention_without_mask},
    "causal_attention_without_scale": {"causal_attention": causal_attention_without_scale},
    "causal_attention_masks_the_diagonal": {"causal_attention": causal_attention_masks_the_diagonal},
    "causal_attention_sees_the_next_token": {"causal_attention": causal_attention_sees_the_next_token},
    "causal_attention_softmax_over_queries": {"causal_attention": causal_attention_softmax_over_queries},
    "causal_attention_tiles_kv_heads": {"causal_attention": causal_attention_tiles_kv_heads},
    "decoder_layer_post_norm": {"decoder_layer": decoder_layer_post_norm},
    "decoder_layer_residual_from_the_normed_input": {"decoder_layer": decoder_layer_residual_from_the_normed_input},
    "decoder_layer_scales_by_head_dim": {"decoder_layer": decoder_layer_scales_by_head_dim},
    "decoder_layer_rotates_by_token_index": {"decoder_layer": decoder_layer_rotates_by_token_index},
    "decoder_layer_rotates_v_too": {"decoder_layer": decoder_layer_rotates_v_too},
    "forward_without_final_norm": {"forward": forward_without_final_norm},
    "forward_skips_the_last_layer": {"forward": forward_skips_the_last_layer},
    "forward_returns_the_last_row_only": {"forward": forward_returns_the_last_row_only},
    "generate_naive_returns_prompt_too": {"generate_naive": generate_naive_returns_prompt_too},
    "generate_naive_one_token_too_many": {"generate_naive": generate_naive_one_token_too_many},
    "generate_naive_feeds_only_the_last_token": {"generate_naive": generate_naive_feeds_only_the_last_token},
    "generate_naive_argmax_over_every_row": {"generate_naive": generate_naive_argmax_over_every_row},
}

# For each exercise, a mutant that changes SmolLM2's greedy tokens: the capstone must fail on it, which proves the
# capstone's generation really runs through that exercise.
CAPSTONE_MUTANTS = {
    "rms_norm": "rms_norm_subtracts_mean",
    "apply_rope": "apply_rope_adjacent_pairs",
    "repeat_kv": "repeat_kv_tiled",
    "causal_attention": "causal_attention_without_mask",
    "decoder_layer": "decoder_layer_scales_by_head_dim",
    "forward": "forward_without_final_norm",
    "generate_naive": "generate_naive_feeds_only_the_last_token",
}

# The statements each exercise's question is about, as `ast.unparse` writes them (a compound statement by its
# header). Hint 2 may show none of them, and nothing under chapters/ may state them (tests/test_hints.py): they
# live here, beside the wrong answers, because a learner reads the chapter's test file.
DECISIVE = {
    "rms_norm": [
        'variance = x32.pow(2).mean(dim=-1, keepdim=True)',
        'return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)',
    ],
    "apply_rope": [
        'rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)',
        'return x * cos[:, None, :] + rotated * sin[:, None, :]',
    ],
    "repeat_kv": [
        'return x.repeat_interleave(num_queries_per_kv, dim=1)',
    ],
    "causal_attention": [
        'query_pos = torch.arange(Tk - Tq, Tk, device=q.device)[:, None]',
        "scores = scores.masked_fill(key_pos > query_pos, float('-inf'))",
    ],
    "decoder_layer": [
        'q, k = (apply_rope(q, cos, sin), apply_rope(k, cos, sin))',
        'return hidden + layer.mlp(x)',
    ],
    "forward": [
        'hidden = decoder_layer(layer, positions, hidden)',
        'return model.lm_head(rms_norm(hidden, norm.weight, norm.eps))',
    ],
    "generate_naive": [
        'logits = forward(model, torch.tensor(token_ids))',
        'token_ids.append(int(logits[-1].argmax()))',
    ],
}

"""Unified paged attention: one kernel for a mixed batch of prefills, chunked prefills and decodes.

The step's T new tokens are concatenated; sequence b owns query rows `query_start_loc[b]:query_start_loc[b+1]`
(its query_len new tokens) and `seq_lens[b]` tokens in the cache, the new ones last (their K/V were stored
before attending). So its cached context is `context_len = seq_len - query_len` tokens, and new token i sits
at position `context_len + i`: it attends to every position up to its own, cached or new, all read through
the block table.

Programs: one per (sequence, KV head, tile of BLOCK_Q query tokens). The program's rows are its BLOCK_Q tokens
times the G query heads of the KV head's group, flattened to a `[BLOCK_M, D]` tile (row r is token r // G,
head r % G): a decode (query_len 1) still fills the rows with its whole GQA group. The loop over context tiles
is the decode kernel's online softmax, with a causal mask `key_pos <= query_pos` per row, and it stops at the
last position the tile's last token can see.

A sliding window (`window` > 0) also hides the keys a row's query is `window` or more positions past:
`key_pos > query_pos - window` (Hugging Face's rule, transformers 5.23.0 `masking_utils.py`). The loop then starts
at the tile of the first position the tile's first token sees; a later token's row may find nothing to see in the
first tiles, so the online softmax takes its running maximum as 0 while it is still -inf (exp(-inf - -inf) would be
nan). Chapter 6's decode kernels know no window: a windowed layer's decodes come here too (`triton_backend.py`).

Where this lives in vLLM: `vllm/v1/attention/ops/triton_unified_attention.py` (`kernel_unified_attention_2d`).
"""

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.paged_decode import _tile_n
from kernels.validation import check_caches, check_query, check_shape, check_tensor, next_power_of_2


@triton.jit
def unified_attention_kernel(
    out_ptr,  # (T, Hq, D)
    query_ptr,  # (T, Hq, D)
    key_cache_ptr,  # (num_blocks, BLOCK_SIZE, Hkv, D)
    value_cache_ptr,
    block_tables_ptr,  # (num_seqs, max_blocks) int32
    seq_lens_ptr,  # (num_seqs,) int32
    query_start_loc_ptr,  # (num_seqs + 1,) int32
    scale,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bts,
    query_group, head_dim,
    block_q,  # query tokens per program = BLOCK_M // G
    window,  # positions each query sees, its own included; 0: every earlier one
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program: block_q tokens × G heads, padded to a power of two >= 16
    HEAD_DIM_PADDED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * block_q >= query_len:  # this sequence has fewer query tiles than the longest one
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    # -- rows: (token in this tile, head in the group) --
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    offs_n = tl.arange(0, TILE_N)
    token_in_seq = q_tile * block_q + offs_m // query_group  # (M,) index among the sequence's new tokens
    q_heads = kv_head * query_group + offs_m % query_group  # (M,)
    mask_m = (offs_m // query_group < block_q) & (token_in_seq < query_len)
    mask_d = offs_d < head_dim
    # positions of the rows' tokens; padding rows take the tile's first token so each row sees position 0
    query_pos = context_len + tl.where(mask_m, token_in_seq, q_tile * block_q)  # (M,)

    q_ptrs = query_ptr + (q_start + token_in_seq)[:, None] * stride_qt + q_heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # (M, D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)

    # -- the tile's last token sees positions up to context_len + its index; nothing past that is read, nor (with a
    #    window) the whole tiles before the first position the tile's first token sees --
    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * block_q)
    kv_start = tl.where(window > 0, tl.maximum(context_len + q_tile * block_q - window + 1, 0), 0)
    for start in range(kv_start // TILE_N * TILE_N, kv_end, TILE_N):
        offs_pos = start + offs_n  # (N,)
        mask_n = offs_pos < kv_end
        block_ids = tl.load(block_tables_ptr + seq * stride_bts + offs_pos // BLOCK_SIZE, mask=mask_n, other=0)
        kv_offs = block_ids.to(tl.int64) * stride_cb + (offs_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(key_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(value_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (M, N)
        causal = mask_n[None, :] & (offs_pos[None, :] <= query_pos[:, None])
        in_window = (window <= 0) | (offs_pos[None, :] > query_pos[:, None] - window)
        s = tl.where(causal & in_window, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row that has seen no key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + (q_start + token_in_seq)[:, None] * stride_ot + q_heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    *,
    kernel: Any = unified_attention_kernel,
    window: int | None = None,
) -> torch.Tensor:
    """query (T, Hq, D), the new tokens of every sequence concatenated, attends causally to its sequence's
    cached context and to the new tokens before it -> (T, Hq, D); with a sliding `window`, to the last `window`
    positions up to its own.

    `max_query_len` sizes the grid; None reads it from `query_start_loc` (a device-to-host copy on a GPU).
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_caches(key_cache, value_cache)
    device = key_cache.device
    num_tokens, num_heads = check_query(query, key_cache)
    check_tensor("block_tables", block_tables, 2, (torch.int32,), device)
    num_seqs = block_tables.shape[0]
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), device)
    check_shape("seq_lens", seq_lens, (num_seqs,))
    check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,), device)
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    if not isinstance(scale, float):
        raise ValueError(f"scale must be a float, got {scale!r}")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0

    out = torch.empty_like(query)
    if num_tokens == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    block_m = max(16, next_power_of_2(group), 64 if max_query_len > 1 else 0)  # decodes: one token's group
    block_q = block_m // group
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    kernel[grid](
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        group, head_dim, block_q, window or 0,
        BLOCK_SIZE=block_size,
        TILE_N=_tile_n(block_size),
        BLOCK_M=block_m,
        HEAD_DIM_PADDED=max(16, next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out


def unified_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The same in PyTorch, in fp32: per sequence, gather its K/V and run causal attention with an offset."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for b in range(block_tables.shape[0]):
        rows = slice(starts[b], starts[b + 1])
        query_len, seq_len = starts[b + 1] - starts[b], int(seq_lens[b])
        if query_len == 0:
            continue
        blocks = block_tables[b, : -(-seq_len // block_size)].long()
        keys = key_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)  # (L, Hq, D)
        values = value_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,lhd->hql", query[rows].float(), keys) * scale  # (Hq, Tq, L)
        query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]  # (Tq, 1)
        key_pos = torch.arange(seq_len)[None, :]  # (1, L)
        hidden = key_pos > query_pos if window is None else (key_pos > query_pos) | (key_pos <= query_pos - window)
        scores = scores.masked_fill(hidden, float("-inf"))
        out[rows] = torch.einsum("hql,lhd->qhd", scores.softmax(dim=-1), values).to(query.dtype)  # (Tq, Hq, D)
    return out

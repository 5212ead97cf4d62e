"""Decode attention over a contiguous KV cache: the online softmax of `kernels/online_softmax.py` as a kernel.

One new query token per sequence; sequence b's keys and values sit in rows 0..seq_lens[b]-1 of its own slice of
`[num_seqs, max_len, Hkv, D]` (chapter 2's layout: every sequence reserves max_len rows). One program per
(sequence, KV head) loads the G query heads of its GQA group as a `[G, D]` tile, walks the context `TILE_N`
positions at a time with the running (m_i, l_i, acc), and writes acc / l_i. Rows past seq_len hold whatever an
earlier, longer sequence left there: their scores must be -inf.

This is `kernels/paged_decode.py` without the block table: position p is row p of the sequence's slice, not
row p % BLOCK_SIZE of block `block_tables[seq, p // BLOCK_SIZE]`.

Where this lives in vLLM: nowhere (vLLM's caches are paged); it is the decode path of FlashAttention's
`flash_attn_with_kvcache` without a block table.
"""

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.validation import check_caches, check_query, check_shape, check_tensor, next_power_of_2

TILE_N = 16  # context positions per loop iteration: tl.dot wants >= 16; small keeps interpreted tests short


@triton.jit
def contiguous_decode_kernel(
    out_ptr,  # (num_seqs, Hq, D)
    query_ptr,  # (num_seqs, Hq, D)
    key_cache_ptr,  # (num_seqs, max_len, Hkv, D)
    value_cache_ptr,  # same shape and strides as the key cache
    seq_lens_ptr,  # (num_seqs,) int32
    scale,
    stride_qs, stride_qh,
    stride_os, stride_oh,
    stride_cs, stride_cn, stride_ch,  # cache strides (sequence, position n, head); head_dim stride is 1
    query_group, head_dim,  # G = Hq // Hkv query heads share one KV head
    TILE_N: tl.constexpr,
    GROUP_PADDED: tl.constexpr,  # >= 16 and >= G: tl.dot wants at least 16 rows
    HEAD_DIM_PADDED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs; "tf32" is exact for upcast fp16/bf16 values
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_g = tl.arange(0, GROUP_PADDED)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    offs_n = tl.arange(0, TILE_N)
    mask_g = offs_g < query_group
    mask_d = offs_d < head_dim
    q_heads = kv_head * query_group + offs_g  # (G,) query heads kv_head*G .. kv_head*G + G-1 share this KV head

    # -- the group's queries, (G, D), upcast once --
    q_ptrs = query_ptr + seq * stride_qs + q_heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)

    # -- online softmax state --
    m_i = tl.full([GROUP_PADDED], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PADDED], dtype=tl.float32)
    acc = tl.zeros([GROUP_PADDED, HEAD_DIM_PADDED], dtype=tl.float32)

    kv_base = seq.to(tl.int64) * stride_cs + kv_head * stride_ch  # this sequence's slice, this KV head
    for start in range(0, seq_len, TILE_N):
        # -- one tile of positions: rows start .. start + TILE_N - 1 of the slice --
        offs_pos = start + offs_n  # (N,)
        mask_n = offs_pos < seq_len
        kv_offs = kv_base + offs_pos * stride_cn  # (N,)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(key_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(value_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)

        # -- scores (G, N); rows past seq_len get -inf --
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = tl.where(mask_n[None, :], s, float("-inf"))

        # -- online softmax update --
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (G,)
        alpha = tl.exp(m_i - m_new)  # (G,)
        p = tl.exp(s - m_new[:, None])  # (G, N)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)  # (G, D)
        m_i = m_new

    out = acc / l_i[:, None]  # (G, D)
    o_ptrs = out_ptr + seq * stride_os + q_heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


def contiguous_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    kernel: Any = None,
) -> torch.Tensor:
    """query (num_seqs, Hq, D), one token per sequence, attends to rows 0..seq_lens[b]-1 of its slice of the caches
    (num_seqs, max_len, Hkv, D) -> (num_seqs, Hq, D).

    `kernel` is the Triton kernel to launch: None means this module's `contiguous_decode_kernel`, looked up at
    call time (chapter 6 passes the learner's). Every seq_lens[b] must be in 1..max_len (not checked: it would
    cost a device-to-host copy per call).
    """
    num_seqs, max_len, num_kv_heads, head_dim = check_caches(key_cache, value_cache)
    num_rows, num_heads = check_query(query, key_cache)
    if num_rows != num_seqs:
        raise ValueError(f"query has {num_rows} rows, the caches hold {num_seqs} sequences")
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), key_cache.device)
    check_shape("seq_lens", seq_lens, (num_seqs,))
    if not isinstance(scale, float):
        raise ValueError(f"scale must be a float, got {scale!r}")
    kernel = contiguous_decode_kernel if kernel is None else kernel
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    kernel[(num_seqs, num_kv_heads)](
        out, query, key_cache, value_cache, seq_lens, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        group, head_dim,
        TILE_N=TILE_N,
        GROUP_PADDED=max(16, next_power_of_2(group)),
        HEAD_DIM_PADDED=max(16, next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out


def contiguous_decode_attention_reference(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """The same in PyTorch, in fp32: each sequence's first seq_lens[b] rows, softmax, weighted sum."""
    group = query.shape[1] // key_cache.shape[2]
    out = torch.empty_like(query)
    for b in range(query.shape[0]):
        n = int(seq_lens[b])
        keys = key_cache[b, :n].float().repeat_interleave(group, dim=1)  # (L, Hq, D)
        values = value_cache[b, :n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[b].float(), keys) * scale  # (Hq, L)
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), values).to(query.dtype)  # (Hq, D)
    return out


# In the interpreter a kernel reports Triton's module as its own; name this one, so that
# `from kernels.contiguous_decode import contiguous_decode_kernel` is what its `__module__` says.
contiguous_decode_kernel.__module__ = __name__

"""Paged decode attention: one new query token per sequence, its context read in place through the block table.

Algorithm (FlashAttention's online softmax, Milakov & Gimelshein 2018; Dao et al. 2022). For one sequence and
one KV head, the query heads of its GQA group form a `[G, D]` tile. The context is visited one tile of
`TILE_N` positions at a time; position p lives at `block_tables[seq, p // BLOCK_SIZE]`, offset
`p % BLOCK_SIZE`. For each tile, with scores s = q·kᵀ·scale (G, TILE_N):

    m_new = max(m_i, rowmax(s))            running maximum of the scores (keeps exp() finite)
    p     = exp(s - m_new)                 this tile's unnormalised probabilities
    alpha = exp(m_i - m_new)               rescales what was summed under the old maximum
    l_i   = alpha * l_i + rowsum(p)        running softmax denominator
    acc   = alpha * acc + p @ v            running numerator, (G, D)

and at the end `out = acc / l_i`. Nothing of size seq_len is ever materialised, and each K/V byte is read once.

Split-KV (flash-decoding, Dao et al. 2023): with few sequences there are too few programs to fill a GPU, so the
context is cut into NUM_SPLITS segments, each handled by its own program. A segment returns its normalised
partial output o_s = acc_s / l_s and its log-sum-exp lse_s = m_s + log(l_s); the merge kernel combines them as

    out = Σ_s exp(lse_s - lse_max) · o_s  /  Σ_s exp(lse_s - lse_max)

which is exactly the softmax over the whole context (a segment's weight is its share of the denominator).

All arithmetic is fp32: tiles are upcast right after loading (bf16 arithmetic is wrong in the interpreter, and
fp32 accumulation is what every production kernel does anyway).

Where this lives in vLLM: `vllm/v1/attention/ops/triton_decode_attention.py` (two stages: split-KV partials
with log-sum-exp, then the merge).
"""

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.validation import check_caches, check_query, check_shape, check_tensor, next_power_of_2

# The launch rule (`choose_num_splits`, `choose_tile`), fitted to a sweep of every (splits, TILE_N, warps) launch
# over batch 1-256 x context 512-8192 on an H100 (bf16, block size 16; benchmarks/kernels.py --sweep): at every
# point of that grid it lands within 2.3 points (of copy-bandwidth fraction) of the best launch found.
PROGRAMS_PER_SM = 2  # split until the grid holds this many programs per SM
MIN_TOKENS_PER_SPLIT = 128  # below this a segment's fixed cost (q load, merge traffic) outweighs its reads
MAX_SPLITS = 32
GPU_TILE_N, GPU_NUM_WARPS = 128, 4


@triton.jit
def paged_decode_kernel(
    out_ptr,  # (num_seqs, Hq, D)
    query_ptr,  # (num_seqs, Hq, D)
    key_cache_ptr,  # (num_blocks, BLOCK_SIZE, Hkv, D)
    value_cache_ptr,
    block_tables_ptr,  # (num_seqs, max_blocks) int32
    seq_lens_ptr,  # (num_seqs,) int32
    scale,
    stride_qs, stride_qh,
    stride_os, stride_oh,
    stride_cb, stride_cs, stride_ch,  # cache strides (block, slot in block, head); head_dim stride is 1
    stride_bts,  # block table row stride
    query_group, head_dim,  # G = Hq // Hkv query heads share one KV head
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,  # context positions per loop iteration
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
    q_heads = kv_head * query_group + offs_g  # (G,) the query heads of this KV head's group

    # -- the group's queries, (G, D), upcast once --
    q_ptrs = query_ptr + seq * stride_qs + q_heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)

    # -- online softmax state, as in the FlashAttention papers --
    m_i = tl.full([GROUP_PADDED], float("-inf"), dtype=tl.float32)  # running max of the scores
    l_i = tl.zeros([GROUP_PADDED], dtype=tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([GROUP_PADDED, HEAD_DIM_PADDED], dtype=tl.float32)  # running sum of exp(...) * v

    for start in range(0, seq_len, TILE_N):
        # -- walk the block table: physical block and offset of each position in this tile --
        offs_pos = start + offs_n  # (N,)
        mask_n = offs_pos < seq_len
        block_ids = tl.load(block_tables_ptr + seq * stride_bts + offs_pos // BLOCK_SIZE, mask=mask_n, other=0)
        kv_offs = block_ids.to(tl.int64) * stride_cb + (offs_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(key_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(value_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)

        # -- scores of the group against this tile, (G, N); positions past seq_len get -inf --
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = tl.where(mask_n[None, :], s, float("-inf"))

        # -- online softmax update --
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (G,)
        alpha = tl.exp(m_i - m_new)  # (G,) 0 on the first tile (m_i = -inf)
        p = tl.exp(s - m_new[:, None])  # (G, N)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)  # (G, D)
        m_i = m_new

    out = acc / l_i[:, None]  # (G, D)
    o_ptrs = out_ptr + seq * stride_os + q_heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def paged_decode_split_kernel(
    partial_out_ptr,  # (num_seqs, Hq, NUM_SPLITS, D) fp32: each segment's normalised output
    partial_lse_ptr,  # (num_seqs, Hq, NUM_SPLITS) fp32: each segment's log-sum-exp of scores
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    scale,
    stride_qs, stride_qh,
    stride_ps, stride_ph, stride_pk,  # partial_out strides (seq, head, split)
    stride_ls, stride_lh,  # partial_lse strides (seq, head); splits are contiguous
    stride_cb, stride_cs, stride_ch,
    stride_bts,
    query_group, head_dim,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    GROUP_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    # -- this program's segment of the context: whole tiles, [split_start, split_end) --
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)  # may be <= split_start: an empty segment

    offs_g = tl.arange(0, GROUP_PADDED)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    offs_n = tl.arange(0, TILE_N)
    mask_g = offs_g < query_group
    mask_d = offs_d < head_dim
    q_heads = kv_head * query_group + offs_g

    q_ptrs = query_ptr + seq * stride_qs + q_heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)

    m_i = tl.full([GROUP_PADDED], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PADDED], dtype=tl.float32)
    acc = tl.zeros([GROUP_PADDED, HEAD_DIM_PADDED], dtype=tl.float32)

    for start in range(split_start, split_end, TILE_N):
        offs_pos = start + offs_n
        mask_n = offs_pos < split_end
        block_ids = tl.load(block_tables_ptr + seq * stride_bts + offs_pos // BLOCK_SIZE, mask=mask_n, other=0)
        kv_offs = block_ids.to(tl.int64) * stride_cb + (offs_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(key_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(value_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    # -- an empty segment reports lse = -inf and a zero output: its weight in the merge is exp(-inf) = 0 --
    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    out = acc / l_safe[:, None]  # (G, D)
    lse = tl.where(nonempty, m_i + tl.log(l_safe), float("-inf"))  # (G,)
    p_ptrs = partial_out_ptr + seq * stride_ps + q_heads[:, None] * stride_ph + split * stride_pk + offs_d[None, :]
    tl.store(p_ptrs, out, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(partial_lse_ptr + seq * stride_ls + q_heads * stride_lh + split, lse, mask=mask_g)


@triton.jit
def merge_splits_kernel(
    out_ptr,  # (num_seqs, Hq, D)
    partial_out_ptr,  # (num_seqs, Hq, NUM_SPLITS, D) fp32
    partial_lse_ptr,  # (num_seqs, Hq, NUM_SPLITS) fp32
    stride_os, stride_oh,
    stride_ps, stride_ph, stride_pk,
    stride_ls, stride_lh,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,  # power of two >= NUM_SPLITS
    HEAD_DIM_PADDED: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_k = tl.arange(0, SPLITS_PADDED)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    mask_k = offs_k < NUM_SPLITS
    mask_d = offs_d < head_dim

    lse = tl.load(partial_lse_ptr + seq * stride_ls + head * stride_lh + offs_k, mask=mask_k, other=float("-inf"))
    p_ptrs = partial_out_ptr + seq * stride_ps + head * stride_ph + offs_k[:, None] * stride_pk + offs_d[None, :]
    partial = tl.load(p_ptrs, mask=mask_k[:, None] & mask_d[None, :], other=0.0)  # (K, D)

    # -- weight each segment by its share of the softmax denominator: exp(lse_s - lse_max) --
    lse_max = tl.max(lse, axis=0)  # finite: segment 0 always holds position 0
    weights = tl.exp(lse - lse_max)  # (K,) 0 for empty segments
    out = tl.sum(partial * weights[:, None], axis=0) / tl.sum(weights, axis=0)  # (D,)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many segments to cut each context into: double the count while the grid gives fewer than
    PROGRAMS_PER_SM programs per SM, as long as a segment keeps at least MIN_TOKENS_PER_SPLIT positions and the
    count stays within MAX_SPLITS. A power of two, because each value compiles its own kernel.

    One program per SM is not enough: the SMs that finish first sit idle while the last programs run, and one
    small program alone on an SM cannot keep enough loads in flight to hide memory latency. Once the grid holds
    two per SM, splitting only adds the partials' traffic and a second launch.
    """
    programs, num_splits = num_seqs * num_kv_heads, 1
    while (programs * num_splits < PROGRAMS_PER_SM * num_sms
           and max_seq_len // (2 * num_splits) >= MIN_TOKENS_PER_SPLIT and 2 * num_splits <= MAX_SPLITS):
        num_splits *= 2
    return num_splits


def choose_tile(block_size: int, device: torch.device) -> tuple[int, int | None]:
    """(TILE_N, num_warps) for the decode kernels: context positions per loop iteration, and warps per program.

    On a GPU: 128 positions and 4 warps (one warp per 32 positions), whatever the block size — the kernel looks up
    a block id per position, so a tile may span several blocks. A decode kernel reads each K/V byte once and
    does little arithmetic on it; its speed is how many bytes each SM keeps in flight, and a larger tile issues
    more loads per iteration. Measured on an H100 (bf16, block size 16, 64 × 2048): tying the tile to the block
    (16) reached 71% of copy bandwidth on Llama-3-8B's head shape, 128 positions 91%.
    In the interpreter: a whole block when it is a power of two between 16 and 64 (else 16), Triton's default
    warps (ignored there): small tiles keep the tests' short contexts crossing tile boundaries.
    """
    if device.type == "cuda":
        return GPU_TILE_N, GPU_NUM_WARPS
    return _tile_n(block_size), None


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # in the interpreter programs run one after another; a small number keeps splitting for tests


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    tile_n: int | None = None,
    num_warps: int | None = None,
    decode_kernel: Any = None,
    split_kernel: Any = None,
    merge_kernel: Any = None,
) -> torch.Tensor:
    """query (num_seqs, Hq, D), one token per sequence, attends to its `seq_lens[b]` cached tokens -> (num_seqs, Hq, D).

    `num_splits=None` lets `choose_num_splits` decide; 1 launches the single-pass kernel, more the split
    kernel and the merge. `tile_n` and `num_warps` (None: `choose_tile`'s) override the launch, for sweeps. The
    `*_kernel` arguments are the Triton kernels to launch: None means this module's kernel of that name, looked
    up at call time (chapter 6 passes the learner's, or its capstone puts them here).
    Every entry of seq_lens must be at least 1 and at most max_blocks * block_size (not checked: it would
    cost a device-to-host copy per call).
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_caches(key_cache, value_cache)
    device = key_cache.device
    num_seqs, num_heads = check_query(query, key_cache)
    check_tensor("block_tables", block_tables, 2, (torch.int32,), device)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), device)
    check_shape("seq_lens", seq_lens, (num_seqs,))
    if not isinstance(scale, float):
        raise ValueError(f"scale must be a float, got {scale!r}")
    max_seq_len = block_tables.shape[1] * block_size  # an upper bound known without reading seq_lens
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, _num_sms(device))
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")

    rule_tile_n, rule_num_warps = choose_tile(block_size, device)
    tile_n = rule_tile_n if tile_n is None else tile_n
    num_warps = rule_num_warps if num_warps is None else num_warps
    launch = {} if num_warps is None else {"num_warps": num_warps}

    decode_kernel = paged_decode_kernel if decode_kernel is None else decode_kernel
    split_kernel = paged_decode_split_kernel if split_kernel is None else split_kernel
    merge_kernel = merge_splits_kernel if merge_kernel is None else merge_kernel
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    meta = dict(
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        GROUP_PADDED=max(16, next_power_of_2(group)),
        HEAD_DIM_PADDED=max(16, next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    cache_strides = (key_cache.stride(0), key_cache.stride(1), key_cache.stride(2))
    if num_splits == 1:
        decode_kernel[(num_seqs, num_kv_heads)](
            out, query, key_cache, value_cache, block_tables, seq_lens, scale,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            *cache_strides, block_tables.stride(0), group, head_dim, **meta, **launch,
        )
        return out
    partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=device)
    split_kernel[(num_seqs, num_kv_heads, num_splits)](
        partial_out, partial_lse, query, key_cache, value_cache, block_tables, seq_lens, scale,
        query.stride(0), query.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        *cache_strides, block_tables.stride(0), group, head_dim, NUM_SPLITS=num_splits, **meta, **launch,
    )
    merge_kernel[(num_seqs, num_heads)](
        out, partial_out, partial_lse,
        out.stride(0), out.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        head_dim,
        NUM_SPLITS=num_splits,
        SPLITS_PADDED=next_power_of_2(num_splits),
        HEAD_DIM_PADDED=next_power_of_2(head_dim),
    )
    return out


def _tile_n(block_size: int) -> int:
    """Context positions per loop iteration in the interpreter: a whole block when it is a power of two between 16
    and 64 (one table lookup serves the tile), else 16 or 64 positions spanning several small blocks or part of a
    large one."""
    if block_size < 16:
        return 16
    return min(64, next_power_of_2(block_size)) if block_size & (block_size - 1) == 0 else 16


def paged_decode_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same in PyTorch, in fp32: gather each sequence's K/V through its table, softmax, weighted sum."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    for b in range(query.shape[0]):
        seq_len = int(seq_lens[b])
        blocks = block_tables[b, : -(-seq_len // block_size)].long()
        keys = key_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)  # (L, Hq, D)
        values = value_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[b].float(), keys) * scale  # (Hq, L)
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), values).to(query.dtype)  # (Hq, D)
    return out

"""Plausible wrong answers to chapter 06's exercises. Each must fail at least one test of its exercise.

A mutant is the reference with one fragment of its source replaced, so each reads as a diff: the fragment the
reference has, and what the mistaken version has instead. `mutate` checks the fragment exists, so a change to the
reference cannot silently turn a mutant into a copy of it.
"""

import inspect
import textwrap

import kernels  # noqa: F401  (first: sets TRITON_INTERPRET on a machine without CUDA)
import triton
import triton.language as tl

from kernels import contiguous_decode, kv_store, online_softmax, paged_decode


def mutate(reference: object, name: str, *edits: tuple[str, str]) -> object:
    """`reference` (a Triton kernel or a Python function) with each `(old, new)` source fragment replaced,
    compiled under `name` (and jitted again, for a kernel)."""
    is_kernel = hasattr(reference, "fn")
    fn = reference.fn if is_kernel else reference
    source = textwrap.dedent(inspect.getsource(fn))
    source = source.replace(f"def {fn.__name__}(", f"def {name}(", 1)
    for old, new in edits:
        if source.count(old) != 1:
            raise ValueError(f"mutant {name}: {old!r} occurs {source.count(old)} times in the reference, not once")
        source = source.replace(old, new)
    if is_kernel:
        source = source.split("\n", 1)[1]  # drop the @triton.jit line; jit it below
    namespace = {**fn.__globals__, "triton": triton, "tl": tl}
    exec(compile(source, f"<mutant {name}>", "exec"), namespace)
    mutant = namespace[name]
    if not is_kernel:
        return mutant
    mutant.__source__ = source
    return triton.jit(mutant)


# --- online_softmax (PyTorch) ----------------------------------------------------------------------------------------

online_forgets_to_rescale_acc = mutate(
    online_softmax.online_softmax_attention, "online_forgets_to_rescale_acc",
    ("acc = alpha[:, None] * acc + p @ v", "acc = acc + p @ v"),
)  # rescales the denominator but not the numerator: earlier tiles keep weights from an older maximum

online_without_running_max = mutate(
    online_softmax.online_softmax_attention, "online_without_running_max",
    ("m_new = torch.maximum(m_i, s.max(dim=1).values)  # (G,)", "m_new = torch.zeros_like(m_i)  # (G,)"),
)  # exp(score) directly: right for small scores, inf / inf = nan once a score passes 88.7

online_max_of_the_tile_only = mutate(
    online_softmax.online_softmax_attention, "online_max_of_the_tile_only",
    ("m_new = torch.maximum(m_i, s.max(dim=1).values)  # (G,)", "m_new = s.max(dim=1).values  # (G,)"),
)  # forgets the earlier tiles: alpha = exp(m_i - m_new) > 1 after a big tile (overflow), m_i ends as the last tile's

online_drops_the_partial_tile = mutate(
    online_softmax.online_softmax_attention, "online_drops_the_partial_tile",
    ("for start in range(0, seq_len, tile_n):", "for start in range(0, seq_len - tile_n + 1, tile_n):"),
)  # only whole tiles: the last seq_len % tile_n scores are never seen

# --- contiguous_decode_kernel ---------------------------------------------------------------------------------------

contiguous_gqa_heads_interleaved = mutate(
    contiguous_decode.contiguous_decode_kernel, "contiguous_gqa_heads_interleaved",
    ("q_heads = kv_head * query_group + offs_g", "q_heads = kv_head + offs_g * tl.num_programs(1)"),
)  # query head h reads KV head h % Hkv (repeat instead of repeat_interleave); vLLM's is h // G

contiguous_scale_after_softmax = mutate(
    contiguous_decode.contiguous_decode_kernel, "contiguous_scale_after_softmax",
    (
        "s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale",
        "s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)",
    ),
    ("out = acc / l_i[:, None]  # (G, D)", "out = acc / l_i[:, None] * scale  # (G, D)"),
)  # scales the output, not the scores: softmax(s) is not softmax(scale * s)

contiguous_attends_past_seq_len = mutate(
    contiguous_decode.contiguous_decode_kernel, "contiguous_attends_past_seq_len",
    ("        s = tl.where(mask_n[None, :], s, float(\"-inf\"))\n", ""),
)  # the masked keys load as 0, so rows past seq_len still score exp(0 - m) each

contiguous_forgets_to_rescale = mutate(
    contiguous_decode.contiguous_decode_kernel, "contiguous_forgets_to_rescale",
    ("acc = acc * alpha[:, None] + tl.dot(", "acc = acc + tl.dot("),
)  # earlier tiles keep their weights from an older, smaller maximum

# --- kv_store_kernel -------------------------------------------------------------------------------------------------

store_ignores_padding_slot = mutate(
    kv_store.kv_store_kernel, "store_ignores_padding_slot",
    ("    if slot < 0:  # a padding token: nothing to store\n        return\n", ""),
)  # slot -1 lands one row before the cache: someone else's memory

store_at_token_index = mutate(
    kv_store.kv_store_kernel, "store_at_token_index",
    ("block_idx = slot // BLOCK_SIZE", "block_idx = token // BLOCK_SIZE"),
    ("block_offset = slot % BLOCK_SIZE", "block_offset = token % BLOCK_SIZE"),
)  # packs the step's tokens from slot 0, as a contiguous cache would

store_mask_from_padded_heads = mutate(
    kv_store.kv_store_kernel, "store_mask_from_padded_heads",
    ("mask = (offs_h[:, None] < num_kv_heads)", "mask = (offs_h[:, None] < NUM_KV_HEADS_PADDED)"),
)  # right for 2 or 4 KV heads; with 3 the 4th lane copies the next token's head 0 over the next slot's head 0

store_rows_from_padded_tile = mutate(
    kv_store.kv_store_kernel, "store_rows_from_padded_tile",
    (
        "cache_offs = block_idx.to(tl.int64) * stride_cb + block_offset * stride_cs",
        "cache_offs = slot.to(tl.int64) * NUM_KV_HEADS_PADDED * HEAD_DIM_PADDED",
    ),
    (
        "tile_offs = offs_h[:, None] * stride_ch + offs_d[None, :]",
        "tile_offs = offs_h[:, None] * HEAD_DIM_PADDED + offs_d[None, :]",
    ),
)  # a cache row taken as the padded tile's size: right when Hkv and D are powers of two, wrong for SmolLM2's 3 heads

# --- paged_decode_kernel ---------------------------------------------------------------------------------------------

decode_ignores_block_table = mutate(
    paged_decode.paged_decode_kernel, "decode_ignores_block_table",
    (
        "block_ids = tl.load(block_tables_ptr + seq * stride_bts + offs_pos // BLOCK_SIZE, mask=mask_n, other=0)",
        "block_ids = seq * stride_bts + offs_pos // BLOCK_SIZE",
    ),
)  # reads the sequence's blocks in order, as if block i of sequence b were block b * max_blocks + i

decode_one_block_per_tile = mutate(
    paged_decode.paged_decode_kernel, "decode_one_block_per_tile",
    (
        "block_ids = tl.load(block_tables_ptr + seq * stride_bts + offs_pos // BLOCK_SIZE, mask=mask_n, other=0)",
        "block_ids = tl.load(block_tables_ptr + seq * stride_bts + start // BLOCK_SIZE)",
    ),
)  # one table lookup per tile, from the tile's start: right while TILE_N <= BLOCK_SIZE divides it, wrong when a
#    tile spans several blocks (block size 8, TILE_N 16) or straddles two (block size 24)

decode_without_running_max = mutate(
    paged_decode.paged_decode_kernel, "decode_without_running_max",
    ("m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (G,)", "m_new = tl.zeros_like(m_i)  # (G,)"),
)  # exp(score) directly: right for small scores, inf / inf = nan once a score passes 88.7

decode_forgets_to_rescale = mutate(
    paged_decode.paged_decode_kernel, "decode_forgets_to_rescale",
    ("acc = acc * alpha[:, None] + tl.dot(", "acc = acc + tl.dot("),
)  # earlier tiles keep their weights from an older, smaller maximum

decode_attends_past_seq_len = mutate(
    paged_decode.paged_decode_kernel, "decode_attends_past_seq_len",
    ("        s = tl.where(mask_n[None, :], s, float(\"-inf\"))\n", ""),
)  # the masked keys load as 0, so positions past seq_len still score exp(0 - m) each

decode_gqa_heads_interleaved = mutate(
    paged_decode.paged_decode_kernel, "decode_gqa_heads_interleaved",
    ("q_heads = kv_head * query_group + offs_g", "q_heads = kv_head + offs_g * tl.num_programs(1)"),
)  # query head h reads KV head h % Hkv instead of h // G

# --- paged_decode_split_kernel ---------------------------------------------------------------------------------------

split_lse_is_the_max = mutate(
    paged_decode.paged_decode_split_kernel, "split_lse_is_the_max",
    ("lse = tl.where(nonempty, m_i + tl.log(l_safe), float(\"-inf\"))", "lse = m_i"),
)  # forgets the segment's denominator: a long segment weighs as much as a one-token one

split_output_unnormalised = mutate(
    paged_decode.paged_decode_split_kernel, "split_output_unnormalised",
    ("out = acc / l_safe[:, None]  # (G, D)", "out = acc  # (G, D)"),
)  # the merge expects each segment's own softmax output, acc / l

split_segment_length_rounded_down = mutate(
    paged_decode.paged_decode_split_kernel, "split_segment_length_rounded_down",
    ("split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N", "split_len = seq_len // NUM_SPLITS"),
)  # the last seq_len % NUM_SPLITS positions belong to no segment (and every segment is empty when seq_len < splits)

split_empty_segment_divides_by_zero = mutate(
    paged_decode.paged_decode_split_kernel, "split_empty_segment_divides_by_zero",
    ("out = acc / l_safe[:, None]  # (G, D)", "out = acc / l_i[:, None]  # (G, D)"),
)  # a segment past seq_len (a short sequence) has l = 0: its 0 / 0 = nan poisons the merge, even at weight 0

split_segments_not_whole_tiles = mutate(
    paged_decode.paged_decode_split_kernel, "split_segments_not_whole_tiles",
    ("split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N", "split_len = tl.cdiv(seq_len, NUM_SPLITS)"),
    ("mask_n = offs_pos < split_end", "mask_n = offs_pos < seq_len"),
)  # the decode kernel's mask kept: a segment's last tile runs into the next segment, counting those positions twice

# --- merge_splits_kernel ---------------------------------------------------------------------------------------------

merge_averages_segments = mutate(
    paged_decode.merge_splits_kernel, "merge_averages_segments",
    ("weights = tl.exp(lse - lse_max)  # (K,) 0 for empty segments", "weights = tl.where(mask_k, 1.0, 0.0)  # (K,)"),
)  # averages the partial outputs instead of weighting them by their log-sum-exp

merge_without_the_max = mutate(
    paged_decode.merge_splits_kernel, "merge_without_the_max",
    ("weights = tl.exp(lse - lse_max)  # (K,) 0 for empty segments", "weights = tl.exp(lse)  # (K,)"),
)  # exact in exact arithmetic; in fp32 exp(lse) overflows once a segment's log-sum-exp passes 88.7: inf / inf = nan

merge_padded_lanes_weighted = mutate(
    paged_decode.merge_splits_kernel, "merge_padded_lanes_weighted",
    ("mask=mask_k, other=float(\"-inf\"))", "mask=mask_k, other=0.0)"),
)  # with 3 splits padded to 4 lanes, the 4th lane reads lse 0 and weighs in a zero output

merge_forgets_the_denominator = mutate(
    paged_decode.merge_splits_kernel, "merge_forgets_the_denominator",
    (
        "out = tl.sum(partial * weights[:, None], axis=0) / tl.sum(weights, axis=0)",
        "out = tl.sum(partial * weights[:, None], axis=0)",
    ),
)  # the weights are relative to the largest segment's, not shares that sum to 1

MUTANTS = {
    "online_forgets_to_rescale_acc": {"online_softmax_attention": online_forgets_to_rescale_acc},
    "online_without_running_max": {"online_softmax_attention": online_without_running_max},
    "online_max_of_the_tile_only": {"online_softmax_attention": online_max_of_the_tile_only},
    "online_drops_the_partial_tile": {"online_softmax_attention": online_drops_the_partial_tile},
    "contiguous_gqa_heads_interleaved": {"contiguous_decode_kernel": contiguous_gqa_heads_interleaved},
    "contiguous_scale_after_softmax": {"contiguous_decode_kernel": contiguous_scale_after_softmax},
    "contiguous_attends_past_seq_len": {"contiguous_decode_kernel": contiguous_attends_past_seq_len},
    "contiguous_forgets_to_rescale": {"contiguous_decode_kernel": contiguous_forgets_to_rescale},
    "store_ignores_padding_slot": {"kv_store_kernel": store_ignores_padding_slot},
    "store_at_token_index": {"kv_store_kernel": store_at_token_index},
    "store_mask_from_padded_heads": {"kv_store_kernel": store_mask_from_padded_heads},
    "store_rows_from_padded_tile": {"kv_store_kernel": store_rows_from_padded_tile},
    "decode_ignores_block_table": {"paged_decode_kernel": decode_ignores_block_table},
    "decode_one_block_per_tile": {"paged_decode_kernel": decode_one_block_per_tile},
    "decode_without_running_max": {"paged_decode_kernel": decode_without_running_max},
    "decode_forgets_to_rescale": {"paged_decode_kernel": decode_forgets_to_rescale},
    "decode_attends_past_seq_len": {"paged_decode_kernel": decode_attends_past_seq_len},
    "decode_gqa_heads_interleaved": {"paged_decode_kernel": decode_gqa_heads_interleaved},
    "split_lse_is_the_max": {"paged_decode_split_kernel": split_lse_is_the_max},
    "split_output_unnormalised": {"paged_decode_split_kernel": split_output_unnormalised},
    "split_segment_length_rounded_down": {"paged_decode_split_kernel": split_segment_length_rounded_down},
    "split_empty_segment_divides_by_zero": {"paged_decode_split_kernel": split_empty_segment_divides_by_zero},
    "split_segments_not_whole_tiles": {"paged_decode_split_kernel": split_segments_not_whole_tiles},
    "merge_averages_segments": {"merge_splits_kernel": merge_averages_segments},
    "merge_without_the_max": {"merge_splits_kernel": merge_without_the_max},
    "merge_padded_lanes_weighted": {"merge_splits_kernel": merge_padded_lanes_weighted},
    "merge_forgets_the_denominator": {"merge_splits_kernel": merge_forgets_the_denominator},
}

# One mutant per exercise that must also break the capstone (SmolLM2's tokens through the learner's pieces).
CAPSTONE_MUTANTS = {
    "online_softmax_attention": "online_forgets_to_rescale_acc",
    "contiguous_decode_kernel": "contiguous_gqa_heads_interleaved",
    "kv_store_kernel": "store_at_token_index",
    "paged_decode_kernel": "decode_one_block_per_tile",
    "paged_decode_split_kernel": "split_empty_segment_divides_by_zero",
    "merge_splits_kernel": "merge_averages_segments",
}

# The statements each exercise's question is about, as `ast.unparse` writes them (a compound statement by its
# header). Hint 2 may show none of them, and nothing under chapters/ may state them (tests/test_hints.py): they
# live here, beside the wrong answers, because a learner reads the chapter's test file.
DECISIVE = {
    "online_softmax_attention": [
        'm_new = torch.maximum(m_i, s.max(dim=1).values)',
        'l_i = alpha * l_i + p.sum(dim=1)',
        'acc = alpha[:, None] * acc + p @ v',
    ],
    "contiguous_decode_kernel": [
        "s = tl.where(mask_n[None, :], s, float('-inf'))",
        'l_i = l_i * alpha + tl.sum(p, axis=1)',
        'acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)',
    ],
    "kv_store_kernel": [
        'block_idx = slot // BLOCK_SIZE',
        'block_offset = slot % BLOCK_SIZE',
    ],
    "paged_decode_kernel": [
        'block_ids = tl.load(block_tables_ptr + seq * stride_bts + offs_pos // BLOCK_SIZE, mask=mask_n, other=0)',
        'kv_offs = block_ids.to(tl.int64) * stride_cb + offs_pos % BLOCK_SIZE * stride_cs + kv_head * stride_ch',
    ],
    "paged_decode_split_kernel": [
        'split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N',
        'split_end = tl.minimum(split_start + split_len, seq_len)',
        'for start in range(split_start, split_end, TILE_N):',
    ],
    "merge_splits_kernel": [
        'weights = tl.exp(lse - lse_max)',
        'out = tl.sum(partial * weights[:, None], axis=0) / tl.sum(weights, axis=0)',
    ],
}

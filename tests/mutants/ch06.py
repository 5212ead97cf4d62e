"""Plausible wrong answers to chapter 06's exercises. Each must fail at least one test of its exercise.

A mutant is the reference kernel with one fragment of its source replaced, so each reads as a diff: the
fragment the reference has, and what the mistaken kernel has instead. `mutate` checks the fragment exists, so
a change to the reference cannot silently turn a mutant into a copy of it.
"""

import inspect
import textwrap

import kernels  # noqa: F401  (first: sets TRITON_INTERPRET on a machine without CUDA)
import triton
import triton.language as tl

from kernels import kv_store, paged_decode


def mutate(kernel: object, name: str, *edits: tuple[str, str]) -> object:
    """`kernel` (a Triton kernel) with each `(old, new)` source fragment replaced, compiled as kernel `name`."""
    source = textwrap.dedent(inspect.getsource(kernel.fn))
    source = source.replace(f"def {kernel.fn.__name__}(", f"def {name}(", 1)
    for old, new in edits:
        if source.count(old) != 1:
            raise ValueError(f"mutant {name}: {old!r} occurs {source.count(old)} times in the reference, not once")
        source = source.replace(old, new)
    source = source.split("\n", 1)[1]  # drop the @triton.jit line; jit it below
    namespace = {"triton": triton, "tl": tl}
    exec(compile(source, f"<mutant {name}>", "exec"), namespace)
    fn = namespace[name]
    fn.__source__ = source
    return triton.jit(fn)


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

# --- paged_decode_kernel ---------------------------------------------------------------------------------------------

decode_ignores_block_table = mutate(
    paged_decode.paged_decode_kernel, "decode_ignores_block_table",
    (
        "block_ids = tl.load(block_tables_ptr + seq * stride_bts + offs_pos // BLOCK_SIZE, mask=mask_n, other=0)",
        "block_ids = seq * stride_bts + offs_pos // BLOCK_SIZE",
    ),
)  # reads the sequence's blocks in order, as if block i of sequence b were block b * max_blocks + i

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

# --- paged_decode_split_kernel ---------------------------------------------------------------------------------------

split_lse_is_the_max = mutate(
    paged_decode.paged_decode_split_kernel, "split_lse_is_the_max",
    ("lse = tl.where(nonempty, m_i + tl.log(l_safe), float(\"-inf\"))", "lse = m_i"),
)  # forgets the segment's denominator: a long segment weighs as much as a one-token one

split_output_unnormalised = mutate(
    paged_decode.paged_decode_split_kernel, "split_output_unnormalised",
    ("out = acc / l_safe[:, None]  # (G, D)", "out = acc  # (G, D)"),
)  # the merge expects each segment's own softmax output, acc / l

# --- merge_splits_kernel ---------------------------------------------------------------------------------------------

merge_averages_segments = mutate(
    paged_decode.merge_splits_kernel, "merge_averages_segments",
    ("weights = tl.exp(lse - lse_max)  # (K,) 0 for empty segments", "weights = tl.where(mask_k, 1.0, 0.0)  # (K,)"),
)  # averages the partial outputs instead of weighting them by their log-sum-exp

MUTANTS = {
    "store_ignores_padding_slot": {"kv_store_kernel": store_ignores_padding_slot},
    "store_at_token_index": {"kv_store_kernel": store_at_token_index},
    "decode_ignores_block_table": {"paged_decode_kernel": decode_ignores_block_table},
    "decode_without_running_max": {"paged_decode_kernel": decode_without_running_max},
    "decode_forgets_to_rescale": {"paged_decode_kernel": decode_forgets_to_rescale},
    "decode_attends_past_seq_len": {"paged_decode_kernel": decode_attends_past_seq_len},
    "split_lse_is_the_max": {"paged_decode_split_kernel": split_lse_is_the_max},
    "split_output_unnormalised": {"paged_decode_split_kernel": split_output_unnormalised},
    "merge_averages_segments": {"merge_splits_kernel": merge_averages_segments},
}

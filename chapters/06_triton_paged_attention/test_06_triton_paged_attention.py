"""Grading tests for chapter 06 — Triton paged attention, run in Triton's interpreter on the CPU.

Each test grades one exercise (`@pytest.mark.exercise`). An exercise is a Triton kernel; the tests launch it
through the course's wrappers in `kernels/` (which check the arguments and compute the grid), passing the
kernel under test. The oracles are independent of the kernels: dense per-sequence K/V tensors scattered into a
paged cache through shuffled block tables, and PyTorch's fused attention over the dense tensors. Shapes are
small: every interpreted loop iteration costs milliseconds.
"""

import contextlib
import functools
from collections.abc import Iterator

import kernels  # noqa: F401  (first: sets TRITON_INTERPRET on a machine without CUDA)
import pytest
import torch
import torch.nn.functional as F

from grading import ExerciseError, expect_close, expect_equal
from kernels import kv_store, paged_decode
from kernels.kv_store import store_kv_cache
from kernels.paged_decode import paged_decode_attention

REFERENCE = {
    "kv_store_kernel": kv_store.kv_store_kernel,
    "paged_decode_kernel": paged_decode.paged_decode_kernel,
    "paged_decode_split_kernel": paged_decode.paged_decode_split_kernel,
    "merge_splits_kernel": paged_decode.merge_splits_kernel,
}

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def launching(name: str, inputs: str) -> Iterator[None]:
    """Report a kernel's failure (a stub's NotImplementedError, or a bug the interpreter caught) as the
    exercise's. The interpreter wraps exceptions raised inside a kernel in its own InterpreterError."""
    try:
        yield
    except AssertionError:
        raise
    except ExerciseError:
        raise
    except Exception as error:
        if "NotImplementedError" in f"{type(error).__name__}: {error!r}":
            raise ExerciseError(f"exercise `{name}` is not implemented yet (see its hint)") from None
        raise ExerciseError(f"exercise `{name}` raised {type(error).__name__}: {error}\n  on input: {inputs}") from error


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@functools.cache
def paged_case(
    lengths: tuple[int, ...], block_size: int, num_kv_heads: int, head_dim: int, seed: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense K, V per sequence (L, Hkv, D); a paged cache of random garbage holding them through shuffled block
    tables whose unused entries point at other real blocks; the tables (int32) and lengths (int32)."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lengths) + 1
    num_blocks = len(lengths) * max_blocks + 2
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lengths) * max_blocks].reshape(len(lengths), max_blocks)
    keys, values = [], []
    for b, n in enumerate(lengths):
        k, v = torch.randn(n, num_kv_heads, head_dim, generator=gen), torch.randn(n, num_kv_heads, head_dim, generator=gen)
        for p in range(n):  # position p -> block tables[b, p // block_size], offset p % block_size
            key_cache[tables[b, p // block_size], p % block_size] = k[p]
            value_cache[tables[b, p // block_size], p % block_size] = v[p]
        keys.append(k)
        values.append(v)
    return keys, values, key_cache, value_cache, tables.to(torch.int32), torch.tensor(lengths, dtype=torch.int32)


def dense_decode(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float) -> torch.Tensor:
    """The oracle: PyTorch's fused attention of each query (Hq, D) over its dense K/V (L, Hkv, D), in fp64."""
    out = []
    for b, (k, v) in enumerate(zip(keys, values, strict=True)):
        q = query[b].double()[:, None, :]  # (Hq, 1, D)
        o = F.scaled_dot_product_attention(
            q, k.double().transpose(0, 1), v.double().transpose(0, 1), scale=scale, enable_gqa=True
        )  # (Hq, 1, D)
        out.append(o[:, 0])
    return torch.stack(out).to(query.dtype)  # (B, Hq, D)


# --- kv_store_kernel ---------------------------------------------------------------------------------------------


def store_case(slots: list[int], block_size: int = 16, num_kv_heads: int = 2, head_dim: int = 32, seed: int = 0):
    """A cache with one guard block in front of it (a padding token written at slot -1 would land there)."""
    num_blocks = max(slots) // block_size + 2
    buffer_k = randn(num_blocks + 1, block_size, num_kv_heads, head_dim, seed=seed)
    buffer_v = randn(num_blocks + 1, block_size, num_kv_heads, head_dim, seed=seed + 1)
    key = randn(len(slots), num_kv_heads, head_dim, seed=seed + 2)
    value = randn(len(slots), num_kv_heads, head_dim, seed=seed + 3)
    return buffer_k, buffer_v, key, value, torch.tensor(slots, dtype=torch.long)


def expected_store(buffer: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    want = buffer.clone()
    num_kv_heads, head_dim = buffer.shape[2:]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[1:].reshape(-1, num_kv_heads, head_dim)[slot] = new[t]
    return want


@pytest.mark.exercise("kv_store_kernel")
@pytest.mark.parametrize("slots", [[0, 1, 2], [37, 5, 16, 63, 31], [70, 3, 48]])
def test_store_writes_each_token_at_its_slot(impl, slots):
    buffer_k, buffer_v, key, value, slot_mapping = store_case(slots)
    want_k, want_v = expected_store(buffer_k, key, slot_mapping), expected_store(buffer_v, value, slot_mapping)
    inputs = f"slot_mapping={slots}, block_size 16, Hkv 2, D 32"
    with launching("kv_store_kernel", inputs):
        store_kv_cache(key, value, buffer_k[1:], buffer_v[1:], slot_mapping, kernel=impl.kv_store_kernel)
    expect_close(buffer_k[1:], want_k[1:], inputs=f"{inputs}; key_cache", atol=0, rtol=0)
    expect_close(buffer_v[1:], want_v[1:], inputs=f"{inputs}; value_cache", atol=0, rtol=0)


@pytest.mark.exercise("kv_store_kernel")
def test_store_skips_padding_slots(impl):
    slots = [17, -1, 4, -1]
    buffer_k, buffer_v, key, value, slot_mapping = store_case(slots, seed=5)
    want_k, want_v = expected_store(buffer_k, key, slot_mapping), expected_store(buffer_v, value, slot_mapping)
    inputs = f"slot_mapping={slots} (-1: a padding token, store nothing)"
    with launching("kv_store_kernel", inputs):
        store_kv_cache(key, value, buffer_k[1:], buffer_v[1:], slot_mapping, kernel=impl.kv_store_kernel)
    expect_close(buffer_k, want_k, inputs=f"{inputs}; the key cache and the memory just before it", atol=0, rtol=0)
    expect_close(buffer_v, want_v, inputs=f"{inputs}; the value cache and the memory just before it", atol=0, rtol=0)


# --- paged_decode_kernel -------------------------------------------------------------------------------------------


def decode_case(lengths, block_size=16, num_kv_heads=2, group=4, head_dim=32, dtype=torch.float32, q_scale=1.0, seed=0):
    keys, values, key_cache, value_cache, tables, seq_lens = paged_case(tuple(lengths), block_size, num_kv_heads, head_dim, seed)
    query = randn(len(lengths), num_kv_heads * group, head_dim, seed=seed + 7) * q_scale
    scale = head_dim**-0.5
    want = dense_decode(query, keys, values, scale)
    args = (query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), tables, seq_lens, scale)
    inputs = f"seq_lens {list(lengths)}, block_size {block_size}, Hkv {num_kv_heads}, G {group}, D {head_dim}, {str(dtype)[6:]}"
    return args, want, inputs


def run_decode(impl, args, num_splits: int, exercise: str, inputs: str) -> torch.Tensor:
    # only the exercise's own kernel comes from `impl`: the others are the reference's (maybe not written yet)
    keyword = {"paged_decode_kernel": "decode_kernel", "paged_decode_split_kernel": "split_kernel",
               "merge_splits_kernel": "merge_kernel"}[exercise]
    kernels_under_test = {keyword: getattr(impl, exercise)}
    with launching(exercise, inputs):
        return paged_decode_attention(*args, num_splits=num_splits, **kernels_under_test)


@pytest.mark.exercise("paged_decode_kernel")
@pytest.mark.parametrize(
    "lengths, block_size, group",
    [([1, 16, 37], 16, 4), ([5, 32, 70], 32, 1), ([64, 9, 33], 16, 3), ([20, 48], 16, 8)],
)
def test_decode_matches_attention_over_the_dense_context(impl, lengths, block_size, group):
    args, want, inputs = decode_case(lengths, block_size=block_size, group=group)
    got = run_decode(impl, args, 1, "paged_decode_kernel", inputs)
    expect_close(got, want, inputs=inputs, atol=1e-5, rtol=1e-4)


@pytest.mark.exercise("paged_decode_kernel")
def test_decode_follows_a_shuffled_block_table(impl):
    """Block p // block_size of a sequence is wherever its table says, not the p // block_size-th of the pool."""
    args, want, inputs = decode_case([40, 50], seed=3)
    got = run_decode(impl, args, 1, "paged_decode_kernel", inputs + f"; block tables {args[3].tolist()}")
    expect_close(got, want, inputs=inputs + f"; block tables {args[3].tolist()}", atol=1e-5, rtol=1e-4)


@pytest.mark.exercise("paged_decode_kernel")
def test_decode_keeps_large_scores_finite(impl):
    """Scores in the hundreds: exp() overflows fp32 (above 88.7) unless the running maximum is subtracted."""
    args, want, inputs = decode_case([30, 45], q_scale=60.0, seed=4)
    got = run_decode(impl, args, 1, "paged_decode_kernel", inputs + "; queries scaled by 60")
    expect_close(got, want, inputs=inputs + "; queries scaled by 60, scores in the hundreds", atol=1e-3, rtol=1e-3)


@pytest.mark.exercise("paged_decode_kernel")
@pytest.mark.parametrize("dtype, atol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_decode_upcasts_half_precision(impl, dtype, atol):
    args, want, inputs = decode_case([17, 33], dtype=dtype, seed=5)
    got = run_decode(impl, args, 1, "paged_decode_kernel", inputs)
    expect_equal(got.dtype, dtype, inputs=f"{inputs}; output dtype")
    expect_close(got.float(), want.float(), inputs=inputs, atol=atol, rtol=atol)


# --- paged_decode_split_kernel and merge_splits_kernel ---------------------------------------------------------------


@pytest.mark.exercise("paged_decode_split_kernel")
@pytest.mark.parametrize("lengths, num_splits", [([70, 33], 2), ([100, 1, 64], 3), ([20, 90], 4)])
def test_split_partials_merge_to_the_full_softmax(impl, lengths, num_splits):
    """Graded with the reference merge: segments shorter than a tile, and empty ones, must still merge right."""
    args, want, inputs = decode_case(lengths, seed=6)
    inputs += f", num_splits {num_splits}"
    got = run_decode(impl, args, num_splits, "paged_decode_split_kernel", inputs)
    expect_close(got, want, inputs=inputs, atol=1e-5, rtol=1e-4)


@pytest.mark.exercise("paged_decode_split_kernel")
def test_split_keeps_large_scores_finite(impl):
    args, want, inputs = decode_case([90, 60], q_scale=60.0, seed=8)
    got = run_decode(impl, args, 2, "paged_decode_split_kernel", inputs + ", num_splits 2, queries scaled by 60")
    expect_close(got, want, inputs=inputs + ", num_splits 2, queries scaled by 60", atol=1e-3, rtol=1e-3)


@pytest.mark.exercise("merge_splits_kernel")
@pytest.mark.parametrize("lengths, num_splits", [([70, 33], 2), ([100, 1, 64], 4)])
def test_merge_gives_the_full_softmax(impl, lengths, num_splits):
    """Graded with the reference split kernel."""
    args, want, inputs = decode_case(lengths, seed=9)
    inputs += f", num_splits {num_splits}"
    got = run_decode(impl, args, num_splits, "merge_splits_kernel", inputs)
    expect_close(got, want, inputs=inputs, atol=1e-5, rtol=1e-4)


@pytest.mark.exercise("merge_splits_kernel")
def test_merge_weights_segments_by_their_log_sum_exp(impl):
    """Hand-made partials for one head: segment outputs 1, 3 and (empty) 0, lse log(1), log(3) and -inf.
    The softmax over the whole context weighs them 1 : 3 : 0, so the output is (1·1 + 3·3) / 4 = 2.5."""
    head_dim = 16
    partial_out = torch.stack([torch.full((head_dim,), 1.0), torch.full((head_dim,), 3.0), torch.zeros(head_dim)])
    partial_out = partial_out.reshape(1, 1, 3, head_dim).contiguous()  # (seqs, heads, splits, D)
    partial_lse = torch.tensor([0.0, float(torch.log(torch.tensor(3.0))), float("-inf")]).reshape(1, 1, 3)
    out = torch.empty(1, 1, head_dim)
    inputs = "partial outputs [1, 3, 0], lse [log 1, log 3, -inf]"
    with launching("merge_splits_kernel", inputs):
        impl.merge_splits_kernel[(1, 1)](
            out, partial_out, partial_lse, out.stride(0), out.stride(1),
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_lse.stride(0), partial_lse.stride(1), head_dim,
            NUM_SPLITS=3, SPLITS_PADDED=4, HEAD_DIM_PADDED=head_dim,
        )
    expect_close(out, torch.full((1, 1, head_dim), 2.5), inputs=inputs, atol=1e-6, rtol=1e-6)

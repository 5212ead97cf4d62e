"""Grading tests for chapter 06 — Triton paged attention, natively on a GPU or in Triton's interpreter on the CPU.

Each test grades one exercise (`@pytest.mark.exercise`). The kernels are launched through the course's wrappers in
`kernels/` (which check the arguments and compute the grid), passing the kernel under test. The oracles owe nothing
to the kernels: a whole-row softmax in float64 for the online softmax; dense per-sequence K/V scattered into a
paged cache through shuffled block tables, and PyTorch's fused attention over the dense tensors, for the decode
kernels; a slot-by-slot copy for the store. Inputs are built on the CPU from fixed seeds and moved to
`grading.devices.DEVICE` by `on_device`. Shapes are small: every interpreted loop iteration costs milliseconds.

The capstones run the pieces together on SmolLM2-135M-Instruct and compare with Hugging Face's stored greedy
tokens: the warm-ups through chapter 2's contiguous cache, the paged kernels inside the engine's Triton backend.
"""

import contextlib
import functools
from collections.abc import Iterator

import kernels  # noqa: F401  (first: sets TRITON_INTERPRET on a machine without CUDA)
import pytest
import torch
import torch.nn.functional as F

from grading import ExerciseError, expect_close, expect_equal
from grading.capstone import CAPSTONE_PROMPTS, smollm2, smollm2_greedy, swap_in
from grading.devices import DEVICE
from kernels import contiguous_decode, kv_store, online_softmax, paged_decode
from kernels.contiguous_decode import contiguous_decode_attention
from kernels.kv_store import store_kv_cache
from kernels.paged_decode import paged_decode_attention
from solutions import LLM, SamplingParams
from solutions.baselines.contiguous_cache import ContiguousKVCache

REFERENCE = {
    "online_softmax_attention": online_softmax.online_softmax_attention,
    "contiguous_decode_kernel": contiguous_decode.contiguous_decode_kernel,
    "kv_store_kernel": kv_store.kv_store_kernel,
    "paged_decode_kernel": paged_decode.paged_decode_kernel,
    "paged_decode_split_kernel": paged_decode.paged_decode_split_kernel,
    "merge_splits_kernel": paged_decode.merge_splits_kernel,
}

pytestmark = pytest.mark.timeout(180)


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


def on_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels' inputs, built on the CPU from fixed seeds, moved to the device the kernels run on."""
    return tuple(t.to(DEVICE) for t in tensors)


def dense_decode(
    query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """The oracle: PyTorch's fused attention of each query (Hq, D) over its dense K/V (L, Hkv, D), in fp64."""
    out = []
    for b, (k, v) in enumerate(zip(keys, values, strict=True)):
        q = query[b].double()[:, None, :]  # (Hq, 1, D)
        o = F.scaled_dot_product_attention(
            q, k.double().transpose(0, 1), v.double().transpose(0, 1), scale=scale, enable_gqa=True
        )  # (Hq, 1, D)
        out.append(o[:, 0])
    return torch.stack(out).to(query.dtype)  # (B, Hq, D)


# --- online_softmax_attention -----------------------------------------------------------------------------------------


def softmax_oracle(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whole rows at once, in float64: (softmax(scores) @ values, row max, sum of exp(score - row max))."""
    s = scores.double()
    m = s.max(dim=1).values
    return (s.softmax(dim=1) @ values.double()).float(), m.float(), torch.exp(s - m[:, None]).sum(dim=1).float()


def check_online(impl, scores: torch.Tensor, values: torch.Tensor, tile_n: int, inputs: str, tol: float = 1e-5) -> None:
    got = impl.online_softmax_attention(*on_device(scores, values), tile_n)
    if not (isinstance(got, tuple) and len(got) == 3):
        raise AssertionError(f"on input {inputs}: expected a tuple (out, m_i, l_i), got {type(got).__name__}")
    want_out, want_m, want_l = softmax_oracle(scores, values)
    expect_close(got[0].cpu(), want_out, inputs=f"{inputs}; out", atol=tol, rtol=tol)
    expect_close(got[1].cpu(), want_m, inputs=f"{inputs}; m_i (the final running max)", atol=0, rtol=0)
    expect_close(got[2].cpu(), want_l, inputs=f"{inputs}; l_i (the final running sum)", atol=tol, rtol=tol)


@pytest.mark.exercise("online_softmax_attention")
@pytest.mark.parametrize("seq_len, tile_n", [(37, 8), (32, 16), (50, 7), (5, 16), (1, 4)])
def test_online_softmax_matches_softmax_weighted_sums(impl, seq_len, tile_n):
    scores, values = randn(3, seq_len, seed=seq_len) * 3, randn(seq_len, 8, seed=seq_len + 1)
    inputs = f"scores randn(3, {seq_len})*3, values randn({seq_len}, 8), tile_n {tile_n}"
    check_online(impl, scores, values, tile_n, inputs)


@pytest.mark.exercise("online_softmax_attention")
def test_online_softmax_keeps_large_scores_finite(impl):
    """Scores in the hundreds, the largest in the first tile of row 0 and the last tile of row 1: exp() overflows
    fp32 above 88.7 unless every exponent is taken against the running maximum of everything seen so far."""
    scores = randn(2, 40, seed=3) * 20
    scores[0, 2], scores[1, 38] = 900.0, 700.0
    values = randn(40, 8, seed=4)
    check_online(impl, scores, values, 8, "scores randn(2, 40)*20 with 900 at [0, 2] and 700 at [1, 38], tile_n 8",
                 tol=1e-4)


@pytest.mark.exercise("online_softmax_attention")
def test_online_softmax_rescales_earlier_tiles(impl):
    """Each tile's scores larger than the last: every tile moves the maximum, so every tile must rescale."""
    scores = torch.arange(24, dtype=torch.float32)[None, :].repeat(2, 1) * torch.tensor([[0.5], [2.0]])
    values = randn(24, 4, seed=5)
    check_online(impl, scores, values, 4, "scores 0, 0.5, 1, ... (row 0) and 0, 2, 4, ... (row 1), tile_n 4")


# --- contiguous_decode_kernel -----------------------------------------------------------------------------------------


def contiguous_case(lengths, num_kv_heads=3, group=3, head_dim=64, q_scale=1.0, seed=0):
    """A contiguous cache (num_seqs, max_len, Hkv, D) of random values: rows past seq_len hold garbage too."""
    max_len = max(lengths) + 5
    key_cache = randn(len(lengths), max_len, num_kv_heads, head_dim, seed=seed)
    value_cache = randn(len(lengths), max_len, num_kv_heads, head_dim, seed=seed + 1)
    query = randn(len(lengths), num_kv_heads * group, head_dim, seed=seed + 2) * q_scale
    scale = head_dim**-0.5
    keys = [key_cache[b, :n] for b, n in enumerate(lengths)]
    values = [value_cache[b, :n] for b, n in enumerate(lengths)]
    want = dense_decode(query, keys, values, scale)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    inputs = f"seq_lens {list(lengths)} of max_len {max_len}, Hkv {num_kv_heads}, G {group}, D {head_dim}"
    return (*on_device(query, key_cache, value_cache, seq_lens), scale), want, inputs


def run_contiguous(impl, args, inputs: str) -> torch.Tensor:
    with launching("contiguous_decode_kernel", inputs):
        return contiguous_decode_attention(*args, kernel=impl.contiguous_decode_kernel).cpu()


@pytest.mark.exercise("contiguous_decode_kernel")
@pytest.mark.parametrize("lengths, num_kv_heads, group", [([1, 16, 37], 3, 3), ([20, 5], 2, 4), ([33], 1, 1)])
def test_contiguous_decode_matches_attention(impl, lengths, num_kv_heads, group):
    args, want, inputs = contiguous_case(lengths, num_kv_heads, group)
    expect_close(run_contiguous(impl, args, inputs), want, inputs=inputs, atol=1e-5, rtol=1e-4)


@pytest.mark.exercise("contiguous_decode_kernel")
def test_contiguous_decode_keeps_large_scores_finite(impl):
    args, want, inputs = contiguous_case([30, 45], num_kv_heads=2, group=2, q_scale=60.0, seed=4)
    inputs += "; queries scaled by 60, scores in the hundreds"
    expect_close(run_contiguous(impl, args, inputs), want, inputs=inputs, atol=1e-3, rtol=1e-3)


# --- kv_store_kernel -------------------------------------------------------------------------------------------------


def store_case(slots: list[int], block_size: int = 16, num_kv_heads: int = 2, head_dim: int = 32, seed: int = 0):
    """Caches with guard memory on both sides, and K/V as views into buffers one token longer: a store outside
    its slot lands in a guard or a neighbour, and a load past the last token reads real memory."""
    num_blocks = max(slots) // block_size + 2
    guard = num_blocks + 1  # blocks of guard after the cache: room for a row computed from padded sizes
    buffer_k = randn(1 + num_blocks + guard, block_size, num_kv_heads, head_dim, seed=seed)
    buffer_v = randn(1 + num_blocks + guard, block_size, num_kv_heads, head_dim, seed=seed + 1)
    key = randn(len(slots) + 1, num_kv_heads, head_dim, seed=seed + 2)
    value = randn(len(slots) + 1, num_kv_heads, head_dim, seed=seed + 3)
    slot_mapping = torch.tensor(slots, dtype=torch.long)
    return (*on_device(buffer_k, buffer_v, key, value, slot_mapping), num_blocks)


def expected_store(buffer: torch.Tensor, new: torch.Tensor, slots: list[int], num_blocks: int) -> torch.Tensor:
    want = buffer.cpu().clone()
    num_kv_heads, head_dim = buffer.shape[2:]
    for t, slot in enumerate(slots):
        if slot >= 0:
            want[1 : 1 + num_blocks].reshape(-1, num_kv_heads, head_dim)[slot] = new[t].cpu()
    return want


def run_store(impl, slots: list[int], inputs: str, **case) -> None:
    buffer_k, buffer_v, key, value, slot_mapping, num_blocks = store_case(slots, **case)
    want_k = expected_store(buffer_k, key, slots, num_blocks)
    want_v = expected_store(buffer_v, value, slots, num_blocks)
    caches = buffer_k[1 : 1 + num_blocks], buffer_v[1 : 1 + num_blocks]
    with launching("kv_store_kernel", inputs):
        store_kv_cache(key[:-1], value[:-1], *caches, slot_mapping, kernel=impl.kv_store_kernel)
    where = "; the key cache and the memory on both sides of it"
    expect_close(buffer_k.cpu(), want_k, inputs=inputs + where, atol=0, rtol=0)
    expect_close(buffer_v.cpu(), want_v, inputs=inputs + where.replace("key", "value"), atol=0, rtol=0)


@pytest.mark.exercise("kv_store_kernel")
@pytest.mark.parametrize("slots", [[0, 1, 2], [37, 5, 16, 63, 31], [70, 3, 48]])
def test_store_writes_each_token_at_its_slot(impl, slots):
    run_store(impl, slots, f"slot_mapping={slots}, block_size 16, Hkv 2, D 32")


@pytest.mark.exercise("kv_store_kernel")
def test_store_skips_padding_slots(impl):
    slots = [17, -1, 4, -1]
    run_store(impl, slots, f"slot_mapping={slots} (-1: a padding token, store nothing)", seed=5)


@pytest.mark.exercise("kv_store_kernel")
@pytest.mark.parametrize("num_kv_heads, head_dim", [(3, 64), (3, 48), (1, 32)])
def test_store_handles_kv_head_counts_that_are_not_powers_of_two(impl, num_kv_heads, head_dim):
    """SmolLM2 has 3 KV heads: the kernel's tile is padded to 4 rows, and the padding row must touch nothing."""
    slots = [5, 6, 20, 0, 31]
    run_store(impl, slots, f"slot_mapping={slots}, block_size 16, Hkv {num_kv_heads}, D {head_dim}",
              num_kv_heads=num_kv_heads, head_dim=head_dim, seed=7)


# --- paged_decode_kernel -------------------------------------------------------------------------------------------


@functools.cache
def paged_case(lengths: tuple[int, ...], block_size: int, num_kv_heads: int, head_dim: int, seed: int = 0):
    """Dense K, V per sequence (L, Hkv, D); a paged cache of random garbage holding them through shuffled block
    tables whose unused entries point at other real blocks; the tables (int32) and lengths (int32). CPU tensors."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lengths) + 1
    num_blocks = len(lengths) * max_blocks + 2
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lengths) * max_blocks].reshape(len(lengths), max_blocks)
    keys, values = [], []
    for b, n in enumerate(lengths):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        for p in range(n):  # position p -> block tables[b, p // block_size], offset p % block_size
            key_cache[tables[b, p // block_size], p % block_size] = k[p]
            value_cache[tables[b, p // block_size], p % block_size] = v[p]
        keys.append(k)
        values.append(v)
    return keys, values, key_cache, value_cache, tables.to(torch.int32), torch.tensor(lengths, dtype=torch.int32)


def decode_case(lengths, block_size=16, num_kv_heads=2, group=4, head_dim=32, dtype=torch.float32, q_scale=1.0, seed=0):
    keys, values, key_cache, value_cache, tables, seq_lens = paged_case(
        tuple(lengths), block_size, num_kv_heads, head_dim, seed
    )
    query = randn(len(lengths), num_kv_heads * group, head_dim, seed=seed + 7) * q_scale
    scale = head_dim**-0.5
    want = dense_decode(query, keys, values, scale)
    args = (*on_device(query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), tables, seq_lens), scale)
    tile_n = paged_decode._tile_n(block_size)
    inputs = (
        f"seq_lens {list(lengths)}, block_size {block_size} (TILE_N {tile_n}), Hkv {num_kv_heads}, G {group}, "
        f"D {head_dim}, {str(dtype)[6:]}, shuffled block tables"
    )
    return args, want, inputs


def run_decode(impl, args, num_splits: int, exercise: str, inputs: str) -> torch.Tensor:
    # only the exercise's own kernel comes from `impl`: the others are the reference's (maybe not written yet)
    keyword = {"paged_decode_kernel": "decode_kernel", "paged_decode_split_kernel": "split_kernel",
               "merge_splits_kernel": "merge_kernel"}[exercise]
    kernels_under_test = {keyword: getattr(impl, exercise)}
    tile_n = paged_decode._tile_n(args[1].shape[1])  # small tiles on every device: short contexts cross tiles
    with launching(exercise, inputs):
        return paged_decode_attention(*args, num_splits=num_splits, tile_n=tile_n, **kernels_under_test).cpu()


@pytest.mark.exercise("paged_decode_kernel")
@pytest.mark.parametrize(
    "lengths, block_size, num_kv_heads, group",
    [
        ([1, 16, 37], 16, 2, 4),  # a tile is a block
        ([5, 32, 70], 32, 2, 1),
        ([64, 9, 33], 8, 3, 3),  # TILE_N 16 > block_size 8: a tile spans two blocks; SmolLM2's 3 KV heads, G 3
        ([20, 48], 24, 2, 8),  # TILE_N 16, block_size 24: tiles straddle block boundaries
        ([130, 7], 128, 3, 3),  # TILE_N 64 < block_size 128: two tiles per block
    ],
)
def test_decode_matches_attention_over_the_dense_context(impl, lengths, block_size, num_kv_heads, group):
    args, want, inputs = decode_case(lengths, block_size=block_size, num_kv_heads=num_kv_heads, group=group)
    got = run_decode(impl, args, 1, "paged_decode_kernel", inputs)
    expect_close(got, want, inputs=inputs, atol=1e-5, rtol=1e-4)


@pytest.mark.exercise("paged_decode_kernel")
def test_decode_follows_a_shuffled_block_table(impl):
    """Block p // block_size of a sequence is wherever its table says, not the p // block_size-th of the pool."""
    args, want, inputs = decode_case([40, 50], seed=3)
    inputs += f"; block tables {args[3].tolist()}"
    expect_close(run_decode(impl, args, 1, "paged_decode_kernel", inputs), want, inputs=inputs, atol=1e-5, rtol=1e-4)


@pytest.mark.exercise("paged_decode_kernel")
def test_decode_keeps_large_scores_finite(impl):
    """Scores in the hundreds: exp() overflows fp32 (above 88.7) unless the running maximum is subtracted."""
    args, want, inputs = decode_case([30, 45], q_scale=60.0, seed=4)
    inputs += "; queries scaled by 60, scores in the hundreds"
    expect_close(run_decode(impl, args, 1, "paged_decode_kernel", inputs), want, inputs=inputs, atol=1e-3, rtol=1e-3)


@pytest.mark.exercise("paged_decode_kernel")
@pytest.mark.parametrize("dtype, atol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_decode_upcasts_half_precision(impl, dtype, atol):
    args, want, inputs = decode_case([17, 33], dtype=dtype, seed=5)
    got = run_decode(impl, args, 1, "paged_decode_kernel", inputs)
    expect_equal(got.dtype, dtype, inputs=f"{inputs}; output dtype")
    expect_close(got.float(), want.float(), inputs=inputs, atol=atol, rtol=atol)


# --- paged_decode_split_kernel and merge_splits_kernel ---------------------------------------------------------------


@pytest.mark.exercise("paged_decode_split_kernel")
@pytest.mark.parametrize(
    "lengths, num_splits, block_size, num_kv_heads, group",
    [
        ([70, 33], 2, 16, 2, 4),  # segments of 48 and 22 / 32 and 1 positions: the last one shorter
        ([100, 1, 64], 3, 16, 2, 4),  # seq_len 1: segments 1 and 2 are empty
        ([20, 90], 4, 16, 2, 4),  # seq_len 20 < 4 segments of 16: two empty segments
        ([45, 29], 2, 8, 3, 3),  # tiles spanning two blocks of 8; SmolLM2's heads
    ],
)
def test_split_partials_merge_to_the_full_softmax(impl, lengths, num_splits, block_size, num_kv_heads, group):
    """Graded with the reference merge: segments shorter than a tile, and empty ones, must still merge right."""
    args, want, inputs = decode_case(lengths, block_size=block_size, num_kv_heads=num_kv_heads, group=group, seed=6)
    inputs += f", num_splits {num_splits}"
    got = run_decode(impl, args, num_splits, "paged_decode_split_kernel", inputs)
    expect_close(got, want, inputs=inputs, atol=1e-5, rtol=1e-4)


@pytest.mark.exercise("paged_decode_split_kernel")
def test_split_keeps_large_scores_finite(impl):
    args, want, inputs = decode_case([90, 60], q_scale=60.0, seed=8)
    inputs += ", num_splits 2, queries scaled by 60"
    got = run_decode(impl, args, 2, "paged_decode_split_kernel", inputs)
    expect_close(got, want, inputs=inputs, atol=1e-3, rtol=1e-3)


@pytest.mark.exercise("merge_splits_kernel")
@pytest.mark.parametrize("lengths, num_splits", [([70, 33], 2), ([80, 1, 50], 3)])
def test_merge_gives_the_full_softmax(impl, lengths, num_splits):
    """Graded with the reference split kernel."""
    args, want, inputs = decode_case(lengths, seed=9)
    inputs += f", num_splits {num_splits}"
    got = run_decode(impl, args, num_splits, "merge_splits_kernel", inputs)
    expect_close(got, want, inputs=inputs, atol=1e-5, rtol=1e-4)


@pytest.mark.exercise("merge_splits_kernel")
def test_merge_keeps_large_log_sum_exps_finite(impl):
    """Scores in the hundreds make each segment's log-sum-exp exceed 88.7: exp(lse) alone overflows fp32."""
    args, want, inputs = decode_case([90, 60], q_scale=60.0, seed=10)
    inputs += ", num_splits 2, queries scaled by 60 (lse in the hundreds)"
    got = run_decode(impl, args, 2, "merge_splits_kernel", inputs)
    expect_close(got, want, inputs=inputs, atol=1e-3, rtol=1e-3)


@pytest.mark.exercise("merge_splits_kernel")
def test_merge_weights_segments_by_their_log_sum_exp(impl):
    """Hand-made partials for one head: segment outputs 1, 3 and (empty) 0, lse log(1), log(3) and -inf.
    The softmax over the whole context weighs them 1 : 3 : 0, so the output is (1·1 + 3·3) / 4 = 2.5."""
    head_dim = 16
    partial_out = torch.stack([torch.full((head_dim,), 1.0), torch.full((head_dim,), 3.0), torch.zeros(head_dim)])
    partial_out = partial_out.reshape(1, 1, 3, head_dim).contiguous()  # (seqs, heads, splits, D)
    partial_lse = torch.tensor([0.0, float(torch.log(torch.tensor(3.0))), float("-inf")]).reshape(1, 1, 3)
    out, partial_out, partial_lse = on_device(torch.empty(1, 1, head_dim), partial_out, partial_lse)
    inputs = "partial outputs [1, 3, 0], lse [log 1, log 3, -inf], NUM_SPLITS 3 (SPLITS_PADDED 4)"
    with launching("merge_splits_kernel", inputs):
        impl.merge_splits_kernel[(1, 1)](
            out, partial_out, partial_lse, out.stride(0), out.stride(1),
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_lse.stride(0), partial_lse.stride(1), head_dim,
            NUM_SPLITS=3, SPLITS_PADDED=4, HEAD_DIM_PADDED=head_dim,
        )
    expect_close(out.cpu(), torch.full((1, 1, head_dim), 2.5), inputs=inputs, atol=1e-6, rtol=1e-6)


# --- capstone: your pieces together, on the real model ----------------------------------------------------

CAPSTONE_PROMPT = 5  # "def fibonacci(n):", 6 tokens
CAPSTONE_TOKENS = 4  # the engine: decode steps over 7, 8 and 9 positions
WARMUP_TOKENS = 2  # the warm-ups: the prompt, then one decode step
CAPSTONE_BLOCK_SIZE = 4  # TILE_N 16: every tile spans four blocks
CAPSTONE_MIN_TOKENS_PER_SPLIT = 6  # instead of 256: contexts of 12 (3 blocks) split in two, of 8 do not
CAPSTONE_TILE_N = 2  # the online softmax's tiles over the prompt: 3 tiles of a 6-token prompt


class WarmupAttention:
    """Chapter 2's contiguous cache, attended by this chapter's warm-ups: the prompt through
    `online_softmax_attention` (causal scores, tiles of CAPSTONE_TILE_N positions), each new token through
    `contiguous_decode_kernel`. The `AttentionBackend` of one step of one sequence at positions start.."""

    def __init__(self, cache: ContiguousKVCache, start: int, mine) -> None:
        self.cache, self.start, self.mine = cache, start, mine

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        end = self.start + q.shape[0]
        self.cache.write(layer_idx, torch.arange(self.start, end), k, v)
        scale = q.shape[-1] ** -0.5
        if q.shape[0] == 1:  # decode: the kernel reads the whole reservation, rows past `end` are not context
            caches = self.cache.keys[layer_idx][None], self.cache.values[layer_idx][None]  # (1, max_len, Hkv, D)
            args = on_device(q, *caches, torch.tensor([end], dtype=torch.int32))
            return contiguous_decode_attention(*args, scale, kernel=self.mine.contiguous_decode_kernel).cpu()
        keys, values = self.cache.read(layer_idx, end)  # (L, Hkv, D)
        num_tokens, num_kv_heads = q.shape[0], keys.shape[1]
        group = q.shape[1] // num_kv_heads
        scores = torch.einsum("thd,lhd->htl", q, keys.repeat_interleave(group, dim=1)) * scale  # (Hq, T, L)
        future = torch.arange(end)[None, :] > torch.arange(self.start, end)[:, None]  # (T, L)
        scores = scores.masked_fill(future, float("-inf"))
        out = torch.empty_like(q)  # (T, Hq, D)
        for h in range(num_kv_heads):  # the G query heads of a KV head, all T queries: rows of one softmax call
            rows = scores[h * group : (h + 1) * group].reshape(group * num_tokens, end)  # (G*T, L)
            group_out = self.mine.online_softmax_attention(rows, values[:, h], CAPSTONE_TILE_N)[0]  # (G*T, D)
            out[:, h * group : (h + 1) * group] = group_out.reshape(group, num_tokens, -1).transpose(0, 1)
        return out


@pytest.mark.exercise("capstone")
def test_capstone_your_warmups_generate_smollm2s_tokens(impl):
    """Your online softmax (the prompt) and your contiguous decode kernel (every new token), attending over
    chapter 2's contiguous cache in SmolLM2-135M-Instruct, must produce Hugging Face's greedy tokens."""
    model, _ = smollm2()
    prompt = CAPSTONE_PROMPTS[CAPSTONE_PROMPT]
    cache = ContiguousKVCache.for_model(model, len(prompt) + WARMUP_TOKENS)
    tokens, ids, start = [], prompt, 0
    with swap_in(impl, REFERENCE) as mine, torch.no_grad(), launching("contiguous_decode_kernel", "SmolLM2 decode"):
        for _ in range(WARMUP_TOKENS):
            positions = torch.arange(start, start + len(ids))
            hidden = model(torch.tensor(ids), positions, WarmupAttention(cache, start, mine))  # (T, D_model)
            tokens.append(int(model.compute_logits(hidden[-1:])[0].argmax()))
            start, ids = start + len(ids), tokens[-1:]
    inputs = (f"SmolLM2-135M-Instruct, prompt {prompt} ('def fibonacci(n):'), {WARMUP_TOKENS} new tokens; the prompt "
              f"through your online_softmax_attention (tiles of {CAPSTONE_TILE_N}), the next token through your "
              "contiguous_decode_kernel")
    expect_equal(tokens, smollm2_greedy(CAPSTONE_PROMPT, WARMUP_TOKENS), inputs=inputs)


@pytest.mark.exercise("capstone")
def test_capstone_your_kernels_in_the_engine_generate_smollm2s_tokens(impl, monkeypatch):
    """The engine with `attention_backend="triton"` on your kv_store_kernel (every step), paged_decode_kernel
    (decode steps over 2 blocks) and split + merge kernels (the decode step over 3 blocks, split in two) must
    produce Hugging Face's greedy tokens for SmolLM2-135M-Instruct."""
    monkeypatch.setattr(paged_decode, "MIN_TOKENS_PER_SPLIT", CAPSTONE_MIN_TOKENS_PER_SPLIT)
    chosen = []  # the split count of every decode launch: proves both paths ran
    choose = paged_decode.choose_num_splits
    monkeypatch.setattr(paged_decode, "choose_num_splits", lambda *args: chosen.append(choose(*args)) or chosen[-1])
    prompt = CAPSTONE_PROMPTS[CAPSTONE_PROMPT]
    params = SamplingParams(temperature=0.0, max_tokens=CAPSTONE_TOKENS, ignore_eos=True)
    with swap_in(impl, REFERENCE), launching("the engine's Triton kernels", "SmolLM2 through the engine"):
        llm = LLM(model="smollm2-135m", attention_backend="triton", block_size=CAPSTONE_BLOCK_SIZE,
                  num_kv_blocks=16, max_num_seqs=1, device=DEVICE.type, enforce_eager=True)
        tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    paths = sorted(set(chosen))
    assert 1 in chosen and max(chosen) > 1, f"the capstone's decode steps used num_splits {paths}, not both paths"
    inputs = (f"SmolLM2-135M-Instruct, prompt {prompt} ('def fibonacci(n):'), {CAPSTONE_TOKENS} new tokens, "
              f"LLM(attention_backend='triton', block_size={CAPSTONE_BLOCK_SIZE}) on all your paged kernels")
    expect_equal(list(tokens), smollm2_greedy(CAPSTONE_PROMPT, CAPSTONE_TOKENS), inputs=inputs)

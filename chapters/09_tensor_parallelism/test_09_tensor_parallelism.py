"""Grading tests for chapter 09 — tensor parallelism.

Each test grades one exercise (`@pytest.mark.exercise`). The oracles owe nothing to the code under test: head
ranges written out by hand and the rules every partition must keep (each query head once, beside its K/V head);
the whole layer (`F.linear`, `F.embedding` on the unsplit weight) for what the ranks compute together, on a real
gloo group of 2 or 3 processes (`grading/ranks.py`), in float32 and bf16, and alone on `DEVICE` (the GPU when there
is one); one rank's greedy tokens for the engine's step in lockstep over 2 forked ranks; and, for the capstone,
Hugging Face's greedy tokens for SmolLM2 split over 2 ranks.

Nothing here waits for ever: a rank's collective gives up after the group's timeout (shortened here to
`STEP_TIMEOUT_SECONDS`), and every engine run is bounded (`grading/waits.py`), with a message that says which wait
never returned and why that usually happens.
"""

import dataclasses
import functools
import re
import time

import pytest
import torch
import torch.nn.functional as F

from grading import exercising, expect_close, expect_equal, expect_raises
from grading.capstone import CAPSTONE_PROMPTS, generate_batch, smollm2_greedy, swap_in
from grading.devices import DEVICE
from grading.impl import ExerciseError
from grading.ranks import run_on_ranks
from grading.tiny_models import tiny_checkpoint
from grading.waits import run_bounded
from solutions import LLM, SamplingParams
from solutions.distributed import layers, parallel_state
from solutions.distributed.layers import Partition
from solutions.engine.arg_utils import EngineArgs
from solutions.engine.llm_engine import LLMEngine
from solutions.executor import multiproc_executor
from solutions.model.config import ModelConfig
from solutions.worker.model_runner import ModelRunner

REFERENCE = {
    "partition": layers.partition,
    "RowParallelLinear": layers.RowParallelLinear,
    "VocabParallelEmbedding": layers.VocabParallelEmbedding,
    "execute_model_in_lockstep": multiproc_executor.execute_model_in_lockstep,
    "worker_busy_loop": multiproc_executor.worker_busy_loop,
}
DTYPES = (torch.float32, torch.bfloat16)
STEP_TIMEOUT_SECONDS = 10.0  # the group's collective timeout in the engine tests: a stuck step fails in seconds

pytestmark = pytest.mark.timeout(120)


def config(q_heads: int, kv_heads: int, *, intermediate: int = 128, vocab: int = 256, head_dim: int = 8,
           hidden: int = 32) -> ModelConfig:
    """A Llama config with these head counts (only the shapes matter here)."""
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=2, num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, qkv_bias=False, o_proj_bias=False,
        mlp_bias=False, tie_word_embeddings=False, max_position_embeddings=512, eos_token_id=None,
    )


SMOLLM2 = config(9, 3, intermediate=1536, vocab=49152, head_dim=64, hidden=576)

# --- partition ----------------------------------------------------------------------------------------------------


def partitions(impl, cfg: ModelConfig, tp_size: int, inputs: str) -> list[Partition]:
    with exercising("partition", inputs):
        return [dataclasses.astuple(p) for p in impl.partition(cfg, tp_size)]


def name(cfg: ModelConfig, tp_size: int) -> str:
    return (f"partition({cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} K/V heads, intermediate "
            f"{cfg.intermediate_size}, vocab {cfg.vocab_size}; tp_size={tp_size})")


@pytest.mark.exercise("partition")
def test_partition_deals_smollm2s_three_kv_groups_over_two_ranks(impl):
    inputs = name(SMOLLM2, 2) + " — SmolLM2's shape: 3 query heads read each K/V head"
    want = [((0, 3), (0, 1), (0, 768), (0, 24576)), ((3, 9), (1, 3), (768, 1536), (24576, 49152))]
    expect_equal(partitions(impl, SMOLLM2, 2, inputs), want, inputs=f"{inputs}; each rank's (q_heads, kv_heads, "
                 "intermediate, vocab) ranges: whole K/V groups, split_evenly(3, 2) = 1 group and 2, so 3 and 6 query "
                 "heads (splitting the 9 query heads 4 + 5 would part a query head from its K/V head)")


@pytest.mark.exercise("partition")
def test_partition_splits_evenly_when_the_groups_divide(impl):
    cases = [
        (config(4, 2), 2, [((0, 2), (0, 1), (0, 64), (0, 128)), ((2, 4), (1, 2), (64, 128), (128, 256))]),
        (config(32, 8, intermediate=14336, vocab=128256, head_dim=128, hidden=4096), 4,  # Llama-3-8B over 4
         [((0, 8), (0, 2), (0, 3584), (0, 32064)), ((8, 16), (2, 4), (3584, 7168), (32064, 64128)),
          ((16, 24), (4, 6), (7168, 10752), (64128, 96192)), ((24, 32), (6, 8), (10752, 14336), (96192, 128256))]),
        (config(4, 4, intermediate=100, vocab=7), 2,
         [((0, 2), (0, 2), (0, 50), (0, 3)), ((2, 4), (2, 4), (50, 100), (3, 7))]),
        (config(6, 3), 1, [((0, 6), (0, 3), (0, 128), (0, 256))]),
    ]
    for cfg, tp_size, want in cases:
        inputs = name(cfg, tp_size)
        expect_equal(partitions(impl, cfg, tp_size, inputs), want, inputs=f"{inputs}; each rank's (q_heads, kv_heads, "
                     "intermediate, vocab) ranges (an odd vocabulary or width: split_evenly's sizes)")


@pytest.mark.exercise("partition")
def test_partition_replicates_a_kv_head_when_ranks_outnumber_kv_heads(impl):
    cases = [
        (config(4, 1), 2, [((0, 2), (0, 1)), ((2, 4), (0, 1))]),
        (config(8, 2), 4, [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]),
        (config(12, 2), 4, [((0, 3), (0, 1)), ((3, 6), (0, 1)), ((6, 9), (1, 2)), ((9, 12), (1, 2))]),
    ]
    for cfg, tp_size, want in cases:
        inputs = name(cfg, tp_size)
        got = [(q, kv) for q, kv, _, _ in partitions(impl, cfg, tp_size, inputs)]
        expect_equal(got, want, inputs=f"{inputs}; each rank's (q_heads, kv_heads): each K/V head on "
                     f"{tp_size // cfg.num_key_value_heads} ranks, its query heads split among them")


def broken_rules(parts: list[tuple], cfg: ModelConfig, tp_size: int) -> list[str]:
    """What a partition gets wrong, by rules alone (no expected answer): [] when it is a valid split."""
    if len(parts) != tp_size:
        return [f"{len(parts)} partitions for {tp_size} ranks"]
    group, wrong = cfg.num_queries_per_kv, []
    for field, total in ((0, cfg.num_attention_heads), (2, cfg.intermediate_size), (3, cfg.vocab_size)):
        ranges = [p[field] for p in parts]
        if [a for a, _ in ranges] + [total] != [0] + [b for _, b in ranges]:
            kind = ("q_heads", "", "intermediate", "vocab")[field]
            wrong.append(f"the {kind} ranges {ranges} do not cover 0..{total} in order, each once")
    for rank, (q, kv, _, _) in enumerate(parts):
        if not (q[0] < q[1] and kv[0] < kv[1]):
            wrong.append(f"rank {rank} holds no query or no K/V head: {q}, {kv}")
        strays = [h for h in range(*q) if not kv[0] <= h // group < kv[1]]
        if strays:
            wrong.append(f"rank {rank}'s query heads {strays} read K/V heads {sorted({h // group for h in strays})}, "
                         f"which it does not hold ({kv})")
    return wrong


@pytest.mark.exercise("partition")
def test_partition_keeps_every_query_head_with_its_kv_head_over_many_shapes(impl):
    for q_heads, kv_heads in ((9, 3), (4, 2), (6, 2), (12, 4), (16, 8), (8, 1), (10, 5), (14, 7)):
        for tp_size in (1, 2, 3, 4):
            if kv_heads < tp_size and (tp_size % kv_heads or (q_heads // kv_heads) % (tp_size // kv_heads)):
                continue  # no valid split: the next test
            cfg = config(q_heads, kv_heads, intermediate=97, vocab=101)
            inputs = name(cfg, tp_size)
            wrong = broken_rules(partitions(impl, cfg, tp_size, inputs), cfg, tp_size)
            expect_equal(wrong, [], inputs=f"{inputs}; the rules a split keeps")


@pytest.mark.exercise("partition")
def test_partition_refuses_a_split_that_parts_heads(impl):
    for cfg, tp_size in ((config(4, 2), 3), (config(4, 1), 8), (config(6, 2), 4), (SMOLLM2, 4)):
        inputs = f"{name(cfg, tp_size)}: fewer K/V heads than ranks, and the ranks do not divide them evenly"
        expect_raises(ValueError, lambda cfg=cfg, tp_size=tp_size: impl.partition(cfg, tp_size), inputs=inputs)


def allowed_sizes(cfg: ModelConfig) -> list[int]:
    """Written out from the rule: 1 .. num_kv_heads, or num_kv_heads times a divisor (> 1) of the group."""
    kv, group = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    return sorted(set(range(1, kv + 1)) | {kv * r for r in range(2, group + 1) if group % r == 0})


@pytest.mark.exercise("partition")
def test_partition_refusal_names_tensor_parallel_size_and_the_allowed_values(impl):
    for cfg, tp_size in ((SMOLLM2, 4), (config(4, 2), 3), (config(12, 2), 5)):
        inputs = f"{name(cfg, tp_size)}: no valid split; whoever set tensor_parallel_size must learn what to set"
        with pytest.raises(ValueError) as refused:  # a stub's "not implemented" (an AssertionError) passes through
            impl.partition(cfg, tp_size)
        message, allowed = str(refused.value), allowed_sizes(cfg)
        named = "tensor_parallel_size" in message
        missing = sorted(set(allowed) - {int(n) for n in re.findall(r"\d+", message)})
        expect_equal((named, missing), (True, []), inputs=f"{inputs}; your message {message!r}: (does it name "
                     f"`tensor_parallel_size`?, which of the allowed values {allowed} it leaves out)")


@pytest.mark.exercise("partition")
def test_partition_replicates_each_kv_head_over_two_three_and_four_ranks(impl):
    cases = [  # (config, tp_size, each rank's (q_heads, kv_heads)), written out by hand
        (config(6, 1), 3, [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (0, 1))]),
        (config(12, 1), 4, [((0, 3), (0, 1)), ((3, 6), (0, 1)), ((6, 9), (0, 1)), ((9, 12), (0, 1))]),
        (config(6, 2), 6, [((0, 1), (0, 1)), ((1, 2), (0, 1)), ((2, 3), (0, 1)), ((3, 4), (1, 2)), ((4, 5), (1, 2)),
                           ((5, 6), (1, 2))]),
        (SMOLLM2, 9, [((h, h + 1), (h // 3, h // 3 + 1)) for h in range(9)]),  # SmolLM2 over 9: each K/V head on 3
    ]
    for cfg, tp_size, want in cases:
        inputs = name(cfg, tp_size)
        got = [(q, kv) for q, kv, _, _ in partitions(impl, cfg, tp_size, inputs)]
        expect_equal(got, want, inputs=f"{inputs}; each rank's (q_heads, kv_heads): K/V head h on ranks "
                     f"h * {tp_size // cfg.num_key_value_heads} onward, its query heads split among them")


@pytest.mark.exercise("partition")
def test_partition_deals_uneven_kv_groups_and_a_vocabulary_that_does_not_divide(impl):
    cases = [
        (config(10, 5, intermediate=100, vocab=49153), 3,  # 5 K/V groups over 3 ranks: 1, 2 and 2
         [((0, 2), (0, 1), (0, 33), (0, 16384)), ((2, 6), (1, 3), (33, 66), (16384, 32768)),
          ((6, 10), (3, 5), (66, 100), (32768, 49153))]),
        (SMOLLM2, 3, [((0, 3), (0, 1), (0, 512), (0, 16384)), ((3, 6), (1, 2), (512, 1024), (16384, 32768)),
                      ((6, 9), (2, 3), (1024, 1536), (32768, 49152))]),
    ]
    for cfg, tp_size, want in cases:
        inputs = name(cfg, tp_size)
        expect_equal(partitions(impl, cfg, tp_size, inputs), want, inputs=f"{inputs}; each rank's (q_heads, "
                     "kv_heads, intermediate, vocab): whole K/V groups by split_evenly, and split_evenly's ranges")


# --- RowParallelLinear --------------------------------------------------------------------------------------------


def row_parallel_case(rank: int, cls: type, in_features: int, out_features: int, bias: bool, rows: int, world: int,
                      dtype: torch.dtype = torch.float32, columns: list[tuple[int, int]] | None = None):
    """Rank `rank` of a row-parallel split of one whole linear layer (by `columns`, or split_evenly): this rank's
    output, and the whole layer's computed in float64 from the same `dtype` values."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(out_features, in_features, generator=g).to(dtype)
    whole_bias = torch.randn(out_features, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    start, end = (columns or layers.split_evenly(in_features, world))[rank]
    mine = cls(end - start, out_features, bias=bias, dtype=dtype)
    with torch.no_grad():
        mine.weight.copy_(weight[:, start:end])
        if bias:
            mine.bias.copy_(whole_bias)
        whole = F.linear(x.double(), weight.double(), None if whole_bias is None else whole_bias.double())
        return mine(x[:, start:end].clone()), whole


def expect_row_parallel(impl, in_features: int, out_features: int, bias: bool, rows: int, world: int,
                        dtype: torch.dtype = torch.float32, columns: list[tuple[int, int]] | None = None,
                        why: str = "") -> None:
    columns = columns or layers.split_evenly(in_features, world)
    inputs = (f"RowParallelLinear on {world} ranks, {dtype}: a whole Linear({in_features}, {out_features}, "
              f"bias={bias}) split by input columns {columns}, each rank given its columns of x ({rows}, "
              f"{in_features}) and the whole bias{why}")
    results = run_on_ranks(row_parallel_case, world, impl.RowParallelLinear, in_features, out_features, bias, rows,
                           world, dtype, columns)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.25, rtol=0.02)
    for rank, (got, want) in enumerate(results):
        expect_equal(got.dtype, dtype, inputs=f"{inputs}; the dtype of rank {rank}'s output (the layer's own)")
        expect_close(got, want, inputs=f"{inputs}; rank {rank}'s output against the whole layer's (every rank gets "
                     "the full sum)", **tolerance)


@pytest.mark.exercise("RowParallelLinear")
def test_row_parallel_linear_sums_the_ranks_partial_products(impl):
    expect_row_parallel(impl, 12, 5, False, 3, 2)


@pytest.mark.exercise("RowParallelLinear")
def test_row_parallel_linear_adds_its_bias_once(impl):
    expect_row_parallel(impl, 12, 5, True, 4, 2)


@pytest.mark.exercise("RowParallelLinear")
def test_row_parallel_linear_on_three_ranks_and_an_uneven_split(impl):
    expect_row_parallel(impl, 7, 6, True, 2, 3)


@pytest.mark.exercise("RowParallelLinear")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_parallel_linear_on_smollm2s_o_proj_and_down_proj(impl, dtype):
    head_dim = SMOLLM2.head_dim
    expect_row_parallel(impl, 576, 576, False, 3, 2, dtype, [(0, 3 * head_dim), (3 * head_dim, 9 * head_dim)],
                        " — SmolLM2's o_proj over 2 ranks: 3 query heads' columns and 6")
    expect_row_parallel(impl, 1536, 576, True, 2, 2, dtype, why=" — SmolLM2's down_proj, with a bias")


@pytest.mark.exercise("RowParallelLinear")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_parallel_linear_alone_on_the_device_keeps_its_dtype(impl, dtype):
    g = torch.Generator().manual_seed(2)
    layer_weight, bias, x = (torch.randn(*shape, generator=g).to(dtype) for shape in ((6, 10), (6,), (4, 10)))
    inputs = f"RowParallelLinear(10, 6, bias=True) with no process group (one rank), {dtype} on {DEVICE}"
    with exercising("RowParallelLinear", inputs):
        layer = impl.RowParallelLinear(10, 6, bias=True, dtype=dtype, device=DEVICE)
        with torch.no_grad():
            layer.weight.copy_(layer_weight)
            layer.bias.copy_(bias)
            got = layer(x.to(DEVICE))
    expect_equal((got.dtype, got.device.type), (dtype, DEVICE.type), inputs=f"{inputs}; the output's dtype and device")
    tolerance = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    expect_close(got.cpu(), F.linear(x.double(), layer_weight.double(), bias.double()), inputs=inputs, **tolerance)


# --- VocabParallelEmbedding ---------------------------------------------------------------------------------------


def embedding_case(rank: int, cls: type, vocab: int, dim: int, ids: list[int], world: int,
                   dtype: torch.dtype = torch.float32):
    """Rank `rank`'s rows of one whole embedding table: this rank's output for `ids`, and the whole table's."""
    table = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    vocab_range = layers.split_evenly(vocab, world)[rank]
    mine = cls(vocab_range, dim, dtype=dtype)
    with torch.no_grad():
        mine.weight.copy_(table[vocab_range[0]:vocab_range[1]])
        return mine(torch.tensor(ids)), F.embedding(torch.tensor(ids), table)


def expect_embedding(impl, vocab: int, dim: int, ids: list[int], world: int, why: str,
                     dtype: torch.dtype = torch.float32) -> None:
    inputs = (f"VocabParallelEmbedding on {world} ranks, {dtype}: a ({vocab}, {dim}) table split by rows "
              f"{layers.split_evenly(vocab, world)}; token ids {ids} ({why})")
    results = run_on_ranks(embedding_case, world, impl.VocabParallelEmbedding, vocab, dim, ids, world, dtype)
    for rank, (got, want) in enumerate(results):
        expect_equal(got.dtype, dtype, inputs=f"{inputs}; the dtype of rank {rank}'s rows (the table's own)")
        expect_close(got, want, inputs=f"{inputs}; rank {rank}'s output against the whole table's rows", atol=1e-6)


@pytest.mark.exercise("VocabParallelEmbedding")
def test_vocab_parallel_embedding_takes_each_tokens_row_from_the_rank_that_holds_it(impl):
    expect_embedding(impl, 10, 4, [0, 4, 5, 9, 3, 7, 7], 2, "both ends of both ranges, and a repeat")


@pytest.mark.exercise("VocabParallelEmbedding")
def test_vocab_parallel_embedding_when_one_rank_holds_every_token(impl):
    expect_embedding(impl, 10, 4, [6, 8, 9], 2, "all in rank 1's range: rank 0 contributes zeros")
    expect_embedding(impl, 10, 4, [1], 2, "one token, in rank 0's range")


@pytest.mark.exercise("VocabParallelEmbedding")
def test_vocab_parallel_embedding_on_three_ranks_and_an_uneven_split(impl):
    expect_embedding(impl, 11, 3, [0, 2, 3, 6, 7, 10, 5], 3, "every range's ends")


@pytest.mark.exercise("VocabParallelEmbedding")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vocab_parallel_embedding_on_smollm2s_vocabulary(impl, dtype):
    ids = [0, 24575, 24576, 49151, 16383, 16384, 32767, 32768, 1]
    expect_embedding(impl, 49152, 8, ids, 2, "SmolLM2's 49,152 token ids over 2 ranks, each range's ends", dtype)
    expect_embedding(impl, 49152, 8, ids, 3, "SmolLM2's 49,152 token ids over 3 ranks, each range's ends", dtype)


@pytest.mark.exercise("VocabParallelEmbedding")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vocab_parallel_embedding_alone_on_the_device_gives_its_rows_and_zeros(impl, dtype):
    table = torch.randn(20, 6, generator=torch.Generator().manual_seed(4)).to(dtype)
    ids = torch.tensor([0, 7, 8, 12, 13, 19, 9])
    inputs = (f"VocabParallelEmbedding((8, 13), 6) with no process group (one rank holding token ids 8..12 of 20), "
              f"{dtype} on {DEVICE}; token ids {ids.tolist()}")
    with exercising("VocabParallelEmbedding", inputs):
        layer = impl.VocabParallelEmbedding((8, 13), 6, dtype=dtype, device=DEVICE)
        with torch.no_grad():
            layer.weight.copy_(table[8:13])
            got = layer(ids.to(DEVICE))
    want = torch.where(((ids >= 8) & (ids < 13))[:, None], table[ids], torch.zeros((), dtype=dtype))
    expect_equal((got.dtype, got.device.type), (dtype, DEVICE.type), inputs=f"{inputs}; the output's dtype and device")
    expect_close(got.cpu(), want, inputs=f"{inputs}; its rows for ids 8..12, zeros for the rest", atol=0, rtol=0)


# --- the step in lockstep: execute_model_in_lockstep (rank 0) and worker_busy_loop (ranks 1..N-1) -----------------

TINY = "llama-gqa"  # 4 query heads, 2 K/V heads: whole groups over 2 ranks
TINY_PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [40, 41], [100, 3, 77, 8, 9, 10, 11]]
TINY_GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TINY_ENGINE = dict(max_model_len=64, max_num_seqs=4, block_size=8, num_kv_blocks=32)
ENGINE_BOUND_SECONDS = 60.0
OUT_OF_LOCKSTEP = (
    "rank 0 and the workers ran different collectives, so one waited for a peer that never came (compare what "
    "each side does in a step, and in which order)"
)


@functools.cache
def one_rank_tokens() -> list[list[int]]:
    llm = LLM(str(tiny_checkpoint(TINY)), **TINY_ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, TINY_GREEDY, use_tqdm=False)]


@pytest.fixture
def short_collective_timeout(monkeypatch):
    """The group's collectives give up after STEP_TIMEOUT_SECONDS, in rank 0 and in the workers forked from it."""
    monkeypatch.setattr(parallel_state, "COLLECTIVE_TIMEOUT_SECONDS", STEP_TIMEOUT_SECONDS)


def require_written(impl, name: str, *args) -> None:
    """Call the exercise once outside any group: a stub says it is not implemented (inside a forked worker it could
    only die); a written one fails on the missing group or argument, which is expected here."""
    try:
        run_bounded(lambda: getattr(impl, name)(*args), 5, what=f"{name} called outside a process group",
                    likely="it loops without calling a collective (a collective would raise: there is no group)")
    except ExerciseError as error:
        if "not implemented" in str(error):
            raise
    except Exception:  # noqa: BLE001 — the written exercise needs a group: that it got this far is all we ask
        pass


def start_ranks(tp: int = 2) -> LLM:
    """A tensor-parallel LLM on the tiny model whose workers are forked, so they run what `swap_in` put in."""
    return LLM(str(tiny_checkpoint(TINY)), tensor_parallel_size=tp, worker_multiproc_method="fork", **TINY_ENGINE)


def generate_bounded(llm: LLM, what: str) -> list[list[int]]:
    def run() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, TINY_GREEDY, use_tqdm=False)]

    try:
        return run_bounded(run, ENGINE_BOUND_SECONDS, what=what, likely=OUT_OF_LOCKSTEP)
    except AssertionError:  # the bound ran out, or an exercise is not implemented: the message says so
        raise
    except Exception as error:  # noqa: BLE001 — any error the caller got is reported with its cause
        hint = OUT_OF_LOCKSTEP if "Timed out" in str(error) else "a step raised"
        raise AssertionError(f"{what} raised instead of returning tokens ({hint}):\n  {error}") from error


def expect_one_ranks_tokens(impl, name: str, tp: int) -> None:
    inputs = (f"your {name} in an LLM over {tp} ranks on a tiny Llama (4 query heads, 2 K/V), workers forked; "
              f"{len(TINY_PROMPTS)} prompts, greedy, {TINY_GREEDY.max_tokens} tokens")
    want = one_rank_tokens()
    with swap_in(impl, {name: REFERENCE[name]}):
        llm = start_ranks(tp)
        try:
            got = generate_bounded(llm, f"LLM.generate at tensor_parallel_size={tp} with your {name}")
        finally:
            llm.llm_engine.shutdown()
    expect_equal(got, want, inputs=f"{inputs}; the tokens (oracle: the same engine on one rank)")


@pytest.mark.exercise("execute_model_in_lockstep")
@pytest.mark.usefixtures("short_collective_timeout")
def test_execute_model_in_lockstep_gives_one_ranks_tokens(impl):
    require_written(impl, "execute_model_in_lockstep", None, [], None)
    expect_one_ranks_tokens(impl, "execute_model_in_lockstep", 2)


@pytest.mark.exercise("execute_model_in_lockstep")
@pytest.mark.usefixtures("short_collective_timeout")
def test_execute_model_in_lockstep_over_four_ranks_with_replicated_kv_heads(impl):
    require_written(impl, "execute_model_in_lockstep", None, [], None)
    expect_one_ranks_tokens(impl, "execute_model_in_lockstep", 4)


def step_error(llm: LLM, what: str) -> str:
    """The message of the error the caller gets from `generate` (which must raise, within its bound)."""
    try:
        generate_bounded(llm, what)
    except AssertionError as error:
        if error.__cause__ is None:  # the bound ran out: generate_bounded's message says which wait and why
            raise
        return f"{type(error.__cause__).__name__}: {error.__cause__}"
    raise AssertionError(f"on input {what}: generate returned tokens instead of raising")


def expect_dead_worker_named(llm: LLM, what: str) -> None:
    """The next step raises a RuntimeError naming tp-worker-1: the caller hears of it, with no hang."""
    message = step_error(llm, what)
    if "tp-worker-1" not in message:
        raise AssertionError(f"on input {what}: the error does not name the dead worker (tp-worker-1), so the "
                             f"caller cannot tell what broke:\n  {message}")


@pytest.mark.exercise("execute_model_in_lockstep")
@pytest.mark.usefixtures("short_collective_timeout")
def test_execute_model_in_lockstep_reports_a_dead_worker_by_name(impl):
    require_written(impl, "execute_model_in_lockstep", None, [], None)
    with swap_in(impl, {"execute_model_in_lockstep": REFERENCE["execute_model_in_lockstep"]}):
        llm = start_ranks()
        try:
            worker = llm.llm_engine.engine_core.model_executor.workers[0]
            worker.kill()
            expect_dead_worker_named(llm, "LLM.generate at tensor_parallel_size=2 after tp-worker-1 was killed, "
                                          "with your execute_model_in_lockstep")
        finally:
            llm.llm_engine.shutdown()


@pytest.mark.exercise("execute_model_in_lockstep")
@pytest.mark.usefixtures("short_collective_timeout")
def test_execute_model_in_lockstep_names_a_worker_that_dies_inside_a_step(impl, monkeypatch):
    require_written(impl, "execute_model_in_lockstep", None, [], None)
    monkeypatch.setattr(multiproc_executor, "ModelRunner", FailsOnRankOne)  # the forked worker builds this runner
    with swap_in(impl, {"execute_model_in_lockstep": REFERENCE["execute_model_in_lockstep"]}):
        llm = start_ranks()
        try:
            expect_dead_worker_named(llm, "LLM.generate at tensor_parallel_size=2 with your "
                                          "execute_model_in_lockstep, tp-worker-1's third step raising MemoryError")
        finally:
            llm.llm_engine.shutdown()


@pytest.mark.exercise("worker_busy_loop")
@pytest.mark.usefixtures("short_collective_timeout")
def test_worker_busy_loop_gives_one_ranks_tokens(impl):
    require_written(impl, "worker_busy_loop", None, None)
    expect_one_ranks_tokens(impl, "worker_busy_loop", 2)


@pytest.mark.exercise("worker_busy_loop")
@pytest.mark.usefixtures("short_collective_timeout")
def test_worker_busy_loop_stops_cleanly_at_shutdown(impl):
    require_written(impl, "worker_busy_loop", None, None)
    with swap_in(impl, {"worker_busy_loop": REFERENCE["worker_busy_loop"]}):
        llm = start_ranks()
        workers = llm.llm_engine.engine_core.model_executor.workers
        try:
            generate_bounded(llm, "LLM.generate at tensor_parallel_size=2 with your worker_busy_loop")
        finally:
            llm.llm_engine.shutdown()  # sends None, then waits for the workers (a stuck one is killed)
    expect_equal([w.exitcode for w in workers], [0], inputs="your worker_busy_loop, then the engine's shutdown, "
                 "which sends None: each worker's exit code (0: it returned; 1: it raised, as on a read from a pipe "
                 "already closed; -9: killed after 10 s of waiting for a step that never comes)")


class FailsOnRankOne(ModelRunner):
    """A real runner whose third step raises on rank 1 only, as a worker that runs out of memory would."""

    def execute_model(self, scheduler_output):
        self.steps = getattr(self, "steps", 0) + 1  # this runner's own count: each engine builds fresh runners
        if parallel_state.tp_rank() == 1 and self.steps == 3:
            raise MemoryError("rank 1 ran out of memory in its third step (injected by the test)")
        return super().execute_model(scheduler_output)


@pytest.mark.exercise("worker_busy_loop")
@pytest.mark.usefixtures("short_collective_timeout")
def test_worker_busy_loop_ends_on_a_failing_step_so_rank_zero_hears_at_once(impl, monkeypatch):
    require_written(impl, "worker_busy_loop", None, None)
    monkeypatch.setattr(multiproc_executor, "ModelRunner", FailsOnRankOne)  # the forked worker builds this runner
    what = ("LLM.generate at tensor_parallel_size=2 with your worker_busy_loop, tp-worker-1's third step raising "
            "MemoryError")
    with swap_in(impl, {"worker_busy_loop": REFERENCE["worker_busy_loop"]}):
        llm = start_ranks()
        try:
            start = time.monotonic()
            message = step_error(llm, what)
            waited = time.monotonic() - start
        finally:
            llm.llm_engine.shutdown()
    # A worker that swallows the error leaves rank 0 in the step's all-reduce until the group's timeout; the worker
    # then gives up on its pipe when rank 0 goes, and which of the two timeouts speaks first is a race on a busy
    # machine. So "at once" is also checked as it is meant: before the timeout could have fired.
    if "Timed out" in message or "tp-worker-1" not in message or waited >= 0.8 * STEP_TIMEOUT_SECONDS:
        raise AssertionError(
            f"on input {what}: rank 0 should fail at once because the worker ended (its connection closed) and be "
            f"told that tp-worker-1 died; instead, after {waited:.1f} s:\n  {message}\n  Likely cause: the worker "
            "caught its failing step and went back to wait for the next step, leaving rank 0 waiting in the "
            "step's all-reduce "
            f"until the group's {STEP_TIMEOUT_SECONDS:g} s timeout (for ever, with no timeout)")


# --- capstone: your partition, layers and lockstep, SmolLM2 on 2 ranks ----------------------------------------------

CAPSTONE_PROMPT_IDS = [0, 1, 2, 3, 5]
CAPSTONE_TOKENS = 16
CAPSTONE_ENGINE = dict(block_size=16, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                       long_prefill_token_threshold=256)
CAPSTONE_STEP_TIMEOUT_SECONDS = 30.0  # a SmolLM2 step on a busy 2-core machine takes well under this


@pytest.mark.exercise("capstone")
@pytest.mark.timeout(300)  # a real model on 2 ranks: about half a minute on an idle 2-core machine
def test_capstone_your_pieces_on_two_ranks_give_hugging_faces_tokens_on_smollm2(impl, monkeypatch):
    monkeypatch.setattr(parallel_state, "COLLECTIVE_TIMEOUT_SECONDS", CAPSTONE_STEP_TIMEOUT_SECONDS)
    prompts = [CAPSTONE_PROMPTS[i] for i in CAPSTONE_PROMPT_IDS]
    inputs = (f"SmolLM2-135M (9 query heads, 3 K/V) at tensor_parallel_size=2, workers forked so they run your code; "
              f"CAPSTONE_PROMPTS{CAPSTONE_PROMPT_IDS} greedy, {CAPSTONE_TOKENS} tokens, one batch")
    with swap_in(impl, REFERENCE):  # your partition, layers and lockstep, on every rank
        engine = LLMEngine.from_engine_args(EngineArgs(
            model="smollm2-135m", tensor_parallel_size=2, worker_multiproc_method="fork", **CAPSTONE_ENGINE,
        ))
        try:
            runner = engine.engine_core.model_executor.model_runner  # rank 0's
            kv_heads = runner.kv_cache.key_caches[0].shape[2]  # (blocks, block_size, Hkv, D)
            greedy = SamplingParams(temperature=0.0, max_tokens=CAPSTONE_TOKENS, ignore_eos=True)
            outputs = run_bounded(lambda: generate_batch(engine, [(prompt, greedy) for prompt in prompts]), 240,
                                  what="SmolLM2 generating on 2 ranks with your pieces", likely=OUT_OF_LOCKSTEP)
        finally:
            engine.shutdown()  # its workers: one tensor-parallel engine per process
    expect_equal(kv_heads, 1, inputs=f"{inputs}; K/V heads in rank 0's KV cache (its one K/V group)")
    for i, output in zip(CAPSTONE_PROMPT_IDS, outputs, strict=True):
        expect_equal(output.outputs[0].token_ids, smollm2_greedy(i, CAPSTONE_TOKENS),
                     inputs=f"{inputs}; the tokens of CAPSTONE_PROMPTS[{i}] (oracle: Hugging Face greedy, one device)")

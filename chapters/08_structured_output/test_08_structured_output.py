"""Grading tests for chapter 08 — structured output.

Each test grades one exercise (`@pytest.mark.exercise`). The oracles are independent of the code under test: bit
arithmetic on Python integers (for packing a mask and applying it, in float32 and bf16, on the GPU when there is
one), small vocabularies written out by hand with every allowed token listed and every tokenisation of a choice
enumerated (for the choice grammar), a brute-force scan of SmolLM2's vocabulary, each sampling sequence's own
grammar filling a fresh row (for the engine's hand-off of the mask, on a real scheduler's step), and, for the
capstone, `json.loads`, `jsonschema` and the list of choices on SmolLM2's sampled outputs, and Hugging Face's greedy
tokens for a request that shares their batch.

Every thread these tests start is a daemon, and every wait on one is bounded (`grading.waits`): an exercise that
blocks fails within seconds, saying which wait never returned.
"""

import functools
import itertools
import json
import random
import threading
from concurrent.futures import Executor, Future

import jsonschema
import pytest
import torch

import solutions.structured_output as structured_output
from grading import exercising, expect_equal
from grading.capstone import CAPSTONE_PROMPTS, generate_batch, smollm2, smollm2_greedy, swap_in
from grading.devices import DEVICE
from grading.waits import join_or_fail, run_bounded
from solutions import SamplingParams, StructuredOutputsParams
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sched.output import SchedulerOutput, sampling_rows
from solutions.core.sched.scheduler import Scheduler
from solutions.core.sequence import Sequence
from solutions.engine.arg_utils import EngineArgs
from solutions.engine.llm_engine import LLMEngine
from solutions.outputs import FinishReason
from solutions.structured_output import StructuredOutputManager, bitmask, choice
from solutions.structured_output.choice import TokenTexts

REFERENCE = {
    "pack_token_bitmask": bitmask.pack_token_bitmask,
    "apply_token_bitmask": bitmask.apply_token_bitmask,
    "submit_grammar_bitmask": structured_output.submit_grammar_bitmask,
    "ChoiceGrammar": choice.ChoiceGrammar,
}

pytestmark = pytest.mark.timeout(60)

SMOLLM2_VOCAB = 49152


def python_words(token_ids: list[int], num_words: int) -> list[int]:
    """The oracle's mask row, on Python integers: bit j of word w is token 32w + j, read back as a signed int32."""
    words = [0] * num_words
    for token_id in set(token_ids):
        words[token_id // 32] |= 1 << (token_id % 32)
    return [w - 2**32 if w >= 2**31 else w for w in words]


# --- pack_token_bitmask --------------------------------------------------------------------------------------------


def expect_row(impl, token_ids: list[int], num_words: int, inputs: str) -> None:
    got = impl.pack_token_bitmask(token_ids, num_words)
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"on input {inputs}: expected a tensor, got {type(got).__name__}")
    expect_equal((tuple(got.shape), got.dtype), ((num_words,), torch.int32), inputs=f"{inputs}; (shape, dtype)")
    expect_equal(got.tolist(), python_words(token_ids, num_words), inputs=f"{inputs}; the words")


@pytest.mark.exercise("pack_token_bitmask")
def test_pack_token_bitmask_puts_token_32w_plus_j_at_bit_j_of_word_w(impl):
    expect_row(impl, [0, 1, 5], 1, "token_ids=[0, 1, 5], num_words=1 (1 + 2 + 32 = 35)")
    expect_row(impl, [0, 32, 33, 70], 3, "token_ids=[0, 32, 33, 70], num_words=3 (words 1, 1 + 2 = 3, 1 << 6 = 64)")
    expect_row(impl, [], 2, "token_ids=[], num_words=2 (nothing allowed)")


@pytest.mark.exercise("pack_token_bitmask")
def test_pack_token_bitmask_bit_31_is_the_sign_bit(impl):
    expect_row(impl, [31], 1, "token_ids=[31], num_words=1 (bit 31 alone is int32's -2**31)")
    expect_row(impl, list(range(32)), 1, "token_ids=0..31, num_words=1 (all 32 bits: -1)")
    expect_row(impl, [31, 63, 64, 95], 3, "token_ids=[31, 63, 64, 95], num_words=3")


@pytest.mark.exercise("pack_token_bitmask")
def test_pack_token_bitmask_counts_a_repeated_or_unsorted_id_once(impl):
    expect_row(impl, [40, 3, 3, 40, 7, 3], 2,
               "token_ids=[40, 3, 3, 40, 7, 3], num_words=2 (a set of tokens: a repeat adds nothing)")


@pytest.mark.exercise("pack_token_bitmask")
def test_pack_token_bitmask_vocabulary_not_a_multiple_of_32(impl):
    expect_row(impl, [0, 5], 2, "token_ids=[0, 5], num_words=2 (a vocabulary of 37 tokens: the row has 2 words even "
               "when no allowed id reaches the second)")
    expect_row(impl, [36, 32], 2, "token_ids=[36, 32], num_words=2 (the last, partly used word of a 37-token row)")
    expect_row(impl, [2, 49150], 1537, "token_ids=[2, 49150], num_words=1537 (a vocabulary of 49,153 tokens: "
               "31 of the last word's 32 bits stand for no token)")


@pytest.mark.exercise("pack_token_bitmask")
def test_pack_token_bitmask_over_smollm2s_vocabulary(impl):
    ids = random.Random(0).sample(range(SMOLLM2_VOCAB), 3000) + [0, 31, SMOLLM2_VOCAB - 1]
    expect_row(impl, ids, SMOLLM2_VOCAB // 32,
               f"3,003 ids drawn from [0, {SMOLLM2_VOCAB}), num_words=1536 (SmolLM2's row)")


# --- apply_token_bitmask -------------------------------------------------------------------------------------------

# The logits' dtypes a learner meets: float32 (this CPU), bf16 (a GPU, or a CPU model loaded in bf16). The tensors
# are made on `DEVICE`: the GPU when there is one. The mask stays on the host, as the engine's does.
DTYPES = [torch.float32, torch.bfloat16]
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bf16"])


def random_logits(shape: tuple[int, int], seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def mask_of(allowed_rows: list[list[int] | None], num_words: int) -> torch.Tensor:
    """(N, W) int32 from each row's allowed ids (None: every bit set, as an unconstrained row)."""
    rows = [[-1] * num_words if ids is None else python_words(ids, num_words) for ids in allowed_rows]
    return torch.tensor(rows, dtype=torch.int32)


def masked_by_hand(logits: torch.Tensor, allowed_rows: list[list[int] | None]) -> torch.Tensor:
    """The oracle: -inf everywhere, then each row's allowed logits copied back (None: the whole row)."""
    want = torch.full_like(logits, float("-inf"))
    for n, ids in enumerate(allowed_rows):
        keep = list(range(logits.shape[1])) if ids is None else [i for i in ids if i < logits.shape[1]]
        want[n, keep] = logits[n, keep]
    return want


def expect_masked(got, want: torch.Tensor, inputs: str) -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"on input {inputs}: expected a tensor, got {type(got).__name__}")
    expect_equal((tuple(got.shape), got.dtype, got.device.type), (tuple(want.shape), want.dtype, want.device.type),
                 inputs=f"{inputs}; (shape, dtype, device) of the result (the logits' own dtype and device: build "
                 "the -inf fill in logits.dtype, on logits.device)")
    wrong = (got != want).nonzero().tolist()
    if wrong:
        shown = ", ".join(f"[{n}, {v}]: want {want[n, v].item():.4g}, got {got[n, v].item():.4g}" for n, v in wrong[:5])
        raise AssertionError(f"on input {inputs}: {len(wrong)} logits differ from the oracle's, e.g. {shown}")


@pytest.mark.exercise("apply_token_bitmask")
@dtypes
def test_apply_token_bitmask_keeps_allowed_logits_and_sets_the_rest_to_minus_inf(impl, dtype):
    logits = random_logits((3, 96), 0, dtype)
    allowed = [[0, 5, 31, 32, 63, 95], [1, 2, 3], None]
    inputs = (f"{dtype} logits (3, 96) on {DEVICE.type}; row 0 allows [0, 5, 31, 32, 63, 95], row 1 [1, 2, 3], row 2 "
              "everything (all bits set)")
    expect_masked(impl.apply_token_bitmask(logits, mask_of(allowed, 3)), masked_by_hand(logits, allowed), inputs)


@pytest.mark.exercise("apply_token_bitmask")
@dtypes
def test_apply_token_bitmask_returns_a_new_tensor_and_leaves_its_input_alone(impl, dtype):
    logits = random_logits((2, 64), 1, dtype)
    before = logits.clone()
    allowed = [[7, 40], None]
    inputs = f"{dtype} logits (2, 64) on {DEVICE.type}; row 0 allows [7, 40], row 1 everything"
    got = impl.apply_token_bitmask(logits, mask_of(allowed, 2))
    expect_equal(torch.equal(logits, before), True, inputs=f"{inputs}; the input logits are unchanged (the engine "
                 "keeps them: mask a copy, e.g. with masked_fill, not masked_fill_)")
    expect_masked(got, masked_by_hand(before, allowed), inputs)


@pytest.mark.exercise("apply_token_bitmask")
@dtypes
def test_apply_token_bitmask_masks_even_when_the_allowed_logits_are_very_negative(impl, dtype):
    logits = torch.zeros(2, 64, device=DEVICE, dtype=dtype)
    logits[0, [3, 50]] = -1e30  # the only allowed tokens are the model's least likely ones
    logits[1, 9] = -3e38
    allowed = [[3, 50], [9]]
    inputs = (f"{dtype} logits (2, 64) on {DEVICE.type}: every logit 0 except the allowed ones, row 0 [3, 50] at "
              "-1e30, row 1 [9] at -3e38")
    got = impl.apply_token_bitmask(logits, mask_of(allowed, 2))
    expect_masked(got, masked_by_hand(logits, allowed), inputs)
    expect_equal(got.argmax(dim=-1).tolist() if isinstance(got, torch.Tensor) else got, [3, 9],
                 inputs=f"{inputs}; argmax of each row (greedy must still pick an allowed token)")


@pytest.mark.exercise("apply_token_bitmask")
@dtypes
def test_apply_token_bitmask_vocabulary_not_a_multiple_of_32(impl, dtype):
    logits = random_logits((2, 37), 2, dtype)
    allowed = [[0, 33, 36, 37, 40, 63], None]  # 37..63 lie past the vocabulary: their bits are ignored
    inputs = (f"{dtype} logits (2, 37) on {DEVICE.type}, mask (2, 2): row 0's mask sets bits of tokens [0, 33, 36, 37, "
              "40, 63], row 1 all 64")
    expect_masked(impl.apply_token_bitmask(logits, mask_of(allowed, 2)), masked_by_hand(logits, allowed), inputs)
    logits = random_logits((2, 70), 3, dtype)
    allowed = [[1, 63], None]
    inputs = (f"{dtype} logits (2, 70) on {DEVICE.type} but a mask of 2 words (64 tokens, as a tokenizer's mask beside "
              "a model whose vocabulary is padded): tokens 64..69 have no bit and are not allowed; row 0 allows "
              "[1, 63], row 1 all 64")
    want = masked_by_hand(logits, [[1, 63], list(range(64))])
    expect_masked(impl.apply_token_bitmask(logits, mask_of(allowed, 2)), want, inputs)


@pytest.mark.exercise("apply_token_bitmask")
@dtypes
def test_apply_token_bitmask_on_smollm2_sized_logits(impl, dtype):
    rng = random.Random(4)
    logits = random_logits((4, SMOLLM2_VOCAB), 4, dtype)
    allowed = [rng.sample(range(SMOLLM2_VOCAB), 40_000), [2], None, rng.sample(range(SMOLLM2_VOCAB), 7)]
    inputs = (f"{dtype} logits (4, 49152) on {DEVICE.type}: rows allowing 40,000 random ids, the EOS token 2 alone, "
              "everything, 7 random ids")
    expect_masked(impl.apply_token_bitmask(logits, mask_of(allowed, 1536)), masked_by_hand(logits, allowed), inputs)


# On a GPU the logits are CUDA tensors while the mask stays on the host; a test on the CPU alone would never see a
# mask (or a table, or a constant) left there. PyTorch's "meta" device stands in for the GPU everywhere: its tensors
# have shapes, dtypes and a device but no data, and an op that mixes them with CPU tensors (other than 0-dim ones)
# fails as it does on CUDA. The values are checked on the CPU above (and on the GPU itself when there is one).
OTHER_DEVICE = torch.device("meta")


@pytest.mark.exercise("apply_token_bitmask")
@dtypes
def test_apply_token_bitmask_with_the_logits_on_another_device_than_the_mask(impl, dtype):
    logits = torch.empty(3, 70, device=OTHER_DEVICE, dtype=dtype)
    mask = mask_of([[0, 5, 31, 32, 63], [1, 2, 3], None], 2)
    inputs = (f"{dtype} logits (3, 70) on the {OTHER_DEVICE.type} device (a stand-in for a GPU: no data, but its "
              "ops check devices as CUDA's do), the (3, 2) int32 mask on the host, as the engine keeps it")
    try:
        got = impl.apply_token_bitmask(logits, mask)
    except RuntimeError as error:  # NotImplementedError too: a stub's, or the meta device's own
        if isinstance(error, NotImplementedError) and OTHER_DEVICE.type not in str(error):
            raise
        raise AssertionError(
            f"on input {inputs}: your apply_token_bitmask raised {type(error).__name__}: {error}\n  Every tensor "
            "an op combines with the logits must be on logits.device: move the mask there (bitmask.to(logits."
            "device)) and make any table, index or constant there too; and keep the work there (reading the logits "
            "back to the host, with .cpu(), .tolist() or .item(), costs a GPU a copy and a sync per step, and fails "
            "on this device)") from None
    expect_equal((tuple(got.shape), got.dtype, got.device.type) if isinstance(got, torch.Tensor) else got,
                 ((3, 70), dtype, OTHER_DEVICE.type),
                 inputs=f"{inputs}; (shape, dtype, device) of the result (the logits' own: the sampler reads it "
                 "where the logits are)")


# --- submit_grammar_bitmask: the engine's hand-off of the mask ------------------------------------------------------

HANG_SECONDS = 10  # how long a test waits on anything an exercise started before it calls it stuck


class DaemonThreadExecutor(Executor):
    """An executor that runs each call on a daemon thread of its own, and remembers them for a bounded join: the
    engine's manager uses a ThreadPoolExecutor, whose threads are not daemons."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as error:  # handed to whoever waits on the future
                future.set_exception(error)

        thread = threading.Thread(target=run, name="grammar bitmask (test)", daemon=True)
        self.threads.append(thread)
        thread.start()
        return future

    def join(self) -> None:
        for thread in self.threads:
            join_or_fail(thread, HANG_SECONDS, what="the fill you submitted to the executor",
                         likely="a grammar's fill_bitmask that never returns")


@functools.cache
def smollm2_manager() -> StructuredOutputManager:
    _, tokenizer = smollm2()
    return StructuredOutputManager(tokenizer, SMOLLM2_VOCAB, tokenizer.eos_token_id)


def first_step(requests: list[tuple[int, SamplingParams]]) -> SchedulerOutput:
    """A real scheduler's first step over requests (prompt length, params), each set up as `EngineCore.add_request`
    does: a sequence with its params, generator and grammar, and the ids of the samples to fork for n > 1."""
    manager, seq_ids = smollm2_manager(), itertools.count()
    scheduler = Scheduler(KVCacheManager(64, 16), max_num_seqs=16, max_num_batched_tokens=256,
                          long_prefill_token_threshold=32, max_model_len=512, eos_token_id=manager.eos_token_id,
                          structured_output_manager=manager)
    for i, (prompt_len, params) in enumerate(requests):
        seq = Sequence(next(seq_ids), [100 + (i * 7 + k) % 50 for k in range(prompt_len)])
        seq.request_id, seq.sampling_params, seq.generator = str(i), params, torch.Generator().manual_seed(i)
        if params.structured_outputs is not None:
            (seq.grammar,) = manager.grammar_init(params.structured_outputs, 1)
        seq.fork_seq_ids = [next(seq_ids) for _ in range(params.n - 1)]
        scheduler.add_request(seq)
    return scheduler.schedule()


def choice_params(choices: list[str], n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices))


# One step: request 0 a choice with n=3 (its prompt completes: two samples fork from it and share its logits row,
# each with a grammar of its own), request 1 a JSON request whose 100-token prompt is cut into chunks (its first
# chunk samples nothing), request 2 unconstrained, request 3 another choice.
MIXED_STEP = [(5, choice_params(["Paris", "London"], n=3)),
              (100, SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json={"type": "object"}))),
              (6, SamplingParams(max_tokens=8)),
              (4, choice_params(["yes", "no"]))]
MIXED_INPUTS = ("one scheduler step (SmolLM2's vocabulary): a choice request with n=3 whose prompt completes "
                "(2 samples forked, sharing its logits row, one already advanced past 'Lon'), a JSON request whose "
                "first prompt chunk (32 of 100 tokens) samples nothing, an unconstrained request, a choice request "
                "['yes', 'no']")


def expected_rows(scheduler_output: SchedulerOutput, num_words: int = SMOLLM2_VOCAB // 32) -> list[list[int]]:
    """The oracle: one row per sampling sequence, in `sampling_rows`' order, filled by that sequence's own grammar
    on a fresh all-ones row of `num_words` words (all ones without a grammar)."""
    rows = []
    for seq in sampling_rows(scheduler_output)[1]:
        row = torch.full((1, num_words), -1, dtype=torch.int32)
        if seq.grammar is not None:
            seq.grammar.fill_bitmask(row, 0)
        rows.append(row[0].tolist())
    return rows


def describe_rows(scheduler_output: SchedulerOutput) -> str:
    seqs = sampling_rows(scheduler_output)[1]
    return ", ".join(f"row {i}: request {s.request_id} sample {s.seq_id}" + ("" if s.grammar else " (no grammar)")
                     for i, s in enumerate(seqs))


def submitted_mask(impl, scheduler_output: SchedulerOutput, inputs: str,
                   vocab_size: int = SMOLLM2_VOCAB) -> torch.Tensor | None:
    """Call the exercise, wait (bounded) for its future, check that its fill ran on the executor's thread."""
    executor = DaemonThreadExecutor()
    future = run_bounded(lambda: impl.submit_grammar_bitmask(scheduler_output, executor, vocab_size), HANG_SECONDS,
                         what="submit_grammar_bitmask", likely="a grammar's fill that never returns")
    if future is None:
        return None
    if not isinstance(future, Future):
        raise AssertionError(f"on input {inputs}: expected a concurrent.futures.Future (executor.submit's), got "
                             f"{type(future).__name__}")
    mask = run_bounded(future.result, HANG_SECONDS, what="the future submit_grammar_bitmask returned",
                       likely="a future nobody completes: return what executor.submit returns")
    executor.join()
    return mask


@pytest.mark.exercise("submit_grammar_bitmask")
def test_submit_grammar_bitmask_gives_each_sampling_row_its_own_grammars_mask(impl):
    scheduler_output = first_step(MIXED_STEP)
    forks = scheduler_output.forked_seqs[scheduler_output.scheduled_seqs[0].seq_id]
    assert len(forks) == 2 and len(scheduler_output.scheduled_seqs) == 4, scheduler_output  # the step we meant
    assert forks[0].grammar.accept_tokens(smollm2()[1].encode("Lon"))  # this sample's grammar has moved on
    inputs = f"{MIXED_INPUTS}; the sampling rows: {describe_rows(scheduler_output)}"
    want = expected_rows(scheduler_output)
    mask = submitted_mask(impl, scheduler_output, inputs)
    if not isinstance(mask, torch.Tensor):
        raise AssertionError(f"on input {inputs}: the future's result should be the (N, W) int32 mask, got "
                             f"{type(mask).__name__}")
    expect_equal((tuple(mask.shape), mask.dtype), ((len(want), SMOLLM2_VOCAB // 32), torch.int32),
                 inputs=f"{inputs}; (shape, dtype) of the mask: one row per sampling sequence (not per scheduled "
                 "sequence: a prompt chunk that is not the last samples nothing, and each forked sample has its own "
                 "row)")
    for row, (got, expected) in enumerate(zip(mask.tolist(), want, strict=True)):
        expect_equal(got == expected, True, inputs=f"{inputs}; row {row} equals what its sequence's own grammar fills "
                     "(all ones without a grammar)")


@pytest.mark.exercise("submit_grammar_bitmask")
def test_submit_grammar_bitmask_is_none_when_no_sampling_row_has_a_grammar(impl):
    for requests, why in (([(5, SamplingParams(max_tokens=8)), (6, SamplingParams(max_tokens=8))],
                           "two unconstrained requests"),
                          ([MIXED_STEP[1], (6, SamplingParams(max_tokens=8))],
                           "an unconstrained request, and a JSON request whose first prompt chunk samples nothing")):
        scheduler_output = first_step(requests)
        inputs = f"one scheduler step: {why}"
        executor = DaemonThreadExecutor()
        got = run_bounded(lambda: impl.submit_grammar_bitmask(scheduler_output, executor, SMOLLM2_VOCAB),
                          HANG_SECONDS, what="submit_grammar_bitmask", likely="a fill that never returns")
        executor.join()
        expect_equal(got, None, inputs=f"{inputs}; the result (None: no row needs a mask, so the runner skips it)")


class GatedGrammar:
    """A sequence's own grammar whose `fill_bitmask` waits for the test to open a gate: the fill is still running
    when `submit_grammar_bitmask` must already have returned (as the forward pass runs meanwhile)."""

    def __init__(self, grammar, gate: threading.Event) -> None:
        self.grammar, self.gate = grammar, gate

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.gate.wait(HANG_SECONDS)
        self.grammar.fill_bitmask(bitmask, row)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return self.grammar.accept_tokens(token_ids)

    def is_terminated(self) -> bool:
        return self.grammar.is_terminated()


@pytest.mark.exercise("submit_grammar_bitmask")
def test_submit_grammar_bitmask_returns_while_the_fill_runs_and_its_future_waits_for_it(impl):
    scheduler_output = first_step([(5, choice_params(["Paris", "London"])), (6, SamplingParams(max_tokens=8))])
    want = expected_rows(scheduler_output)
    seq = scheduler_output.scheduled_seqs[0]
    gate = threading.Event()
    seq.grammar = GatedGrammar(seq.grammar, gate)
    inputs = ("one scheduler step: a choice request ['Paris', 'London'] and an unconstrained one; the choice's "
              "fill_bitmask is held until the test lets it go, as a fill still running while the forward pass does")
    executor = DaemonThreadExecutor()
    try:
        future = run_bounded(
            lambda: impl.submit_grammar_bitmask(scheduler_output, executor, SMOLLM2_VOCAB), 5,
            what="submit_grammar_bitmask, while a grammar's fill_bitmask was still running",
            likely="the rows are filled on the caller's thread before returning, so the forward pass would wait for "
            "the fill: put the filling loop in a function and hand it to executor.submit")
        expect_equal(isinstance(future, Future) and future.done(), False, inputs=f"{inputs}; the returned future is "
                     "done while a row is still being filled (return executor.submit's future of the fill, not a "
                     "finished future of a tensor the fill is still writing: the sampler would read a half-filled "
                     "mask)")
    finally:
        gate.set()
    mask = run_bounded(future.result, HANG_SECONDS, what="the future of the fill", likely="a fill that never returns")
    executor.join()
    expect_equal(mask.tolist() == want, True, inputs=f"{inputs}; the mask, once the fill has finished (the choice's "
                 "row from its grammar, the unconstrained row all ones)")


@pytest.mark.exercise("submit_grammar_bitmask")
def test_submit_grammar_bitmask_masks_a_grammar_that_is_not_in_the_first_row(impl):
    scheduler_output = first_step([(6, SamplingParams(max_tokens=8)), (4, choice_params(["yes", "no"]))])
    inputs = (f"one scheduler step: an unconstrained request, then a choice request ['yes', 'no']; the sampling rows: "
              f"{describe_rows(scheduler_output)}")
    mask = submitted_mask(impl, scheduler_output, inputs)
    if not isinstance(mask, torch.Tensor):
        raise AssertionError(f"on input {inputs}: the future's result should be the (2, 1536) int32 mask, got "
                             f"{type(mask).__name__} (None only when no sampling row has a grammar: look at every "
                             "row, not the first)")
    expect_equal(mask.tolist() == expected_rows(scheduler_output), True,
                 inputs=f"{inputs}; the mask equals the oracle's (row 0 all ones, row 1 the choice's)")


@pytest.mark.exercise("submit_grammar_bitmask")
def test_submit_grammar_bitmask_vocabulary_not_a_multiple_of_32(impl):
    vocab = SMOLLM2_VOCAB + 17  # a model whose vocabulary is padded past the tokenizer's, or GPT-2's 50,257
    scheduler_output = first_step(MIXED_STEP)
    inputs = f"{MIXED_INPUTS}; vocab_size={vocab} (not a multiple of 32: its last word is partly used)"
    want = expected_rows(scheduler_output, (vocab + 31) // 32)
    mask = submitted_mask(impl, scheduler_output, inputs, vocab)
    if not isinstance(mask, torch.Tensor):
        raise AssertionError(f"on input {inputs}: the future's result should be the (N, W) int32 mask, got "
                             f"{type(mask).__name__}")
    expect_equal(tuple(mask.shape), (len(want), (vocab + 31) // 32),
                 inputs=f"{inputs}; the mask's shape (ceil({vocab} / 32) words a row: with {vocab} // 32 the last "
                 f"{vocab % 32} tokens would have no bit, forbidden in every row)")
    expect_equal(mask.tolist() == want, True, inputs=f"{inputs}; the mask equals the oracle's (each row from its "
                 "sequence's own grammar, all ones without one)")


# --- ChoiceGrammar -------------------------------------------------------------------------------------------------

# A vocabulary of 70 tokens written out by hand, as bytes (TokenTexts holds each token's UTF-8 bytes). Special
# tokens spell b"" (0 is padding, 1 is EOS); every id not listed is a token that spells none of the choices. "is"
# has two ids (as in a tokenizer where both "is" and "▁is" decode alone to "is"). Ids 31, 63 and 64 sit on word
# boundaries of the mask. 16 and 17 each hold half of "é" (UTF-8 c3 a9), as byte-level BPE tokens can.
EOS = 1
PLACED = {2: "P", 3: "Pa", 4: "Par", 5: "Paris", 6: "is", 7: "ris", 8: "i", 9: "s", 10: "r", 11: "a", 12: " Paris",
          13: "Paris!", 14: "x", 15: "Caf", 16: b"\xc3", 17: b"\xa9", 18: "é", 19: "e", 20: "Ly", 21: "yon", 22: "y",
          31: "L", 32: "Lon", 33: "don", 34: "on", 35: "o", 36: "n", 37: "d", 63: "London", 64: "Lo", 67: "is"}
TEXTS = [b"", b""] + [t if isinstance(t := PLACED.get(i, f"~{i}"), bytes) else t.encode() for i in range(2, 70)]
CITIES = ["Paris", "London"]
PREFIXED = ["Par", "Paris"]  # a choice that a longer choice extends
SHARED_START = ["Lon", "London", "Lyon"]  # one first token "L" for all three; "Lon" is the start of "London"
ACCENTED = ["Café", "Cafe"]  # "é" spelled by one token, or by two that each hold half of it


def hand_tokens() -> TokenTexts:
    ids_by_text: dict[bytes, list[int]] = {}
    for token_id, text in enumerate(TEXTS):
        if text:
            ids_by_text.setdefault(text, []).append(token_id)
    return TokenTexts(list(TEXTS), ids_by_text, EOS)


def tokenisations(text: bytes, texts: list[bytes]) -> list[list[int]]:
    """Every sequence of (non-empty) token ids whose bytes concatenate to `text`: the brute-force oracle."""
    if not text:
        return [[]]
    return [[i, *rest] for i, t in enumerate(texts) if t and text.startswith(t)
            for rest in tokenisations(text[len(t):], texts)]


def new_grammar(impl, choices: list[str], tokens: TokenTexts, inputs: str):
    with exercising("ChoiceGrammar", inputs):
        return impl.ChoiceGrammar(choices, tokens)


def allowed(grammar, inputs: str) -> list[int]:
    with exercising("ChoiceGrammar", inputs):
        return sorted(grammar.allowed_token_ids())


def accept(grammar, token_ids: list[int], inputs: str) -> bool:
    with exercising("ChoiceGrammar", inputs):
        return grammar.accept_tokens(token_ids)


def terminated(grammar, inputs: str) -> bool:
    with exercising("ChoiceGrammar", inputs):
        return grammar.is_terminated()


def spelled(ids: list[int]) -> str:
    return " + ".join(repr(TEXTS[i].decode(errors="backslashreplace")) for i in ids) or "nothing"


@pytest.mark.exercise("ChoiceGrammar")
def test_choice_grammar_allows_every_token_that_keeps_the_text_a_prefix_of_a_choice(impl):
    inputs = f"ChoiceGrammar({CITIES}) over a hand-made vocabulary of 70 tokens {PLACED}, EOS {EOS}"
    grammar = new_grammar(impl, CITIES, hand_tokens(), inputs)
    expect_equal(allowed(grammar, inputs), [2, 3, 4, 5, 31, 32, 63, 64], inputs=f"{inputs}; allowed_token_ids() at the "
                 "start: every token spelling the start of a choice ('P', 'Pa', 'Par', 'Paris', 'L', 'Lon', 'London', "
                 "'Lo'), not only each choice's first token, and no EOS or empty special token")
    expect_equal(accept(grammar, [4], inputs), True, inputs=f"{inputs}; accept_tokens([4]) ('Par')")
    expect_equal(allowed(grammar, inputs), [6, 8, 67], inputs=f"{inputs}; after 'Par': 'is' (both of its ids) and 'i'")
    expect_equal(accept(grammar, [8], inputs), True, inputs=f"{inputs}; after 'Par', accept_tokens([8]) ('i')")
    expect_equal(allowed(grammar, inputs), [9], inputs=f"{inputs}; after 'Par' + 'i': 's'")


@pytest.mark.exercise("ChoiceGrammar")
def test_choice_grammar_accepts_every_tokenisation_of_a_choice(impl):
    tokens = hand_tokens()
    for choice_text in CITIES:
        paths = tokenisations(choice_text.encode(), TEXTS)
        assert len(paths) > 5, paths  # the hand-made vocabulary spells each choice many ways
        for path in paths:
            inputs = f"ChoiceGrammar({CITIES}), the hand-made vocabulary; tokens {path} ({spelled(path)})"
            grammar = new_grammar(impl, CITIES, tokens, inputs)
            for k, token_id in enumerate(path):
                expect_equal(token_id in allowed(grammar, inputs), True, inputs=f"{inputs}; token {token_id} "
                             f"({spelled([token_id])}) in allowed_token_ids() after {spelled(path[:k])}")
                expect_equal(accept(grammar, [token_id], inputs), True,
                             inputs=f"{inputs}; accept_tokens([{token_id}]) after {spelled(path[:k])}")
            expect_equal(terminated(grammar, inputs), True, inputs=f"{inputs}; is_terminated() once the text is "
                         f"{choice_text!r} (no choice extends it)")
    inputs = f"ChoiceGrammar({CITIES}); accept_tokens([4, 6]) in one call ('Par' + 'is')"
    grammar = new_grammar(impl, CITIES, tokens, inputs)
    expect_equal((accept(grammar, [4, 6], inputs), terminated(grammar, inputs)), (True, True), inputs=f"{inputs}; "
                 "(accepted, is_terminated())")


@pytest.mark.exercise("ChoiceGrammar")
def test_choice_grammar_allows_eos_only_after_a_whole_choice(impl):
    tokens = hand_tokens()
    inputs = f"ChoiceGrammar({CITIES}), the hand-made vocabulary (EOS is {EOS}); accept_tokens([3]) ('Pa')"
    grammar = new_grammar(impl, CITIES, tokens, inputs)
    accept(grammar, [3], inputs)
    expect_equal(EOS in allowed(grammar, inputs), False, inputs=f"{inputs}; EOS in allowed_token_ids() after 'Pa'")
    expect_equal(accept(grammar, [EOS], inputs), False,
                 inputs=f"{inputs}; accept_tokens([EOS]) after 'Pa' ('Pa' is no choice)")
    inputs = f"ChoiceGrammar({CITIES}); accept_tokens([5]) ('Paris')"
    grammar = new_grammar(impl, CITIES, tokens, inputs)
    accept(grammar, [5], inputs)
    expect_equal(allowed(grammar, inputs), [EOS], inputs=f"{inputs}; allowed_token_ids() after 'Paris': only EOS")
    expect_equal(accept(grammar, [EOS], inputs), True, inputs=f"{inputs}; accept_tokens([EOS]) after 'Paris'")
    expect_equal((terminated(grammar, inputs), allowed(grammar, inputs)), (True, []),
                 inputs=f"{inputs}; (is_terminated(), allowed_token_ids()) once EOS is taken")


def tokens_with_eos(eos_token_id: int | None) -> TokenTexts:
    """The hand-made vocabulary with another EOS: None (a vocabulary without one), or 0 (the padding token's id)."""
    tokens = hand_tokens()
    return TokenTexts(tokens.texts, tokens.ids_by_text, eos_token_id)


@pytest.mark.exercise("ChoiceGrammar")
def test_choice_grammar_in_a_vocabulary_without_an_eos_token(impl):
    tokens = tokens_with_eos(None)
    inputs = f"ChoiceGrammar({CITIES}), the hand-made vocabulary without an EOS token (eos_token_id=None)"
    grammar = new_grammar(impl, CITIES, tokens, inputs)
    expect_equal(allowed(grammar, inputs), [2, 3, 4, 5, 31, 32, 63, 64], inputs=f"{inputs}; allowed_token_ids() at "
                 "the start")
    expect_equal(accept(grammar, [5], inputs), True, inputs=f"{inputs}; accept_tokens([5]) ('Paris')")
    expect_equal((allowed(grammar, inputs), terminated(grammar, inputs)), ([], True),
                 inputs=f"{inputs}; (allowed_token_ids(), is_terminated()) after 'Paris': no EOS to allow (None is "
                 "no token id), and no choice extends it")
    mask = torch.full((1, 3), -1, dtype=torch.int32)
    with exercising("ChoiceGrammar", inputs):
        grammar.fill_bitmask(mask, 0)
    expect_equal(mask.tolist(), [[0, 0, 0]], inputs=f"{inputs}; fill_bitmask(mask, 0) after 'Paris'")
    grammar = new_grammar(impl, CITIES, tokens, inputs)
    expect_equal(accept(grammar, [5, 1], inputs), False,
                 inputs=f"{inputs}; accept_tokens([5, 1]): token 1 is no EOS here, only a special token spelling "
                 "nothing")
    inputs = f"ChoiceGrammar({PREFIXED}), the hand-made vocabulary without an EOS token; accept_tokens([4]) ('Par')"
    grammar = new_grammar(impl, PREFIXED, tokens, inputs)
    accept(grammar, [4], inputs)
    expect_equal((allowed(grammar, inputs), terminated(grammar, inputs)), ([6, 8, 67], False),
                 inputs=f"{inputs}; (allowed_token_ids(), is_terminated()) after 'Par': without EOS nothing can end "
                 "the output at 'Par', so it goes on towards 'Paris' (ending here would make 'Paris' unreachable)")
    expect_equal((accept(grammar, [6], inputs), allowed(grammar, inputs), terminated(grammar, inputs)),
                 (True, [], True), inputs=f"{inputs}; (accept_tokens([6]) ('is'), allowed_token_ids(), "
                 "is_terminated()) after 'Par'")


@pytest.mark.exercise("ChoiceGrammar")
def test_choice_grammar_whose_eos_token_id_is_0(impl):
    tokens = tokens_with_eos(0)
    inputs = (f"ChoiceGrammar({CITIES}), the hand-made vocabulary whose EOS is token 0 (as SmolLM2 base's "
              "<|endoftext|>); token 1 is an ordinary special token spelling nothing")
    grammar = new_grammar(impl, CITIES, tokens, inputs)
    expect_equal(accept(grammar, [3, 0], inputs), False, inputs=f"{inputs}; accept_tokens([3, 0]): EOS after 'Pa'")
    grammar = new_grammar(impl, CITIES, tokens, inputs)
    accept(grammar, [5], inputs)
    expect_equal(allowed(grammar, inputs), [0], inputs=f"{inputs}; allowed_token_ids() after 'Paris': only EOS, "
                 "token 0 (an id of 0 is a token: test `is not None`, not truth)")
    expect_equal((accept(grammar, [0], inputs), terminated(grammar, inputs)), (True, True),
                 inputs=f"{inputs}; (accept_tokens([0]), is_terminated()) after 'Paris'")
    grammar = new_grammar(impl, CITIES, tokens, inputs)
    expect_equal(accept(grammar, [5, 1], inputs), False, inputs=f"{inputs}; accept_tokens([5, 1]): token 1 is no EOS "
                 "here")


@pytest.mark.exercise("ChoiceGrammar")
def test_choice_grammar_does_not_stop_at_a_choice_that_a_longer_one_extends(impl):
    tokens = hand_tokens()
    inputs = f"ChoiceGrammar({PREFIXED}), the hand-made vocabulary; accept_tokens([4]) ('Par')"
    grammar = new_grammar(impl, PREFIXED, tokens, inputs)
    accept(grammar, [4], inputs)
    expect_equal(terminated(grammar, inputs), False,
                 inputs=f"{inputs}; is_terminated() after 'Par' ('Paris' may follow)")
    expect_equal(allowed(grammar, inputs), [EOS, 6, 8, 67], inputs=f"{inputs}; allowed_token_ids() after 'Par': EOS "
                 "(stop at 'Par') or a token towards 'Paris'")
    expect_equal((accept(grammar, [EOS], inputs), terminated(grammar, inputs)), (True, True),
                 inputs=f"{inputs}; (accept_tokens([EOS]), is_terminated()) after 'Par'")
    inputs = f"ChoiceGrammar({PREFIXED}); accept_tokens([4, 6]) ('Par' + 'is')"
    grammar = new_grammar(impl, PREFIXED, tokens, inputs)
    expect_equal((accept(grammar, [4, 6], inputs), terminated(grammar, inputs)), (True, True),
                 inputs=f"{inputs}; (accepted, is_terminated()): no choice extends 'Paris'")


@pytest.mark.exercise("ChoiceGrammar")
def test_choice_grammar_choices_that_share_a_first_token_and_a_prefix(impl):
    tokens = hand_tokens()
    inputs = f"ChoiceGrammar({SHARED_START}), the hand-made vocabulary"
    grammar = new_grammar(impl, SHARED_START, tokens, inputs)
    expect_equal(allowed(grammar, inputs), [20, 31, 32, 63, 64], inputs=f"{inputs}; allowed_token_ids() at the start "
                 "('Ly', 'L', 'Lon', 'London', 'Lo': the starts of all three choices, not only of the first that fits)")
    accept(grammar, [31], inputs)
    expect_equal(allowed(grammar, inputs), [21, 22, 34, 35], inputs=f"{inputs}; allowed_token_ids() after 'L' "
                 "('yon', 'y' towards 'Lyon'; 'on', 'o' towards 'Lon' and 'London')")
    accept(grammar, [34], inputs)
    expect_equal((allowed(grammar, inputs), terminated(grammar, inputs)), ([EOS, 33, 37], False),
                 inputs=f"{inputs}; (allowed_token_ids(), is_terminated()) after 'L' + 'on': EOS ends at 'Lon', 'don' "
                 "or 'd' go on towards 'London'")
    expect_equal((accept(grammar, [33], inputs), terminated(grammar, inputs)), (True, True),
                 inputs=f"{inputs}; (accept_tokens([33]) ('don'), is_terminated()) after 'Lon'")
    for path in tokenisations(b"Lyon", TEXTS):
        inputs = f"ChoiceGrammar({SHARED_START}), the hand-made vocabulary; tokens {path} ({spelled(path)})"
        grammar = new_grammar(impl, SHARED_START, tokens, inputs)
        expect_equal((accept(grammar, path, inputs), terminated(grammar, inputs)), (True, True),
                     inputs=f"{inputs}; (accepted, is_terminated())")


@pytest.mark.exercise("ChoiceGrammar")
def test_choice_grammar_reaches_a_choice_through_tokens_that_hold_part_of_a_character(impl):
    tokens = hand_tokens()
    inputs = (f"ChoiceGrammar({ACCENTED}), the hand-made vocabulary, where 'é' is token 18 (bytes c3 a9) and also "
              "tokens 16 (c3) + 17 (a9), each half of the character")
    grammar = new_grammar(impl, ACCENTED, tokens, inputs)
    accept(grammar, [15], inputs)
    expect_equal(allowed(grammar, inputs), [16, 18, 19], inputs=f"{inputs}; allowed_token_ids() after 'Caf': the "
                 "half-character token c3 too (compare bytes, not decoded text: c3 alone decodes to no character)")
    expect_equal(accept(grammar, [16], inputs), True, inputs=f"{inputs}; accept_tokens([16]) (c3) after 'Caf'")
    expect_equal(allowed(grammar, inputs), [17], inputs=f"{inputs}; allowed_token_ids() after 'Caf' + c3: a9 only")
    expect_equal((accept(grammar, [17], inputs), terminated(grammar, inputs)), (True, True),
                 inputs=f"{inputs}; (accept_tokens([17]), is_terminated()) after 'Caf' + c3: the text is 'Café'")
    for path in tokenisations("Café".encode(), TEXTS):
        inputs = f"ChoiceGrammar({ACCENTED}), the hand-made vocabulary; tokens {path} ({spelled(path)})"
        grammar = new_grammar(impl, ACCENTED, tokens, inputs)
        expect_equal((accept(grammar, path, inputs), terminated(grammar, inputs)), (True, True),
                     inputs=f"{inputs}; (accepted, is_terminated())")


@pytest.mark.exercise("ChoiceGrammar")
def test_choice_grammar_rejects_tokens_its_mask_forbids(impl):
    tokens = hand_tokens()
    for path, why in (([14], "'x' starts no choice"), ([12], "' Paris' has a space no choice has"),
                      ([13], "'Paris!' runs past every choice"), ([5, 14], "'x' after 'Paris'"),
                      ([0], "the special token 0 spells nothing"), ([4, 7], "'Par' + 'ris' is 'Parris'"),
                      ([5, EOS, 6], "a token after EOS")):
        inputs = f"ChoiceGrammar({CITIES}), the hand-made vocabulary; accept_tokens({path}): {why}"
        grammar = new_grammar(impl, CITIES, tokens, inputs)
        expect_equal(accept(grammar, path, inputs), False, inputs=f"{inputs}; accepted")


@pytest.mark.exercise("ChoiceGrammar")
def test_choice_grammar_fills_only_its_row_of_the_mask(impl):
    inputs = (f"ChoiceGrammar({CITIES}), the hand-made vocabulary (70 tokens); fill_bitmask(mask, 1) into a (3, 3) "
              "mask whose every bit is set (as the engine allocates it: unconstrained rows stay so)")
    grammar = new_grammar(impl, CITIES, hand_tokens(), inputs)
    mask = torch.full((3, 3), -1, dtype=torch.int32)
    with exercising("ChoiceGrammar", inputs):
        grammar.fill_bitmask(mask, 1)
    want = [[-1, -1, -1], python_words([2, 3, 4, 5, 31, 32, 63, 64], 3), [-1, -1, -1]]
    expect_equal(mask.tolist(), want,
                 inputs=f"{inputs}; the mask after the call (row 1: exactly the allowed tokens' bits)")


@functools.cache
def smollm2_tokens() -> TokenTexts:
    _, tokenizer = smollm2()
    return TokenTexts.from_tokenizer(tokenizer, SMOLLM2_VOCAB, tokenizer.eos_token_id)


@pytest.mark.exercise("ChoiceGrammar")
def test_choice_grammar_on_smollm2s_vocabulary(impl):
    _, tokenizer = smollm2()
    tokens, choices = smollm2_tokens(), [" Paris", "Paris, Texas", "New York"]
    inputs = f"ChoiceGrammar({choices}) over SmolLM2's 49,152 tokens (TokenTexts.from_tokenizer)"
    brute_force = [i for i, t in enumerate(tokens.texts)
                   if t in tokens.ids_by_text and any(c.encode().startswith(t) for c in choices)]
    grammar = new_grammar(impl, choices, tokens, inputs)
    expect_equal(allowed(grammar, inputs), brute_force, inputs=f"{inputs}; allowed_token_ids() at the start (oracle: "
                 "every token whose text starts a choice)")
    canonical = tokenizer.encode("New York")
    expect_equal((accept(grammar, canonical, inputs), terminated(grammar, inputs)), (True, True),
                 inputs=f"{inputs}; (accept_tokens({canonical}), is_terminated()): the tokenizer's own 'New York'")
    by_character = [tokens.ids_by_text[c.encode()][0] for c in "Paris, Texas"]
    grammar = new_grammar(impl, choices, tokens, inputs)
    expect_equal(accept(grammar, by_character[:5], inputs), True, inputs=f"{inputs}; 'Paris' one character at a time")
    expect_equal((terminated(grammar, inputs), tokenizer.eos_token_id in allowed(grammar, inputs)), (False, False),
                 inputs=f"{inputs}; (is_terminated(), EOS allowed) after 'Paris': no choice is 'Paris'")
    expect_equal((accept(grammar, by_character[5:], inputs), terminated(grammar, inputs)), (True, True),
                 inputs=f"{inputs}; (accept_tokens, is_terminated()) for the rest of 'Paris, Texas', one character "
                 "at a time")


@pytest.mark.exercise("ChoiceGrammar")
def test_choice_grammar_cjk_and_emoji_choices_in_smollm2s_own_tokens(impl):
    _, tokenizer = smollm2()
    tokens, choices = smollm2_tokens(), ["東京", "🙂 yes", "Paris"]
    for choice_text in choices[:2]:
        ids = tokenizer.encode(choice_text)
        inputs = (f"ChoiceGrammar({choices}) over SmolLM2's 49,152 tokens; accept_tokens({ids}), the tokenizer's own "
                  f"{choice_text!r}, whose tokens each hold part of a character")
        grammar = new_grammar(impl, choices, tokens, inputs)
        expect_equal(ids[0] in allowed(grammar, inputs), True, inputs=f"{inputs}; token {ids[0]} allowed at the start")
        expect_equal((accept(grammar, ids, inputs), terminated(grammar, inputs)), (True, True),
                     inputs=f"{inputs}; (accepted, is_terminated())")


class CountingTexts(list):
    """A token-text table that counts the entries read from it (the instrument of the test below)."""

    def __init__(self, items) -> None:
        super().__init__(items)
        self.reads = 0

    def __getitem__(self, index):
        got = super().__getitem__(index)
        self.reads += len(got) if isinstance(index, slice) else 1
        return got

    def __iter__(self):
        for item in super().__iter__():
            self.reads += 1
            yield item


class CountingIndex(dict):
    """`ids_by_text` that counts the entries read from it, by lookup or by walking it."""

    def __init__(self, items) -> None:
        super().__init__(items)
        self.reads = 0

    def __getitem__(self, key):
        self.reads += 1
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.reads += 1
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self.reads += 1
        return super().__contains__(key)

    def __iter__(self):
        for key in super().__iter__():
            self.reads += 1
            yield key

    def keys(self):
        return list(self)

    def values(self):
        return [super(CountingIndex, self).__getitem__(key) for key in self]

    def items(self):
        return [(key, super(CountingIndex, self).__getitem__(key)) for key in self]


MAX_READS_PER_CALL = 2_000  # lookups a step may make in the 49,152-token tables: the choices' prefixes, not all


@pytest.mark.exercise("ChoiceGrammar")
def test_choice_grammar_reads_only_the_tokens_that_could_come_next(impl):
    _, tokenizer = smollm2()
    smollm2_table, choices = smollm2_tokens(), [" Paris", "Paris, Texas", "New York"]
    texts, index = CountingTexts(smollm2_table.texts), CountingIndex(smollm2_table.ids_by_text)
    tokens = TokenTexts(texts, index, smollm2_table.eos_token_id)
    inputs = (f"ChoiceGrammar({choices}) over SmolLM2's 49,152 tokens, its TokenTexts tables counting the entries "
              "read from them; 'Paris, Texas' taken one tokenizer token at a time")
    grammar = new_grammar(impl, choices, tokens, inputs)  # building it may read the tables once
    mask = torch.full((1, SMOLLM2_VOCAB // 32), -1, dtype=torch.int32)
    for step, token_id in enumerate(tokenizer.encode("Paris, Texas")):
        for call in ("allowed_token_ids()", "fill_bitmask(mask, 0)", f"accept_tokens([{token_id}])"):
            texts.reads = index.reads = 0
            with exercising("ChoiceGrammar", inputs):
                if call == "allowed_token_ids()":
                    grammar.allowed_token_ids()
                elif call.startswith("fill"):
                    grammar.fill_bitmask(mask, 0)
                else:
                    grammar.accept_tokens([token_id])
            reads = texts.reads + index.reads
            if reads > MAX_READS_PER_CALL:
                raise AssertionError(
                    f"on input {inputs}: {call} at step {step} read {reads:,} entries of the tables (texts "
                    f"{texts.reads:,}, ids_by_text {index.reads:,}); at most {MAX_READS_PER_CALL:,} expected. It runs "
                    "for every constrained sample at every step: look up the prefixes of what is left of each choice "
                    "in ids_by_text instead of testing every token of the vocabulary")


# --- capstone: your mask, your matcher, in the engine on SmolLM2 ---------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "student": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "student"],
    "additionalProperties": False,
}
JSON_QUESTION = "Describe a person as a JSON object: their name, age, city, and whether they are a student."
CHOICE_QUESTION = "Which city is the capital of France?"
CHOICES = ["Paris", "Paris, Texas", "London", "Lyon"]  # "Paris" is a choice and the start of a longer one
JSON_SEEDS = [0, 1, 2]
CHOICE_SAMPLES = 3  # n: one grammar per sample
GREEDY_PROMPT, GREEDY_TOKENS = 0, 16  # an unconstrained request in the same batch (index into CAPSTONE_PROMPTS)
CAPSTONE_ENGINE = dict(block_size=16, num_kv_blocks=96, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=256,
                       long_prefill_token_threshold=512)


def chat(tokenizer, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def capstone_requests(tokenizer) -> list[tuple[str | list[int], SamplingParams]]:
    """Three JSON requests (temperature 1, one seed each), a choice request with n=3, one greedy free request."""
    person = [(chat(tokenizer, JSON_QUESTION), SamplingParams(
        temperature=1.0, seed=seed, max_tokens=80, structured_outputs=StructuredOutputsParams(json=PERSON)))
        for seed in JSON_SEEDS]
    city = (chat(tokenizer, CHOICE_QUESTION), SamplingParams(
        n=CHOICE_SAMPLES, temperature=1.0, seed=0, max_tokens=16,
        structured_outputs=StructuredOutputsParams(choice=CHOICES)))
    free = (CAPSTONE_PROMPTS[GREEDY_PROMPT], SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
    return [*person, city, free]


@pytest.mark.exercise("capstone")
@pytest.mark.timeout(180)  # a real model: a few seconds on an idle machine
def test_capstone_your_masks_in_the_engine_give_valid_json_and_choices_on_smollm2(impl):
    _, tokenizer = smollm2()
    requests = capstone_requests(tokenizer)
    inputs = (f"SmolLM2-135M, one batch: JSON schema {json.dumps(PERSON)} at temperature 1, seeds {JSON_SEEDS}; "
              f"choice {CHOICES} at temperature 1, n={CHOICE_SAMPLES}; CAPSTONE_PROMPTS[{GREEDY_PROMPT}] greedy, "
              f"{GREEDY_TOKENS} tokens, unconstrained")
    with swap_in(impl, REFERENCE):  # your masks, applied by the model runner before it samples; your ChoiceGrammar
        # Fresh, built inside the swap: no request of an earlier run left in it, and its core made with your pieces.
        engine = LLMEngine.from_engine_args(EngineArgs(model="smollm2-135m", **CAPSTONE_ENGINE))
        try:
            outputs = generate_batch(engine, requests)
        except RuntimeError as error:
            if "mask forbids" not in str(error):
                raise
            raise AssertionError(  # the matcher refused a token the mask let through
                f"on input {inputs}: {error}. A mask row allowed a token its grammar does not: look at the bit order "
                "(pack_token_bitmask, apply_token_bitmask), at which row is read, and at whether fill_bitmask "
                "writes its row") from None
        finally:
            engine.shutdown()
    for seed, output in zip(JSON_SEEDS, outputs, strict=False):
        text = output.outputs[0].text
        where = f"{inputs}; the JSON output of seed {seed}, {text!r}"
        expect_equal(output.outputs[0].finish_reason, FinishReason.STOP, inputs=f"{where}; finish_reason (the grammar "
                     "completes the object well within max_tokens)")
        try:
            jsonschema.validate(json.loads(text), PERSON)
        except (json.JSONDecodeError, jsonschema.ValidationError) as error:
            raise AssertionError(f"on input {where}: not valid against the schema: {error}") from None
    samples = outputs[len(JSON_SEEDS)].outputs
    expect_equal(len(samples), CHOICE_SAMPLES, inputs=f"{inputs}; samples of the choice request")
    for sample in samples:
        expect_equal((sample.text in CHOICES, sample.finish_reason), (True, FinishReason.STOP), inputs=f"{inputs}; "
                     f"choice sample {sample.index}, {sample.text!r}: (one of the choices, finish_reason)")
    expect_equal(outputs[-1].outputs[0].token_ids, smollm2_greedy(GREEDY_PROMPT, GREEDY_TOKENS),
                 inputs=f"{inputs}; the unconstrained greedy request's tokens (oracle: Hugging Face greedy; a mask "
                 "must leave a row without a grammar alone)")

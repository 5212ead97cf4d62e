"""Grading tests for chapter 05 — continuous batching.

Each test grades one exercise (`@pytest.mark.exercise`). The oracles are independent of the code under test:
budgets, chunks and admissions counted by hand for the scheduler; the pool's free count and the queue's order
for preemption; positions, slots and offsets written out by hand for the flattened batch; Hugging Face
`generate` for the engine step; a per-row sort in float64 for the top-p and min-p filters.
"""

import functools

import pytest
import torch

from grading import exercising, expect_equal
from grading.tiny_models import hf_model, tiny_checkpoint
from solutions import LLM, SamplingParams
from solutions.core import kv_cache_manager
from solutions.core.sched import scheduler as scheduler_module
from solutions.core.sched.output import SchedulerOutput
from solutions.core.sched.request_queue import SchedulingPolicy
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.engine import llm_engine
from solutions.sample import sampler
from solutions.worker import model_runner

REFERENCE = {
    "Scheduler": scheduler_module.Scheduler,
    "preempt": scheduler_module.preempt,
    "prepare_inputs": model_runner.prepare_inputs,
    "engine_step": llm_engine.engine_step,
    "apply_top_p": sampler.apply_top_p,
    "apply_min_p": sampler.apply_min_p,
}

pytestmark = pytest.mark.timeout(60)



# --- the scheduler: building blocks ------------------------------------------------------------------------------


def make_scheduler(cls, *, num_blocks=32, block_size=4, max_num_seqs=8, budget=16, threshold=None, policy="fcfs"):
    manager = kv_cache_manager.KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    return cls(
        manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold or budget, policy=SchedulingPolicy(policy),
    )


def waiting_seq(sched, seq_id: int, num_tokens: int, priority: int = 0) -> Sequence:
    seq = Sequence(seq_id, list(range(10, 10 + num_tokens)), priority=priority)
    sched.add_seq(seq)
    return seq


def decoding_seq(sched, seq_id: int, num_prompt: int, num_output: int) -> Sequence:
    """A running sequence whose prompt and first outputs are computed; its newest token is not (one behind)."""
    seq = Sequence(seq_id, list(range(10, 10 + num_prompt)))
    for i in range(num_output):
        seq.append_token(200 + i)
    assert sched.kv_cache_manager.allocate_slots(seq, seq.num_tokens - 1) is not None
    seq.num_computed_tokens = seq.num_tokens - 1
    sched.add_running(seq)
    return seq


def batch(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(seq.seq_id, n) for seq, n in zip(out.scheduled_seqs, out.num_scheduled_tokens, strict=True)]


def run_batch(out: SchedulerOutput, sched=None) -> None:
    """What the model runner does to the scheduler's state: the scheduled tokens are now computed. With
    `sched`, a prompt now fully computed finishes at once (as if it had `max_tokens=0`): nothing is sampled."""
    for seq, n in zip(out.scheduled_seqs, out.num_scheduled_tokens, strict=True):
        seq.num_computed_tokens += n
        if sched is not None and seq.num_computed_tokens == seq.num_tokens:
            sched.finish(seq, SequenceStatus.FINISHED_LENGTH_CAPPED)


# --- Scheduler.schedule ------------------------------------------------------------------------------------------


@pytest.mark.exercise("Scheduler")
def test_schedule_admits_prompts_until_the_token_budget_is_spent(impl):
    inputs = "budget 10, waiting prompts of 4, 4 and 5 tokens"
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, budget=10)
        seqs = [waiting_seq(sched, i, n) for i, n in enumerate((4, 4, 5))]
        out = sched.schedule()
    expect_equal(batch(out), [(0, 4), (1, 4), (2, 2)], inputs=f"{inputs}; (seq_id, tokens) scheduled — the third prompt gets the 2 tokens left")
    expect_equal(out.new_seq_ids, [0, 1, 2], inputs=f"{inputs}; new_seq_ids")
    expect_equal([s.seq_id for s in sched.running], [0, 1, 2], inputs=f"{inputs}; running after the step")
    expect_equal([s.status for s in seqs], [SequenceStatus.RUNNING] * 3, inputs=f"{inputs}; statuses")
    expect_equal(len(sched.waiting), 0, inputs=f"{inputs}; sequences left waiting")


@pytest.mark.exercise("Scheduler")
def test_schedule_never_exceeds_the_budget_over_many_steps(impl):
    inputs = "budget 7, threshold 7, prompts of 9, 3, 12 and 5 tokens, steps run to the end of the prompts"
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, budget=7, num_blocks=64)
        seqs = [waiting_seq(sched, i, n) for i, n in enumerate((9, 3, 12, 5))]
        steps = []
        while any(s.num_computed_tokens < s.num_tokens for s in seqs) and len(steps) < 20:
            out = sched.schedule()
            steps.append(batch(out))
            run_batch(out, sched)
    # Hand-computed: each step fills the budget in FCFS order, chunks where the budget runs out.
    want = [[(0, 7)], [(0, 2), (1, 3), (2, 2)], [(2, 7)], [(2, 3), (3, 4)], [(3, 1)]]
    expect_equal(steps, want, inputs=f"{inputs}; (seq_id, tokens) of each step (no sampling, so no decodes)")


@pytest.mark.exercise("Scheduler")
def test_schedule_serves_running_sequences_before_waiting_ones(impl):
    inputs = "budget 8; running: two decoding sequences (ids 0, 1); waiting: a 20-token prompt (id 2)"
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, budget=8)
        decoding_seq(sched, 0, 5, 2)
        decoding_seq(sched, 1, 3, 1)
        waiting_seq(sched, 2, 20)
        out = sched.schedule()
    expect_equal(batch(out), [(0, 1), (1, 1), (2, 6)], inputs=f"{inputs}; (seq_id, tokens) scheduled")
    expect_equal((out.num_decode_tokens, out.num_prefill_tokens), (2, 6), inputs=f"{inputs}; (decode, prefill) tokens")


@pytest.mark.exercise("Scheduler")
def test_schedule_keeps_decoding_while_a_long_prompt_is_chunked(impl):
    inputs = "budget 6; running: one decoding sequence (id 0); waiting: a 10-token prompt (id 1); three steps"
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, budget=6)
        decoder = decoding_seq(sched, 0, 4, 1)
        prompt = waiting_seq(sched, 1, 10)
        steps = []
        for _ in range(3):
            out = sched.schedule()
            steps.append(batch(out))
            run_batch(out)
            decoder.append_token(7)  # the decoder samples a token each step
            if prompt.num_computed_tokens == prompt.num_tokens and not prompt.is_finished:
                sched.finish(prompt, SequenceStatus.FINISHED_LENGTH_CAPPED)  # nothing sampled for it here
    expect_equal(steps, [[(0, 1), (1, 5)], [(0, 1), (1, 5)], [(0, 1)]], inputs=f"{inputs}; (seq_id, tokens) per step")


@pytest.mark.exercise("Scheduler")
def test_schedule_splits_prompts_at_the_long_prefill_threshold(impl):
    inputs = "budget 16, long_prefill_token_threshold 4, prompts of 10 and 3 tokens"
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, budget=16, threshold=4)
        waiting_seq(sched, 0, 10)
        waiting_seq(sched, 1, 3)
        steps = []
        for _ in range(3):
            out = sched.schedule()
            steps.append(batch(out))
            run_batch(out, sched)
    expect_equal(steps, [[(0, 4), (1, 3)], [(0, 4)], [(0, 2)]], inputs=f"{inputs}; (seq_id, tokens) per step")


@pytest.mark.exercise("Scheduler")
def test_schedule_admits_at_most_max_num_seqs(impl):
    inputs = "max_num_seqs 2, budget 16, three waiting 2-token prompts"
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, max_num_seqs=2)
        for i in range(3):
            waiting_seq(sched, i, 2)
        out = sched.schedule()
    expect_equal(batch(out), [(0, 2), (1, 2)], inputs=f"{inputs}; (seq_id, tokens) scheduled")
    expect_equal([s.seq_id for s in sched.waiting], [2], inputs=f"{inputs}; still waiting")


@pytest.mark.exercise("Scheduler")
def test_schedule_keeps_the_queue_order_when_memory_is_short(impl):
    inputs = "4 blocks of 4 slots; waiting: a 20-token prompt (id 0, needs 5 blocks), then a 2-token one (id 1)"
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, num_blocks=4, budget=32)
        waiting_seq(sched, 0, 20)
        waiting_seq(sched, 1, 2)
        out = sched.schedule()
    expect_equal(batch(out), [], inputs=f"{inputs}; nothing may jump the line")
    expect_equal([s.seq_id for s in sched.waiting], [0, 1], inputs=f"{inputs}; waiting queue")
    expect_equal(sched.kv_cache_manager.num_free_blocks, 4, inputs=f"{inputs}; free blocks")


@pytest.mark.exercise("Scheduler")
def test_schedule_admits_by_priority_under_the_priority_policy(impl):
    inputs = "policy priority, budget 5; waiting prompts of 3 tokens with priorities 2, 0, 1 (ids 0, 1, 2)"
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, budget=5, policy="priority")
        for i, priority in enumerate((2, 0, 1)):
            waiting_seq(sched, i, 3, priority=priority)
        out = sched.schedule()
    expect_equal(batch(out), [(1, 3), (2, 2)], inputs=f"{inputs}; (seq_id, tokens) scheduled")


@pytest.mark.exercise("Scheduler")
def test_schedule_preempts_the_newest_when_blocks_run_out(impl):
    inputs = ("5 blocks of 4 slots; running: ids 0 and 1, each 8 tokens computed and a 9th to compute (needs a new "
              "block), 1 block free; waiting: a 2-token prompt (id 2)")
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, num_blocks=5, budget=16)
        first = decoding_seq(sched, 0, 6, 3)
        second = decoding_seq(sched, 1, 6, 3)
        waiting_seq(sched, 2, 2)
        out = sched.schedule()
    expect_equal(batch(out), [(0, 1)], inputs=f"{inputs}; (seq_id, tokens) scheduled")
    expect_equal(out.preempted_seq_ids, [1], inputs=f"{inputs}; preempted_seq_ids (FCFS: the last to start)")
    expect_equal([s.seq_id for s in sched.waiting], [1, 2], inputs=f"{inputs}; waiting queue (no admission in a step that preempts)")
    expect_equal((len(first.block_table), len(second.block_table)), (3, 0), inputs=f"{inputs}; blocks held by ids 0, 1")
    expect_equal(sched.kv_cache_manager.num_free_blocks, 2, inputs=f"{inputs}; free blocks")


@pytest.mark.exercise("Scheduler")
def test_schedule_admits_nothing_in_a_step_that_preempts(impl):
    inputs = ("policy priority, 4 blocks of 4, all in use; running: id 0 (priority 0, 8 tokens computed and a 9th to "
              "compute) and id 1 (priority 5, 8 tokens); waiting: a 2-token prompt (id 2, priority 1)")
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, num_blocks=4, budget=16, policy="priority")
        decoding_seq(sched, 0, 6, 3)
        low = decoding_seq(sched, 1, 6, 2)
        low.priority = 5
        newcomer = waiting_seq(sched, 2, 2, priority=1)
        out = sched.schedule()
    expect_equal(batch(out), [(0, 1)], inputs=f"{inputs}; (seq_id, tokens) scheduled")
    expect_equal(out.preempted_seq_ids, [1], inputs=f"{inputs}; preempted_seq_ids (the lowest priority)")
    expect_equal((newcomer.status, newcomer.block_table), (SequenceStatus.WAITING, []),
                 inputs=f"{inputs}; id 2 after the step (the freed block is for the running, not a newcomer)")


# --- preempt -----------------------------------------------------------------------------------------------------


@pytest.mark.exercise("preempt")
def test_preempt_frees_every_block_and_requeues_at_the_front(impl):
    inputs = "8 blocks of 4; running ids 0 (6 tokens) and 1 (10 tokens); waiting id 2; preempt id 1"
    sched = make_scheduler(scheduler_module.Scheduler, num_blocks=8)
    decoding_seq(sched, 0, 5, 1)
    victim = decoding_seq(sched, 1, 8, 2)
    waiting_seq(sched, 2, 3)
    out = SchedulerOutput()
    impl.preempt(sched, victim, out)
    expect_equal(victim.block_table, [], inputs=f"{inputs}; block table of id 1")
    expect_equal(sched.kv_cache_manager.num_free_blocks, 8 - 2, inputs=f"{inputs}; free blocks (id 0 keeps its 2)")
    expect_equal(victim.num_computed_tokens, 0, inputs=f"{inputs}; num_computed_tokens of id 1 (recompute from 0)")
    expect_equal(victim.num_tokens, 10, inputs=f"{inputs}; tokens of id 1 (kept, to be recomputed)")
    expect_equal(victim.status, SequenceStatus.PREEMPTED, inputs=f"{inputs}; status of id 1")
    expect_equal([s.seq_id for s in sched.running], [0], inputs=f"{inputs}; running")
    expect_equal([s.seq_id for s in sched.waiting], [1, 2], inputs=f"{inputs}; waiting (the victim first)")
    expect_equal(out.preempted_seq_ids, [1], inputs=f"{inputs}; out.preempted_seq_ids")
    expect_equal(sched.num_preemptions, 1, inputs=f"{inputs}; num_preemptions")


@pytest.mark.exercise("preempt")
def test_preempt_then_resume_gives_the_blocks_back_every_time(impl):
    inputs = "6 blocks of 4; one sequence of 11 tokens, preempted and re-admitted three times"
    sched = make_scheduler(scheduler_module.Scheduler, num_blocks=6)
    seq = decoding_seq(sched, 0, 9, 2)
    free = []
    for _ in range(3):
        impl.preempt(sched, seq, SchedulerOutput())
        free.append(sched.kv_cache_manager.num_free_blocks)
        out = sched.schedule()  # the reference scheduler re-admits it: the whole sequence again
        free.append(sched.kv_cache_manager.num_free_blocks)
        expect_equal(batch(out), [(0, 11)], inputs=f"{inputs}; the step after a preemption recomputes everything")
        run_batch(out)
    expect_equal(free, [6, 3] * 3, inputs=f"{inputs}; free blocks after each preemption and re-admission")


@pytest.mark.exercise("preempt")
def test_preempted_sequences_resume_with_hugging_faces_tokens(impl, monkeypatch):
    monkeypatch.setattr(scheduler_module, "preempt", impl.preempt)  # the engine's scheduler now preempts with yours
    folder = tiny_checkpoint("llama-gqa")
    llm = LLM(model=str(folder), block_size=4, num_kv_blocks=12, max_num_seqs=4)
    prompts = [list(range(30 + i, 38 + 2 * i)) for i in range(4)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    inputs = "tiny llama-gqa, 4 prompts of 8-14 tokens, 16 new tokens each, 12 blocks of 4 (preemptions)"
    assert llm.llm_engine.scheduler.num_preemptions > 0, f"{inputs}: the test expected preemptions"
    for prompt, output in zip(prompts, outputs, strict=True):
        expect_equal(output.outputs[0].token_ids, hf_greedy(folder, tuple(prompt), 16), inputs=f"{inputs}; prompt {prompt}")
    expect_equal(llm.llm_engine.kv_cache_manager.num_used_blocks, 0, inputs=f"{inputs}; blocks in use at the end")


# --- prepare_inputs ----------------------------------------------------------------------------------------------


def mixed_step() -> SchedulerOutput:
    """block_size 4. A decodes (6 tokens, 5 computed); B's second prompt chunk (10 tokens, 4 computed, 4 new);
    C's first chunk (3 tokens, none computed)."""
    a = Sequence(0, [11, 12, 13, 14, 15])
    a.append_token(16)
    a.num_computed_tokens, a.block_table = 5, [3, 1]
    b = Sequence(1, list(range(20, 30)))
    b.num_computed_tokens, b.block_table = 4, [0, 2, 5]
    c = Sequence(2, [40, 41, 42])
    c.block_table = [6]
    return SchedulerOutput(scheduled_seqs=[a, b, c], num_scheduled_tokens=[1, 4, 3])


MIXED = "a mixed step, block_size 4: A decodes position 5 (table [3, 1]), B prefills positions 4-7 (table [0, 2, 5]), C positions 0-2 (table [6])"


@pytest.mark.exercise("prepare_inputs")
def test_prepare_inputs_concatenates_the_new_tokens(impl):
    input_ids, positions, metadata = impl.prepare_inputs(mixed_step(), 4)
    expect_equal(input_ids.tolist(), [16, 24, 25, 26, 27, 40, 41, 42], inputs=f"{MIXED}; input_ids")
    expect_equal(input_ids.dtype, torch.long, inputs=f"{MIXED}; input_ids dtype")


@pytest.mark.exercise("prepare_inputs")
def test_prepare_inputs_positions_continue_from_the_computed_tokens(impl):
    _, positions, _ = impl.prepare_inputs(mixed_step(), 4)
    expect_equal(positions.tolist(), [5, 4, 5, 6, 7, 0, 1, 2], inputs=f"{MIXED}; positions")
    expect_equal(positions.dtype, torch.long, inputs=f"{MIXED}; positions dtype")


@pytest.mark.exercise("prepare_inputs")
def test_prepare_inputs_slot_mapping_goes_through_each_block_table(impl):
    _, _, metadata = impl.prepare_inputs(mixed_step(), 4)
    # A: position 5 -> block_table[1] = 1 -> slot 1*4 + 1; B: positions 4-7 -> block 2 -> 8..11; C: block 6 -> 24..26
    expect_equal(metadata.slot_mapping.tolist(), [5, 8, 9, 10, 11, 24, 25, 26], inputs=f"{MIXED}; slot_mapping")


@pytest.mark.exercise("prepare_inputs")
def test_prepare_inputs_per_sequence_metadata(impl):
    _, _, metadata = impl.prepare_inputs(mixed_step(), 4)
    expect_equal(metadata.query_start_loc.tolist(), [0, 1, 5, 8], inputs=f"{MIXED}; query_start_loc")
    expect_equal(metadata.seq_lens.tolist(), [6, 8, 3], inputs=f"{MIXED}; seq_lens (context up to the last new token)")
    expect_equal([list(t) for t in metadata.block_tables], [[3, 1], [0, 2, 5], [6]], inputs=f"{MIXED}; block_tables")


@pytest.mark.exercise("prepare_inputs")
def test_prepare_inputs_changes_no_sequence(impl):
    step = mixed_step()
    impl.prepare_inputs(step, 4)
    state = [(s.num_computed_tokens, s.num_tokens, list(s.block_table)) for s in step.scheduled_seqs]
    expect_equal(state, [(5, 6, [3, 1]), (4, 10, [0, 2, 5]), (0, 3, [6])],
                 inputs=f"{MIXED}; (num_computed_tokens, num_tokens, block_table) afterwards — the runner advances them, not prepare_inputs")


# --- engine_step -------------------------------------------------------------------------------------------------


@functools.cache
def hf_greedy(folder, prompt: tuple[int, ...], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf_oracle(folder).generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@functools.cache
def hf_oracle(folder):
    return hf_model(folder)


def drive(impl, engine, limit: int = 300) -> dict[str, list[list[int]]]:
    """Run `impl.engine_step` until every request finishes; request id -> token ids of each sample."""
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return tokens
        for output in impl.engine_step(engine):
            samples = tokens.setdefault(output.request_id, [[] for _ in output.outputs])
            for completion in output.outputs:
                samples[completion.index] += completion.token_ids  # outputs are deltas
    raise AssertionError(f"the engine still had unfinished requests after {limit} calls of engine_step")


@pytest.mark.exercise("engine_step")
@pytest.mark.parametrize("threshold", [4, 64], ids=["chunked", "whole-prompts"])
def test_engine_step_produces_hugging_faces_greedy_tokens(impl, threshold):
    folder = tiny_checkpoint("llama-gqa")
    llm = LLM(model=str(folder), block_size=4, max_num_batched_tokens=12, long_prefill_token_threshold=threshold)
    engine = llm.llm_engine
    prompts = [list(range(50, 60)), [7, 8, 9], list(range(90, 97)), [3]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    got = drive(impl, engine)
    inputs = f"tiny llama-gqa, block_size 4, budget 12, long_prefill_token_threshold {threshold}, prompts of 10, 3, 7, 1 tokens, 10 new tokens each"
    for i, prompt in enumerate(prompts):
        expect_equal(got.get(f"r{i}"), [hf_greedy(folder, tuple(prompt), 10)], inputs=f"{inputs}; request r{i}")
    expect_equal(engine.kv_cache_manager.num_used_blocks, 0, inputs=f"{inputs}; blocks in use at the end")


@pytest.mark.exercise("engine_step")
def test_engine_step_gives_every_sample_of_n_its_tokens(impl):
    folder = tiny_checkpoint("llama-gqa")
    engine = LLM(model=str(folder), block_size=4, max_num_batched_tokens=8).llm_engine
    prompt = list(range(60, 71))
    engine.add_request("r0", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.add_request("r1", [5, 6], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    got = drive(impl, engine)
    inputs = "tiny llama-gqa, budget 8: an 11-token prompt with n=3 (greedy) beside a 2-token prompt, 6 new tokens each"
    expect_equal(got.get("r0"), [hf_greedy(folder, tuple(prompt), 6)] * 3, inputs=f"{inputs}; the 3 samples of r0")
    expect_equal(got.get("r1"), [hf_greedy(folder, (5, 6), 6)], inputs=f"{inputs}; r1")


@pytest.mark.exercise("engine_step")
def test_engine_step_records_each_step(impl):
    folder = tiny_checkpoint("llama-gqa")
    engine = LLM(model=str(folder), block_size=4, max_num_batched_tokens=6).llm_engine
    engine.add_request("r0", list(range(40, 50)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    drive(impl, engine)
    steps = [(s.num_prefill_tokens, s.num_decode_tokens) for s in engine.stats.steps]
    inputs = "tiny llama-gqa, budget 6, a 10-token prompt, 3 new tokens"
    expect_equal(steps, [(6, 0), (4, 0), (0, 1), (0, 1)], inputs=f"{inputs}; (prefill, decode) tokens of each step")


# --- apply_top_p, apply_min_p ------------------------------------------------------------------------------------


def random_rows(seed: int, rows: int = 5, vocab: int = 12) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2  # (B, V), unsorted


def oracle_top_p(logits: torch.Tensor, p: list[float]) -> list[list[bool]]:
    """Per row, in float64: sort, keep tokens while the mass of the more likely ones is below p."""
    kept = []
    for row, row_p in zip(logits.double().softmax(-1).tolist(), p, strict=True):
        order = sorted(range(len(row)), key=lambda i: -row[i])
        keep, mass = [False] * len(row), 0.0
        for i in order:
            if mass >= row_p:
                break
            keep[i], mass = True, mass + row[i]
        kept.append(keep)
    return kept


def between_masses(logits: torch.Tensor, which: list[int]) -> list[float]:
    """For each row, a p halfway between two consecutive cumulative masses (no float tie at the boundary)."""
    cum = logits.double().softmax(-1).sort(descending=True).values.cumsum(-1)
    return [float(cum[b, k] + cum[b, k + 1]) / 2 for b, k in enumerate(which)]


def expect_filtered(got, logits: torch.Tensor, kept: list[list[bool]], inputs: str) -> None:
    if not isinstance(got, torch.Tensor) or got.shape != logits.shape:
        raise AssertionError(f"on input {inputs}: expected logits of shape {tuple(logits.shape)}, got {got!r:.80}")
    expect_equal(got.isfinite().tolist(), kept, inputs=f"{inputs}; which tokens are kept (finite)")
    mask = torch.tensor(kept)
    expect_equal(torch.equal(got[mask], logits[mask]), True, inputs=f"{inputs}; kept logits are unchanged")
    expect_equal(bool((got[~mask] == float("-inf")).all()), True, inputs=f"{inputs}; dropped logits are -inf")


@pytest.mark.exercise("apply_top_p")
def test_top_p_keeps_the_smallest_nucleus_of_a_known_row(impl):
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]] * 3))
    p = [0.7, 0.9, 0.3]
    got = impl.apply_top_p(logits.clone(), torch.tensor(p))
    kept = [[False, True, False, True], [False, True, True, True], [False, True, False, False]]
    expect_filtered(got, logits, kept, "probabilities [0.05, 0.5, 0.15, 0.3], top_p 0.7, 0.9, 0.3 per row")


@pytest.mark.exercise("apply_top_p")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_p_matches_a_sorting_oracle_per_row(impl, seed):
    logits = random_rows(seed)
    p = between_masses(logits, [0, 2, 4, 7, 10])
    got = impl.apply_top_p(logits.clone(), torch.tensor(p))
    expect_filtered(got, logits, oracle_top_p(logits, p), f"random logits (5, 12) seed {seed}, top_p {[round(x, 3) for x in p]}")


@pytest.mark.exercise("apply_top_p")
def test_top_p_one_keeps_everything(impl):
    logits = random_rows(5, rows=2)
    got = impl.apply_top_p(logits.clone(), torch.tensor([1.0, 1.0]))
    expect_filtered(got, logits, [[True] * 12] * 2, "random logits (2, 12), top_p 1.0")


@pytest.mark.exercise("apply_min_p")
def test_min_p_drops_tokens_below_the_scaled_maximum(impl):
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]] * 3))
    got = impl.apply_min_p(logits.clone(), torch.tensor([0.25, 0.5, 0.0]))
    kept = [[False, True, True, True], [False, True, False, True], [True, True, True, True]]
    expect_filtered(got, logits, kept, "probabilities [0.05, 0.5, 0.15, 0.3], min_p 0.25, 0.5, 0.0 per row")


@pytest.mark.exercise("apply_min_p")
@pytest.mark.parametrize("seed", [0, 1])
def test_min_p_matches_a_sorting_oracle_per_row(impl, seed):
    logits = random_rows(seed)
    probs = logits.double().softmax(-1)
    ratios = (probs / probs.max(-1, keepdim=True).values).sort(descending=True).values  # (B, V)
    min_p = [float(ratios[b, k] + ratios[b, k + 1]) / 2 for b, k in enumerate([1, 3, 5, 8, 10])]
    kept = [[r >= m for r in (probs[b] / probs[b].max()).tolist()] for b, m in enumerate(min_p)]
    got = impl.apply_min_p(logits.clone(), torch.tensor(min_p))
    expect_filtered(got, logits, kept, f"random logits (5, 12) seed {seed}, min_p {[round(x, 3) for x in min_p]}")

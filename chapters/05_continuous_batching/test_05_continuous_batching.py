"""Grading tests for chapter 05 — continuous batching.

Each test grades one exercise (`@pytest.mark.exercise`). The oracles are independent of the code under test:
budgets, chunks and admissions counted by hand for the scheduler; the victims, the batch, the budget handed
back and the pool's free count, worked out by hand, for preemption; positions, slots and offsets written out by
hand for the flattened batch; the sampling rows of hand-made steps, and Hugging Face `generate`, for which rows
sample; Hugging Face `generate` and a grammar's choices for the engine core's step; a per-row sort in float64 for
the top-p and min-p filters; Hugging Face's `RepetitionPenaltyLogitsProcessor` and `generate(repetition_penalty=)`,
and OpenAI's formula written out per token, for the penalties.
"""

import functools

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from grading import exercising, expect_close, expect_equal
from grading.differential import differential_test, scheduler_workloads
from grading.capstone import CAPSTONE_PROMPTS, smollm2_greedy, swap_in
from grading.tiny_models import hf_model, tiny_checkpoint
from solutions import LLM, SamplingParams, StructuredOutputsParams
from solutions.core import kv_cache_manager
from solutions.core.sched import output as output_module
from solutions.core.sched import scheduler as scheduler_module
from solutions.core.sched.output import SchedulerOutput
from solutions.core.sched.request_queue import SchedulingPolicy
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.engine import EngineCoreOutputs
from solutions.engine import core as core_module
from solutions.engine.arg_utils import EngineArgs
from solutions.engine.llm_engine import LLMEngine
from solutions.metrics.stats import SchedulerStats
from solutions.sample import sampler
from solutions.sample.ops import penalties as penalties_module
from solutions.worker import model_runner

REFERENCE = {
    "Scheduler": scheduler_module.Scheduler,
    "select_victim": scheduler_module.select_victim,
    "allocate_or_preempt": scheduler_module.allocate_or_preempt,
    "prepare_inputs": model_runner.prepare_inputs,
    "sampling_rows": output_module.sampling_rows,
    "engine_step": core_module.engine_step,
    "apply_top_p": sampler.apply_top_p,
    "apply_min_p": sampler.apply_min_p,
    "apply_penalties": penalties_module.apply_penalties,
}

pytestmark = pytest.mark.timeout(60)



# --- the scheduler: building blocks ------------------------------------------------------------------------------


def make_scheduler(cls, *, num_blocks=32, block_size=4, max_num_seqs=8, budget=16, threshold=None, policy="fcfs",
                   prefix_caching=False):
    manager = kv_cache_manager.KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return cls(
        manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold or budget, policy=SchedulingPolicy(policy),
    )


def waiting_seq(sched, seq_id: int, num_tokens: int, priority: int = 0, fork_seq_ids: tuple[int, ...] = ()) -> Sequence:
    seq = Sequence(seq_id, list(range(10, 10 + num_tokens)), priority=priority)
    seq.fork_seq_ids = list(fork_seq_ids)
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
    """After the forward pass (`schedule()` has already advanced the computed tokens): with `sched`, a prompt
    now fully computed finishes at once (as if it had `max_tokens=0`): nothing is sampled."""
    for seq in out.scheduled_seqs:
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
    expect_equal(batch(out), [(0, 4), (1, 4), (2, 2)],
                 inputs=f"{inputs}; (seq_id, tokens) scheduled — the third prompt gets the 2 tokens left")
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
def test_schedule_advances_the_computed_tokens_of_what_it_schedules(impl):
    inputs = "budget 8; running: a decoding sequence (id 0, 5 of 6 tokens computed); waiting: a 12-token prompt (id 1)"
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, budget=8)
        decoder = decoding_seq(sched, 0, 5, 1)
        prompt = waiting_seq(sched, 1, 12)
        out = sched.schedule()
    expect_equal(batch(out), [(0, 1), (1, 7)], inputs=f"{inputs}; (seq_id, tokens) scheduled")
    expect_equal(out.num_computed_tokens, [5, 0],
                 inputs=f"{inputs}; out.num_computed_tokens (where each one's new tokens start)")
    expect_equal((decoder.num_computed_tokens, prompt.num_computed_tokens), (6, 7),
                 inputs=f"{inputs}; num_computed_tokens of ids 0, 1 after schedule() — the scheduler is its one writer")


@pytest.mark.exercise("Scheduler")
def test_schedule_counts_the_samples_a_request_will_fork(impl):
    inputs = ("max_num_seqs 4, budget 16; waiting: id 0, a 3-token prompt with n=3 (it will fork ids 10, 11), then "
              "2-token prompts ids 1 and 2")
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, max_num_seqs=4)
        waiting_seq(sched, 0, 3, fork_seq_ids=(10, 11))
        waiting_seq(sched, 1, 2)
        waiting_seq(sched, 2, 2)
        out = sched.schedule()
    expect_equal(batch(out), [(0, 3), (1, 2)], inputs=f"{inputs}; (seq_id, tokens) scheduled — id 0 takes 3 seats")
    expect_equal({k: [s.seq_id for s in v] for k, v in out.forked_seqs.items()}, {0: [10, 11]},
                 inputs=f"{inputs}; forked_seqs (id 0's prompt completes this step)")
    expect_equal([s.seq_id for s in sched.running], [0, 1, 10, 11], inputs=f"{inputs}; running after the step")
    expect_equal([s.seq_id for s in sched.waiting], [2], inputs=f"{inputs}; still waiting")


@pytest.mark.exercise("Scheduler")
def test_schedule_hands_the_runner_the_copies_its_samples_need(impl):
    inputs = ("block_size 4; waiting: id 0, a 10-token prompt with n=3 (it forks ids 10, 11); after the prompt's step "
              "each sample appends one token and the next step is scheduled")
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, max_num_seqs=4)
        waiting_seq(sched, 0, 10, fork_seq_ids=(10, 11))
        sched.schedule()
        samples = list(sched.running)
        last_blocks = [seq.block_table[-1] for seq in samples]
        for seq in samples:
            seq.append_token(99)
        out = sched.schedule()
    moved = sorted((old, seq.block_table[-1]) for seq, old in zip(samples, last_blocks) if seq.block_table[-1] != old)
    expect_equal(len(moved), 2, inputs=f"{inputs}; samples given a block of their own for the shared last block")
    expect_equal(sorted(out.blocks_to_copy), moved,
                 inputs=f"{inputs}; the step's blocks_to_copy (source, destination), against the block tables")


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
    expect_equal([s.seq_id for s in sched.waiting], [1, 2],
                 inputs=f"{inputs}; waiting queue (no admission in a step that preempts)")
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


@pytest.mark.exercise("Scheduler")
def test_schedule_goes_on_after_a_priority_victim_ahead_of_it(impl):
    inputs = ("policy priority, 8 blocks of 4, 2 free, budget 10; running in this order: id 0 "
              "(priority 0, decoding, room in its block), id 1 (priority 5, 4 of its 12 prompt tokens computed: "
              "its chunk of 8 takes both free blocks), id 2 (priority 1, decoding, needs a new block), id 3 "
              "(priority 0, 4 of its 8 prompt tokens computed, needs a new block); waiting: id 4 (priority 0)")
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, num_blocks=8, budget=10, policy="priority")
        decoding_seq(sched, 0, 5, 2)
        victim = prompt_seq(sched, 1, 12, 4, priority=5)
        decoding_seq(sched, 2, 6, 3).priority = 1
        prompt_seq(sched, 3, 8, 4)
        waiting_seq(sched, 4, 2)
        out = sched.schedule()
    # Hand-computed: id 0 takes 1 token (9 left), id 1 its 8 (1 left) and the 2 free blocks; id 2 finds none, so
    # id 1 (the lowest priority, *ahead* of id 2) is taken out of the batch (its 8 tokens back: 9 left) and
    # preempted (3 blocks freed); id 2 takes 1 token and a block, and id 3 — after the victim, now one place
    # further left — still gets its 4 tokens and a block (4 left). Nothing is admitted in a step that preempted.
    expect_equal(batch(out), [(0, 1), (2, 1), (3, 4)],
                 inputs=f"{inputs}; (seq_id, tokens) scheduled — id 3 neither skipped nor left without the budget "
                 "id 1 handed back")
    expect_equal(out.preempted_seq_ids, [1], inputs=f"{inputs}; preempted_seq_ids")
    expect_equal(([s.seq_id for s in sched.running], [s.seq_id for s in sched.waiting]), ([0, 2, 3], [4, 1]),
                 inputs=f"{inputs}; (running, waiting: in priority order, the victim behind id 4)")
    expect_equal((victim.status, victim.num_computed_tokens, victim.block_table), (SequenceStatus.PREEMPTED, 0, []),
                 inputs=f"{inputs}; id 1's (status, num_computed_tokens, block_table)")
    expect_equal(sched.kv_cache_manager.num_free_blocks, 1, inputs=f"{inputs}; free blocks")


@pytest.mark.exercise("Scheduler")
def test_schedule_starts_an_admitted_prompt_at_its_cached_tokens(impl):
    inputs = ("prefix caching on, block_size 4, budget 16; a 10-token prompt (id 0) runs and finishes; then an "
              "11-token prompt (id 1) sharing its first 8 tokens arrives")
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, prefix_caching=True)
        first = waiting_seq(sched, 0, 10)
        run_batch(sched.schedule(), sched)
        cached_blocks = list(first.block_table) or "(freed)"
        second = Sequence(1, list(range(10, 18)) + [90, 91, 92])
        sched.add_seq(second)
        out = sched.schedule()
    expect_equal(batch(out), [(1, 3)],
                 inputs=f"{inputs}; (seq_id, tokens) scheduled — only the 3 tokens after the 2 cached blocks")
    expect_equal(out.num_cached_tokens, {1: 8}, inputs=f"{inputs}; num_cached_tokens")
    expect_equal(out.num_computed_tokens, [8],
                 inputs=f"{inputs}; out.num_computed_tokens (where id 1's new tokens start)")
    expect_equal(second.num_computed_tokens, 11,
                 inputs=f"{inputs}; num_computed_tokens of id 1 after schedule() (8 cached + 3 scheduled)")
    expect_equal(len(second.block_table), 3, inputs=f"{inputs}; blocks of id 1 (2 cached + 1 new; {cached_blocks})")
    expect_equal((out.num_prefill_tokens, out.num_decode_tokens), (3, 0), inputs=f"{inputs}; (prefill, decode) tokens")


@pytest.mark.exercise("Scheduler")
def test_schedule_chunks_a_cached_prompt_from_its_cached_tokens(impl):
    inputs = ("prefix caching on, block_size 4, budget 16, long_prefill_token_threshold 2; a 10-token prompt (id 0) "
              "runs and finishes; then a 13-token prompt (id 1) sharing its first 8 tokens, over three steps")
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, prefix_caching=True, threshold=16)
        waiting_seq(sched, 0, 10)
        run_batch(sched.schedule(), sched)
        sched.long_prefill_token_threshold = 2
        sched.add_seq(Sequence(1, list(range(10, 18)) + [90, 91, 92, 93, 94]))
        steps = []
        for _ in range(3):
            out = sched.schedule()
            steps.append((batch(out), list(out.num_computed_tokens)))
            run_batch(out, sched)
    expect_equal(steps, [([(1, 2)], [8]), ([(1, 2)], [10]), ([(1, 1)], [12])],
                 inputs=f"{inputs}; per step: (seq_id, tokens) scheduled and out.num_computed_tokens (where they "
                 "start)")


@pytest.mark.exercise("Scheduler")
def test_schedule_resumes_a_preempted_sequence_where_it_was(impl):
    inputs = ("prefix caching on, block_size 4, budget 16; id 0 (6 prompt + 3 output tokens, 8 computed) was "
              "preempted (its 2 full blocks stay cached); a new 3-token prompt (id 1) waits behind it")
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler, prefix_caching=True)
        resumed = decoding_seq(sched, 0, 6, 3)
        sched._preempt_request(resumed, SchedulerOutput())
        newcomer = waiting_seq(sched, 1, 3)
        out = sched.schedule()
    expect_equal(batch(out), [(0, 1), (1, 3)],
                 inputs=f"{inputs}; (seq_id, tokens) scheduled — id 0 finds its 8 tokens cached")
    expect_equal((out.resumed_seq_ids, out.new_seq_ids), ([0], [1]), inputs=f"{inputs}; (resumed_seq_ids, new_seq_ids)")
    expect_equal(out.num_cached_tokens, {0: 8, 1: 0}, inputs=f"{inputs}; num_cached_tokens")
    expect_equal((resumed.status, newcomer.status), (SequenceStatus.RUNNING, SequenceStatus.RUNNING),
                 inputs=f"{inputs}; statuses")
    expect_equal(out.num_computed_tokens, [8, 0],
                 inputs=f"{inputs}; out.num_computed_tokens (where each one's new tokens start)")
    expect_equal((resumed.num_computed_tokens, resumed.num_tokens), (9, 9),
                 inputs=f"{inputs}; id 0's (computed, total) tokens after schedule()")
    expect_equal([s.seq_id for s in sched.running], [0, 1], inputs=f"{inputs}; running")


@pytest.mark.exercise("Scheduler")
def test_schedule_resumes_without_a_prefix_cache_from_scratch(impl):
    inputs = ("prefix caching off, block_size 4, budget 16; id 0 (6 prompt + 3 output tokens) was preempted; "
              "two steps: the recompute, then its next decode")
    with exercising("Scheduler", inputs):
        sched = make_scheduler(impl.Scheduler)
        resumed = decoding_seq(sched, 0, 6, 3)
        sched._preempt_request(resumed, SchedulerOutput())
        first = sched.schedule()
        record = [(batch(first), first.resumed_seq_ids, first.new_seq_ids, resumed.status)]
        run_batch(first)
        resumed.append_token(300)  # the recompute's last row samples the next token
        second = sched.schedule()
        record.append((batch(second), second.resumed_seq_ids, second.new_seq_ids, resumed.status))
    want = [([(0, 9)], [0], [], SequenceStatus.RUNNING), ([(0, 1)], [], [], SequenceStatus.RUNNING)]
    expect_equal(record, want, inputs=f"{inputs}; per step: (batch, resumed_seq_ids, new_seq_ids, status of id 0)")
    expect_equal((second.num_decode_tokens, second.num_prefill_tokens), (1, 0),
                 inputs=f"{inputs}; (decode, prefill) of step 2")


# --- select_victim -----------------------------------------------------------------------------------------------


def victim_set(policy: str, specs: list[tuple[int, int, int]], waiting: list[tuple[int, int, int]] = ()):
    """A scheduler whose running list holds, in the order given (the order they started), sequences
    (seq_id, priority, arrival), and whose waiting queue holds `waiting`; with a description."""
    sched = make_scheduler(scheduler_module.Scheduler, policy=policy)
    for seq_id, priority, arrival in specs:
        sched.add_running(Sequence(seq_id, [1, 2, 3], priority=priority, arrival=arrival))
    for seq_id, priority, arrival in waiting:
        sched.add_seq(Sequence(seq_id, [1, 2, 3], priority=priority, arrival=arrival))
    inputs = (f"policy {policy.upper()}; running, in the order they started, as (seq_id, priority, arrival): {specs}"
              + (f"; waiting: {list(waiting)}" if waiting else ""))
    return sched, inputs


def call_select_victim(impl, sched, inputs) -> int | None:
    with exercising("select_victim", inputs):
        victim = impl.select_victim(sched)
    if not isinstance(victim, Sequence):
        raise AssertionError(f"on input {inputs}: expected a running Sequence, got {victim!r:.100}")
    return victim.seq_id


@pytest.mark.exercise("select_victim")
def test_select_victim_fcfs_takes_the_last_to_start_running(impl):
    sched, inputs = victim_set("fcfs", [(0, 0, 1), (1, 0, 2), (2, 0, 0)])
    expect_equal(call_select_victim(impl, sched, inputs), 2,
                 inputs=f"{inputs}; the victim's seq_id (id 2 arrived first but started running last, after a "
                 "preemption)")


@pytest.mark.exercise("select_victim")
def test_select_victim_priority_takes_the_largest_priority_value(impl):
    sched, inputs = victim_set("priority", [(0, 0, 0), (1, 5, 1), (2, 1, 2)])
    expect_equal(call_select_victim(impl, sched, inputs), 1,
                 inputs=f"{inputs}; the victim's seq_id (a smaller priority value is more important)")


@pytest.mark.exercise("select_victim")
def test_select_victim_priority_ties_go_to_the_latest_arrival(impl):
    sched, inputs = victim_set("priority", [(0, 0, 0), (2, 3, 2), (1, 3, 1)])
    expect_equal(call_select_victim(impl, sched, inputs), 2, inputs=f"{inputs}; the victim's seq_id")


@pytest.mark.exercise("select_victim")
def test_select_victim_priority_full_ties_go_to_the_larger_seq_id(impl):
    sched, inputs = victim_set("priority", [(4, 3, 1), (7, 3, 1), (2, 0, 0)])
    expect_equal(call_select_victim(impl, sched, inputs), 7,
                 inputs=f"{inputs}; the victim's seq_id (equal in priority and arrival: the larger seq_id, as the "
                 "question states)")


@pytest.mark.exercise("select_victim")
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_select_victim_is_a_running_sequence(impl, policy):
    sched, inputs = victim_set(policy, [(0, 0, 0), (1, 1, 1)], waiting=[(5, 9, 5)])
    expect_equal(call_select_victim(impl, sched, inputs), 1,
                 inputs=f"{inputs}; the victim's seq_id (the waiting id 5 holds no blocks to give back)")


# --- allocate_or_preempt -----------------------------------------------------------------------------------------


def prompt_seq(sched, seq_id: int, num_prompt: int, num_computed: int, priority: int = 0) -> Sequence:
    """A running sequence in the middle of its prompt: blocks for `num_computed` tokens, all of them computed."""
    seq = Sequence(seq_id, list(range(10, 10 + num_prompt)), priority=priority, arrival=seq_id)
    assert sched.kv_cache_manager.allocate_slots(seq, num_computed) is not None
    seq.num_computed_tokens = num_computed
    sched.add_running(seq)
    return seq


def call_allocate_or_preempt(impl, sched, seq, num_new_tokens, out, copies, inputs):
    with exercising("allocate_or_preempt", inputs):
        result = impl.allocate_or_preempt(sched, seq, num_new_tokens, out, copies)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise AssertionError(f"on input {inputs}: expected (copies or None, budget handed back), got {result!r:.100}")
    return result


@pytest.mark.exercise("allocate_or_preempt")
def test_allocate_or_preempt_allocates_when_blocks_are_free(impl):
    inputs = "FCFS, 8 blocks of 4, 4 free; running ids 0 and 1, 8 tokens computed each; id 0 needs 1 new token"
    sched = make_scheduler(scheduler_module.Scheduler, num_blocks=8)
    first = decoding_seq(sched, 0, 6, 3)
    decoding_seq(sched, 1, 6, 3)
    out = SchedulerOutput()
    got = call_allocate_or_preempt(impl, sched, first, 1, out, {}, inputs)
    expect_equal(got, ([], 0), inputs=f"{inputs}; (copies, budget handed back)")
    expect_equal(out.preempted_seq_ids, [], inputs=f"{inputs}; preempted_seq_ids")
    expect_equal((len(first.block_table), sched.kv_cache_manager.num_free_blocks), (3, 3),
                 inputs=f"{inputs}; (blocks of id 0, free blocks)")


@pytest.mark.exercise("allocate_or_preempt")
def test_allocate_or_preempt_fcfs_preempts_the_last_to_start(impl):
    inputs = ("FCFS, 6 blocks of 4, none free; running ids 0, 1, 2 (started in that order), 8 tokens computed and "
              "a 9th to compute each; room for id 0's 9th token")
    sched = make_scheduler(scheduler_module.Scheduler, num_blocks=6)
    seqs = [decoding_seq(sched, i, 6, 3) for i in range(3)]
    waiting_seq(sched, 3, 2)
    out = SchedulerOutput()
    got = call_allocate_or_preempt(impl, sched, seqs[0], 1, out, {}, inputs)
    expect_equal(got, ([], 0), inputs=f"{inputs}; (copies, budget handed back)")
    expect_equal(out.preempted_seq_ids, [2], inputs=f"{inputs}; preempted_seq_ids (the last to start running)")
    expect_equal([s.seq_id for s in sched.running], [0, 1], inputs=f"{inputs}; running")
    expect_equal([s.seq_id for s in sched.waiting], [2, 3], inputs=f"{inputs}; waiting (the victim at the front)")
    expect_equal((seqs[2].status, seqs[2].num_computed_tokens, seqs[2].block_table), (SequenceStatus.PREEMPTED, 0, []),
                 inputs=f"{inputs}; id 2's (status, num_computed_tokens, block_table)")
    expect_equal([len(s.block_table) for s in seqs[:2]], [3, 2], inputs=f"{inputs}; blocks of ids 0, 1")
    expect_equal(sched.kv_cache_manager.num_free_blocks, 1, inputs=f"{inputs}; free blocks")


@pytest.mark.exercise("allocate_or_preempt")
def test_allocate_or_preempt_preempts_until_there_is_room(impl):
    inputs = ("FCFS, 4 blocks of 4, none free; running: id 0 with 8 of its 16 prompt tokens computed (2 blocks), "
              "ids 1 and 2 decoding in 1 block each; room for id 0's next 8 tokens (2 more blocks)")
    sched = make_scheduler(scheduler_module.Scheduler, num_blocks=4)
    first = prompt_seq(sched, 0, 16, 8)
    decoding_seq(sched, 1, 3, 1)
    decoding_seq(sched, 2, 3, 1)
    out = SchedulerOutput()
    got = call_allocate_or_preempt(impl, sched, first, 8, out, {}, inputs)
    expect_equal(got, ([], 0), inputs=f"{inputs}; (copies, budget handed back)")
    expect_equal(out.preempted_seq_ids, [2, 1], inputs=f"{inputs}; preempted_seq_ids (newest first, as many as needed)")
    expect_equal([s.seq_id for s in sched.waiting], [1, 2], inputs=f"{inputs}; waiting")
    expect_equal(len(first.block_table), 4, inputs=f"{inputs}; blocks of id 0")


@pytest.mark.exercise("allocate_or_preempt")
def test_allocate_or_preempt_stops_when_the_victim_is_the_sequence_itself(impl):
    inputs = ("FCFS, 4 blocks of 4, none free; running: id 0 (7 tokens, 6 computed, already in the batch with 1 "
              "token), id 1 (9 tokens, 8 computed, needs a 3rd block); room for id 1's 9th token")
    sched = make_scheduler(scheduler_module.Scheduler, num_blocks=4)
    first = decoding_seq(sched, 0, 5, 2)
    second = decoding_seq(sched, 1, 6, 3)
    out, copies = SchedulerOutput(), {}
    sched._add_to_batch(out, first, 1, sched.kv_cache_manager.allocate_slots(first, 1), copies)
    got = call_allocate_or_preempt(impl, sched, second, 1, out, copies, inputs)
    expect_equal(got, (None, 0), inputs=f"{inputs}; (copies, budget handed back): None, id 1 was its own victim")
    expect_equal(batch(out), [(0, 1)], inputs=f"{inputs}; the batch (id 0 keeps its place)")
    expect_equal(out.preempted_seq_ids, [1], inputs=f"{inputs}; preempted_seq_ids")
    expect_equal(([s.seq_id for s in sched.running], [s.seq_id for s in sched.waiting]), ([0], [1]),
                 inputs=f"{inputs}; (running, waiting)")
    expect_equal((second.block_table, sched.kv_cache_manager.num_free_blocks), ([], 2),
                 inputs=f"{inputs}; (id 1's blocks, free blocks)")


@pytest.mark.exercise("allocate_or_preempt")
def test_allocate_or_preempt_takes_a_scheduled_victim_out_of_the_batch(impl):
    inputs = ("PRIORITY, 6 blocks of 4, none free; running: id 0 (priority 0, decoding, not yet scheduled), id 1 "
              "(priority 5, its prompt chunk of 4 tokens already in the batch), id 2 (priority 1, decoding); room "
              "for id 2's 9th token")
    sched = make_scheduler(scheduler_module.Scheduler, num_blocks=6, policy="priority")
    decoding_seq(sched, 0, 6, 3)
    chunked = prompt_seq(sched, 1, 12, 4, priority=5)
    third = decoding_seq(sched, 2, 6, 3)
    third.priority = 1
    out, copies = SchedulerOutput(), {}
    sched._add_to_batch(out, chunked, 4, sched.kv_cache_manager.allocate_slots(chunked, 4), copies)
    got = call_allocate_or_preempt(impl, sched, third, 1, out, copies, inputs)
    expect_equal(got, ([], 4), inputs=f"{inputs}; (copies, budget handed back: id 1's 4 tokens)")
    expect_equal(out.preempted_seq_ids, [1], inputs=f"{inputs}; preempted_seq_ids (the lowest priority: largest value)")
    expect_equal(batch(out), [], inputs=f"{inputs}; the batch (the victim taken out)")
    expect_equal((out.num_prefill_tokens, out.num_decode_tokens), (0, 0),
                 inputs=f"{inputs}; the batch's (prefill, decode) tokens")
    expect_equal(sched.kv_cache_manager.num_free_blocks, 1, inputs=f"{inputs}; free blocks")


@pytest.mark.exercise("allocate_or_preempt")
def test_allocate_or_preempt_priority_victim_ahead_of_the_sequence(impl):
    inputs = ("PRIORITY, 7 blocks of 4, none free; running in this order: id 0 (priority 0, decoding), id 1 "
              "(priority 5, its prompt chunk of 4 tokens already in the batch), id 2 (priority 1, decoding), id 3 "
              "(priority 3, decoding, not yet scheduled); room for id 2's 9th token")
    sched = make_scheduler(scheduler_module.Scheduler, num_blocks=7, policy="priority")
    decoding_seq(sched, 0, 6, 3)
    chunked = prompt_seq(sched, 1, 12, 4, priority=5)
    third = decoding_seq(sched, 2, 6, 3)
    fourth = decoding_seq(sched, 3, 3, 1)
    third.priority, fourth.priority = 1, 3
    out, copies = SchedulerOutput(), {}
    sched._add_to_batch(out, chunked, 4, sched.kv_cache_manager.allocate_slots(chunked, 4), copies)
    got = call_allocate_or_preempt(impl, sched, third, 1, out, copies, inputs)
    expect_equal(got, ([], 4), inputs=f"{inputs}; (copies, budget handed back: id 1's 4 tokens)")
    expect_equal(out.preempted_seq_ids, [1],
                 inputs=f"{inputs}; preempted_seq_ids (the lowest priority, although it sits before id 2 and id 3 "
                 "after it)")
    expect_equal(([s.seq_id for s in sched.running], [s.seq_id for s in sched.waiting]), ([0, 2, 3], [1]),
                 inputs=f"{inputs}; (running, waiting)")
    expect_equal((len(third.block_table), len(fourth.block_table), sched.kv_cache_manager.num_free_blocks), (3, 1, 1),
                 inputs=f"{inputs}; (blocks of id 2, blocks of id 3, free blocks)")


def cached_decoding_seq(sched, seq_id: int, prompt: list[int], outputs: list[int]) -> Sequence:
    """A running sequence whose prompt and outputs but the newest are computed, its leading full blocks taken
    from the prefix cache where they are there (shared, as a real admission would)."""
    seq = Sequence(seq_id, prompt)
    for token in outputs:
        seq.append_token(token)
    manager = sched.kv_cache_manager
    blocks, num_cached = manager.get_computed_blocks(seq)
    assert manager.allocate_slots(seq, seq.num_tokens - 1 - num_cached, blocks) is not None
    seq.num_computed_tokens = seq.num_tokens - 1
    sched.add_running(seq)
    return seq


@pytest.mark.exercise("allocate_or_preempt")
def test_allocate_or_preempt_with_prefix_caching_leaves_the_victims_blocks_cached(impl):
    inputs = ("FCFS, prefix caching on, 6 blocks of 4, none free; running: id 0 (9 tokens, 8 computed: blocks P0, "
              "P1), id 1 (9 tokens, 8 computed, its own 2 blocks), id 2 (13 tokens, 12 computed; shares P0 with id "
              "0 — the same first 4 tokens — and owns V1, V2); room for id 0's 9th token")
    sched = make_scheduler(scheduler_module.Scheduler, num_blocks=6, prefix_caching=True)
    first = cached_decoding_seq(sched, 0, list(range(10, 16)), [200, 201, 202])
    cached_decoding_seq(sched, 1, list(range(40, 46)), [200, 201, 202])
    victim = cached_decoding_seq(sched, 2, [10, 11, 12, 13] + list(range(60, 68)), [68])
    pool = sched.kv_cache_manager.block_pool
    shared, own_first, own_second = (pool.blocks[b] for b in victim.block_table)
    assert shared.block_id == first.block_table[0] and shared.ref_cnt == 2, "the test expected P0 to be shared"
    out = SchedulerOutput()
    got = call_allocate_or_preempt(impl, sched, first, 1, out, {}, inputs)
    expect_equal(got, ([], 0), inputs=f"{inputs}; (copies, budget handed back)")
    expect_equal(out.preempted_seq_ids, [2], inputs=f"{inputs}; preempted_seq_ids (the last to start running)")
    expect_equal((victim.status, victim.num_computed_tokens, victim.block_table), (SequenceStatus.PREEMPTED, 0, []),
                 inputs=f"{inputs}; id 2's (status, num_computed_tokens, block_table) — cached blocks or not, "
                 "a preempted sequence holds none and has computed nothing")
    # Freed tail first (V2, V1): id 0's new block is V2, the head of the free queue; V1 stays free *and* cached.
    expect_equal((shared.ref_cnt, own_first.ref_cnt, own_second.ref_cnt), (1, 0, 1),
                 inputs=f"{inputs}; ref_cnt of (P0, V1, V2): P0 still id 0's, V1 freed, V2 reused for id 0")
    expect_equal((sched.kv_cache_manager.num_free_blocks, first.block_table[-1]), (1, own_second.block_id),
                 inputs=f"{inputs}; (free blocks, id 0's new block)")
    expect_equal(own_first.block_hash is not None, True,
                 inputs=f"{inputs}; V1 still cached (its hash kept: its K/V were computed), evictable")
    blocks, num_cached = sched.kv_cache_manager.get_computed_blocks(victim)
    expect_equal(([b.block_id for b in blocks], num_cached), ([shared.block_id, own_first.block_id], 8),
                 inputs=f"{inputs}; what id 2's re-admission finds in the prefix cache (P0 and V1: 8 tokens)")


def run_preemptions(impl, monkeypatch, inputs: str, prompts: list[list[int]], priority: list[int] | None,
                    **engine_args) -> None:
    """Greedy requests of 16 tokens on the tiny llama-gqa, 12 blocks of 4 (preemptions), stepped by the engine
    with your `allocate_or_preempt`; each must equal Hugging Face's, and every block be free at the end."""
    monkeypatch.setattr(scheduler_module, "allocate_or_preempt", impl.allocate_or_preempt)  # the engine's scheduler
    folder = tiny_checkpoint("llama-gqa")
    engine, core = engine_and_core(folder, block_size=4, num_kv_blocks=12, max_num_seqs=4, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, priority=0 if priority is None else priority[i])
    got, _ = run_core(core_module.engine_step, core, limit=300,
                      likely="a preemption that leaves blocks held: nobody can be admitted again")
    scheduler, manager = core.scheduler, core.scheduler.kv_cache_manager
    assert scheduler.num_preemptions > 0, f"{inputs}: the test expected preemptions"
    for i, prompt in enumerate(prompts):
        expect_equal(got.get(f"r{i}"), [hf_greedy(folder, tuple(prompt), 16)], inputs=f"{inputs}; prompt {prompt}")
    expect_equal((manager.num_used_blocks, manager.num_free_blocks), (0, 12),
                 inputs=f"{inputs}; (blocks in use, free blocks) at the end — cached blocks are free, not leaked")


@pytest.mark.exercise("allocate_or_preempt")
@pytest.mark.parametrize("policy, priority", [("fcfs", None), ("priority", [2, 0, 1, 0])], ids=["fcfs", "priority"])
def test_preempted_sequences_resume_with_hugging_faces_tokens(impl, monkeypatch, policy, priority):
    inputs = (f"tiny llama-gqa, policy {policy} (priorities {priority}), 4 prompts of 8-14 tokens, 16 new tokens "
              "each, 12 blocks of 4 (preemptions)")
    prompts = [list(range(30 + i, 38 + 2 * i)) for i in range(4)]
    run_preemptions(impl, monkeypatch, inputs, prompts, priority, scheduling_policy=policy)


@pytest.mark.exercise("allocate_or_preempt")
def test_preempted_sequences_sharing_a_cached_prefix_resume_with_hugging_faces_tokens(impl, monkeypatch):
    inputs = ("tiny llama-gqa, prefix caching on, policy priority (priorities 3, 0, 1, 0: the first to start is the "
              "first victim), 4 prompts sharing their first 8 tokens, 16 new tokens each, 12 blocks of 4")
    prompts = [list(range(30, 38)) + list(range(50 + 5 * i, 52 + 6 * i)) for i in range(4)]
    run_preemptions(impl, monkeypatch, inputs, prompts, [3, 0, 1, 0], scheduling_policy="priority",
                    enable_prefix_caching=True)


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


MIXED = ("a mixed step, block_size 4: A decodes position 5 (table [3, 1]), B prefills positions 4-7 (table [0, 2, 5]), "
         "C positions 0-2 (table [6])")


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
def test_prepare_inputs_starts_where_the_scheduler_output_says(impl):
    step = mixed_step()
    scheduler_module.advance_computed_tokens(step)  # as `schedule()` leaves them: already past this step's tokens
    input_ids, positions, metadata = impl.prepare_inputs(step, 4)
    inputs = (f"{MIXED}, with the sequences already advanced by the scheduler (read the starts from "
              "scheduler_output.num_computed_tokens)")
    expect_equal(positions.tolist(), [5, 4, 5, 6, 7, 0, 1, 2], inputs=f"{inputs}; positions")
    expect_equal(input_ids.tolist(), [16, 24, 25, 26, 27, 40, 41, 42], inputs=f"{inputs}; input_ids")
    expect_equal(metadata.slot_mapping.tolist(), [5, 8, 9, 10, 11, 24, 25, 26], inputs=f"{inputs}; slot_mapping")


@pytest.mark.exercise("prepare_inputs")
def test_prepare_inputs_changes_no_sequence(impl):
    step = mixed_step()
    impl.prepare_inputs(step, 4)
    state = [(s.num_computed_tokens, s.num_tokens, list(s.block_table)) for s in step.scheduled_seqs]
    expect_equal(state, [(5, 6, [3, 1]), (4, 10, [0, 2, 5]), (0, 3, [6])],
                 inputs=f"{MIXED}; (num_computed_tokens, num_tokens, block_table) afterwards — the scheduler "
                 "advances them, not prepare_inputs")


# --- sampling_rows -----------------------------------------------------------------------------------------------


def advanced(out: SchedulerOutput) -> SchedulerOutput:
    """`out` as `schedule()` returns it: every scheduled sequence already advanced past this step's tokens."""
    scheduler_module.advance_computed_tokens(out)
    return out


def call_sampling_rows(impl, out: SchedulerOutput, inputs: str) -> tuple[list[int], list[int]]:
    """(rows, the seq_id of each sampling sequence) from `impl.sampling_rows(out)`."""
    with exercising("sampling_rows", inputs):
        result = impl.sampling_rows(out)
    if not (isinstance(result, tuple) and len(result) == 2 and len(result[0]) == len(result[1])):
        raise AssertionError(
            f"on input {inputs}: expected (rows, seqs), two lists of equal length, got {result!r:.100}")
    rows, seqs = result
    if not all(type(row) is int for row in rows):
        raise AssertionError(f"on input {inputs}: expected rows as ints (indices into the logits), got {rows!r:.100}")
    return list(rows), [seq.seq_id for seq in seqs]


@pytest.mark.exercise("sampling_rows")
def test_sampling_rows_skips_a_prompt_chunk_that_is_not_the_last(impl):
    inputs = f"{MIXED}, as schedule() leaves them (A and C are complete after the step, B has 2 prompt tokens left)"
    rows, seq_ids = call_sampling_rows(impl, advanced(mixed_step()), inputs)
    expect_equal((rows, seq_ids), ([0, 2], [0, 2]),
                 inputs=f"{inputs}; (rows, seq_ids): each sampling sequence keeps its own row, B samples nothing")


@pytest.mark.exercise("sampling_rows")
def test_sampling_rows_forked_samples_share_their_parents_row(impl):
    x = Sequence(0, [1, 2, 3])
    x.append_token(4)
    x.num_computed_tokens = 3
    p = Sequence(1, list(range(20, 27)))
    p.num_computed_tokens = 4
    q = Sequence(2, list(range(30, 39)))
    out = advanced(SchedulerOutput(scheduled_seqs=[x, p, q], num_scheduled_tokens=[1, 3, 4]))
    out.forked_seqs = {1: [p.fork(10), p.fork(11)]}
    inputs = ("X (id 0) decodes; P (id 1) computes the last 3 tokens of its 7-token prompt and forks ids 10 and 11 "
              "(n=3); Q (id 2) computes the first 4 tokens of its 9")
    rows, seq_ids = call_sampling_rows(impl, out, inputs)
    expect_equal(rows, [0, 1, 1, 1], inputs=f"{inputs}; rows, in batch order (P's row once for each of its 3 samples)")
    expect_equal(sorted(zip(rows, seq_ids)), [(0, 0), (1, 1), (1, 10), (1, 11)],
                 inputs=f"{inputs}; (row, seq_id) pairs")


@pytest.mark.exercise("sampling_rows")
def test_sampling_rows_waits_for_the_end_of_a_recompute(impl):
    seqs = []
    for seq_id in (0, 1):
        seq = Sequence(seq_id, list(range(10, 16)))  # 6 prompt tokens
        for token in (200, 201, 202):
            seq.append_token(token)
        seqs.append(seq)
    seqs[1].num_computed_tokens = 7
    out = advanced(SchedulerOutput(scheduled_seqs=seqs, num_scheduled_tokens=[7, 2]))
    inputs = ("two preempted sequences of 6 prompt + 3 output tokens, recomputed in chunks: id 0 computes tokens "
              "0-6 (its prompt and 1 output; 2 left), id 1 tokens 7-8 (the last)")
    rows, seq_ids = call_sampling_rows(impl, out, inputs)
    expect_equal((rows, seq_ids), ([1], [1]),
                 inputs=f"{inputs}; (rows, seq_ids): a sequence samples once ALL its tokens are computed, not its "
                 "prompt")


@pytest.mark.exercise("sampling_rows")
def test_sampling_rows_of_a_step_of_prompt_chunks_is_empty(impl):
    a, b = Sequence(0, list(range(10, 22))), Sequence(1, list(range(40, 45)))
    b.num_computed_tokens = 1
    out = advanced(SchedulerOutput(scheduled_seqs=[a, b], num_scheduled_tokens=[8, 2]))
    inputs = "two prompt chunks: id 0 tokens 0-7 of 12, id 1 tokens 1-2 of 5"
    expect_equal(call_sampling_rows(impl, out, inputs), ([], []), inputs=f"{inputs}; (rows, seq_ids)")
    expect_equal(call_sampling_rows(impl, SchedulerOutput(), "an empty step"), ([], []), inputs="an empty step")


@pytest.mark.exercise("sampling_rows")
@pytest.mark.timeout(120)
def test_sampling_rows_in_the_engine_gives_every_sample_its_tokens(impl):
    folder = tiny_checkpoint("llama-gqa")
    seeded = list(range(70, 83))
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    alone = LLM(model=str(folder), block_size=4).generate([seeded], sampled, use_tqdm=False)[0].outputs[0].token_ids
    forked = list(range(60, 71))
    engine, core = engine_and_core(folder, block_size=4, max_num_batched_tokens=8, long_prefill_token_threshold=4)
    engine.add_request("forked", forked, SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.add_request("seeded", seeded, sampled)
    engine.add_request("short", [5, 6], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    with swap_in(impl, {"sampling_rows": REFERENCE["sampling_rows"]}):  # the runner and the scheduler use yours
        got, _ = run_core(core_module.engine_step, core)
    inputs = ("tiny llama-gqa, budget 8, long_prefill_token_threshold 4 (prompts in chunks), your sampling_rows in "
              "the engine: an 11-token prompt with n=3 (greedy), a 13-token prompt sampled with seed 7 (temperature "
              "1, top_p 0.9), a 2-token prompt (greedy)")
    expect_equal(got.get("forked"), [hf_greedy(folder, tuple(forked), 6)] * 3,
                 inputs=f"{inputs}; the 3 samples of 'forked'")
    expect_equal(got.get("seeded"), [alone], inputs=f"{inputs}; 'seeded' (oracle: the reference engine, the request "
                 "alone and unchunked) — a chunk must not use up the request's random numbers")
    expect_equal(got.get("short"), [hf_greedy(folder, (5, 6), 6)], inputs=f"{inputs}; 'short'")


# --- engine_step -------------------------------------------------------------------------------------------------


@functools.cache
def hf_greedy(folder, prompt: tuple[int, ...], n: int, repetition_penalty: float = 1.0) -> list[int]:
    with torch.inference_mode():
        out = hf_oracle(folder).generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                         repetition_penalty=repetition_penalty)
    return out[0, len(prompt):].tolist()


@functools.cache
def hf_oracle(folder):
    return hf_model(folder)


def engine_and_core(folder, **engine_args) -> tuple[LLMEngine, core_module.EngineCore]:
    """An `LLM`'s front end (to add requests: validated and tokenised by its processor) and its in-process client
    (`llm.llm_engine.engine_core`), which lends the tests its core's scheduler and executor to step."""
    engine = LLM(model=str(folder), **engine_args).llm_engine
    return engine, engine.engine_core


def run_core(step, core, limit: int = 300, likely: str = "") -> tuple[dict[str, list[list[int]]], list[SchedulerStats]]:
    """Call `step(core)` until the core has no unfinished request: request id -> the token ids of each of its
    samples (by index), and each step's `SchedulerStats`. `likely`: what usually keeps requests from finishing."""
    tokens: dict[str, dict[int, list[int]]] = {}
    stats = []
    for _ in range(limit):
        if not core.has_unfinished_requests():
            return {r: [samples[i] for i in sorted(samples)] for r, samples in tokens.items()}, stats
        outputs = step(core)
        if not isinstance(outputs, EngineCoreOutputs):
            raise AssertionError(
                f"a step must return the EngineCoreOutputs of update_from_output, got {outputs!r:.100}")
        for output in outputs.outputs:  # one per sample that got tokens (or its cached-token count) this step
            tokens.setdefault(output.request_id, {}).setdefault(output.index, []).extend(output.new_token_ids)
        stats.append(outputs.scheduler_stats)
    raise AssertionError(f"the engine core still had unfinished requests after {limit} steps"
                         + (f".\n  Likely cause: {likely}" if likely else ""))


def drive(impl, core, limit: int = 300) -> tuple[dict[str, list[list[int]]], list[SchedulerStats]]:
    """`run_core` with your `engine_step`, swapped in for the reference while it runs (so the core's own `step()`
    is yours too)."""
    with swap_in(impl, {"engine_step": REFERENCE["engine_step"]}) as mine:
        return run_core(mine.engine_step, core, limit)


@pytest.mark.exercise("engine_step")
@pytest.mark.parametrize("threshold", [4, 64], ids=["chunked", "whole-prompts"])
def test_engine_step_produces_hugging_faces_greedy_tokens(impl, threshold):
    folder = tiny_checkpoint("llama-gqa")
    engine, core = engine_and_core(folder, block_size=4, max_num_batched_tokens=12,
                                   long_prefill_token_threshold=threshold)
    prompts = [list(range(50, 60)), [7, 8, 9], list(range(90, 97)), [3]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    got, _ = drive(impl, core)
    inputs = (f"tiny llama-gqa, block_size 4, budget 12, long_prefill_token_threshold {threshold}, prompts of 10, 3, "
              "7, 1 tokens, 10 new tokens each")
    for i, prompt in enumerate(prompts):
        expect_equal(got.get(f"r{i}"), [hf_greedy(folder, tuple(prompt), 10)], inputs=f"{inputs}; request r{i}")
    expect_equal(core.scheduler.kv_cache_manager.num_used_blocks, 0, inputs=f"{inputs}; blocks in use at the end")


@pytest.mark.exercise("engine_step")
def test_engine_step_gives_every_sample_of_n_its_tokens(impl):
    folder = tiny_checkpoint("llama-gqa")
    engine, core = engine_and_core(folder, block_size=4, max_num_batched_tokens=8)
    prompt = list(range(60, 71))
    engine.add_request("r0", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.add_request("r1", [5, 6], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    got, _ = drive(impl, core)
    inputs = "tiny llama-gqa, budget 8: an 11-token prompt with n=3 (greedy) beside a 2-token prompt, 6 new tokens each"
    expect_equal(got.get("r0"), [hf_greedy(folder, tuple(prompt), 6)] * 3, inputs=f"{inputs}; the 3 samples of r0")
    expect_equal(got.get("r1"), [hf_greedy(folder, (5, 6), 6)], inputs=f"{inputs}; r1")


@pytest.mark.exercise("Scheduler")
def test_schedule_in_the_engine_gives_every_sample_of_n_hugging_faces_tokens(impl):
    folder = tiny_checkpoint("llama-gqa")
    inputs = "tiny llama-gqa, block_size 4, budget 8: a 10-token prompt with n=3 (greedy), 6 new tokens; your Scheduler"
    with swap_in(impl, {"Scheduler": REFERENCE["Scheduler"]}):
        engine, core = engine_and_core(folder, block_size=4, max_num_batched_tokens=8)
        params = SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True)
        engine.add_request("r0", list(range(60, 70)), params)
        got, _ = run_core(core_module.engine_step, core)
    expect_equal(got.get("r0"), [hf_greedy(folder, tuple(range(60, 70)), 6)] * 3, inputs=f"{inputs}; the 3 samples")


@pytest.mark.exercise("engine_step")
def test_engine_step_reports_each_steps_stats(impl):
    folder = tiny_checkpoint("llama-gqa")
    engine, core = engine_and_core(folder, block_size=4, max_num_batched_tokens=6)
    engine.add_request("r0", list(range(40, 50)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    _, stats = drive(impl, core)
    inputs = "tiny llama-gqa, budget 6, a 10-token prompt, 3 new tokens"
    if not all(isinstance(s, SchedulerStats) for s in stats):
        raise AssertionError(f"on input {inputs}: each step's EngineCoreOutputs must carry its SchedulerStats "
                             f"(update_from_output makes them), got {stats!r:.120}")
    steps = [(s.num_prefill_tokens, s.num_decode_tokens) for s in stats]
    expect_equal(steps, [(6, 0), (4, 0), (0, 1), (0, 1)], inputs=f"{inputs}; (prefill, decode) tokens of each step")
    expect_equal([set(s.seconds) >= {"schedule", "forward", "sample"} for s in stats], [True] * 4,
                 inputs=f"{inputs}; each step's stats time its schedule, forward and sample stages")


@pytest.mark.exercise("engine_step")
def test_engine_step_draws_nothing_for_a_prompt_chunk(impl):
    folder = tiny_checkpoint("llama-gqa")
    prompt = list(range(70, 83))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    alone = LLM(model=str(folder), block_size=4).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    engine, core = engine_and_core(folder, block_size=4, max_num_batched_tokens=8, long_prefill_token_threshold=4)
    engine.add_request("sampled", prompt, params)
    engine.add_request("greedy", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    got, _ = drive(impl, core)
    inputs = ("tiny llama-gqa, budget 8, long_prefill_token_threshold 4: a 13-token prompt sampled with seed 7 "
              "(temperature 1, top_p 0.9; prefilled in 4 chunks) beside a greedy request")
    expect_equal(got.get("sampled"), [alone], inputs=f"{inputs}; the seeded request's tokens (the reference engine, "
                 "same request alone and unchunked) — a chunk must not use up the request's random numbers")


CHOICES = ["London", "Berlin"]  # both wrong: unconstrained, SmolLM2 answers "The capital of France is Paris."


@pytest.mark.exercise("engine_step")
@pytest.mark.timeout(180)  # a real model: a few seconds on an idle machine
def test_engine_step_samples_a_constrained_request_within_its_grammar(impl):
    engine = LLMEngine.from_engine_args(EngineArgs(model="smollm2-135m", block_size=16, num_kv_blocks=32,
                                                   max_model_len=256))
    core = engine.engine_core  # the in-process client: its core's scheduler and executor
    constrained = SamplingParams(temperature=0.0, max_tokens=8,
                                 structured_outputs=StructuredOutputsParams(choice=CHOICES))
    engine.add_request("choice", CAPSTONE_PROMPTS[0], constrained)
    engine.add_request("free", CAPSTONE_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    inputs = (f"SmolLM2-135M, CAPSTONE_PROMPTS[0] (\"What is the capital of France?\") twice, greedy: once with "
              f"structured_outputs choice={CHOICES}, once free, 8 tokens")
    with exercising("engine_step", inputs):
        got, _ = drive(impl, core)
    text = engine.tokenizer.decode(got.get("choice", [[]])[0])
    expect_equal(text in CHOICES, True, inputs=f"{inputs}; the constrained request's text {text!r} is one of the "
                 "choices (the step must sample within the masks of get_grammar_bitmask)")
    expect_equal(got.get("free"), [smollm2_greedy(0, 8)], inputs=f"{inputs}; the free request (oracle: Hugging Face)")


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
    expect_filtered(got, logits, oracle_top_p(logits, p),
                    f"random logits (5, 12) seed {seed}, top_p {[round(x, 3) for x in p]}")


@pytest.mark.exercise("apply_top_p")
def test_top_p_one_keeps_everything(impl):
    logits = random_rows(5, rows=2)
    got = impl.apply_top_p(logits.clone(), torch.tensor([1.0, 1.0]))
    expect_filtered(got, logits, [[True] * 12] * 2, "random logits (2, 12), top_p 1.0")


@pytest.mark.exercise("apply_top_p")
def test_top_p_one_keeps_everything_on_smollm2s_vocabulary(impl):
    logits = 8 * torch.randn(3, 49152, generator=torch.Generator().manual_seed(11))
    got = impl.apply_top_p(logits.clone(), torch.tensor([1.0, 1.0, 1.0]))
    dropped = (~got.isfinite()).sum(dim=-1).tolist()
    inputs = "logits 8 * randn(3, 49152) (SmolLM2's vocabulary), top_p 1.0; tokens dropped per row"
    expect_equal(dropped, [0, 0, 0], inputs=inputs)


@pytest.mark.exercise("apply_top_p")
def test_top_p_tiny_keeps_exactly_the_most_likely_token(impl):
    logits = random_rows(3, rows=4, vocab=50)
    got = impl.apply_top_p(logits.clone(), torch.full((4,), 1e-8))
    kept = (torch.arange(50)[None, :] == logits.argmax(-1, keepdim=True)).tolist()  # (B, V) only the argmax
    expect_filtered(got, logits, kept, "random logits (4, 50) seed 3, top_p 1e-8 (the nucleus is never empty)")


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


# --- apply_penalties ---------------------------------------------------------------------------------------------


def padded(rows: list[list[int]], vocab_size: int) -> torch.Tensor:
    """Token id lists as one (B, L) int64 tensor, padded with `vocab_size` (the id no token has)."""
    width = max(map(len, rows))
    return torch.tensor([row + [vocab_size] * (width - len(row)) for row in rows], dtype=torch.long)


def call_apply_penalties(impl, logits, prompts, outputs, presence, frequency, repetition, inputs) -> torch.Tensor:
    vocab_size = logits.shape[1]
    before = logits.clone()
    with exercising("apply_penalties", inputs):
        got = impl.apply_penalties(logits, padded(prompts, vocab_size), padded(outputs, vocab_size),
                                   torch.tensor(presence), torch.tensor(frequency), torch.tensor(repetition))
    expect_equal(torch.equal(logits, before), True, inputs=f"{inputs}; the logits passed in are left unchanged")
    return got


def hf_repetition(logits: torch.Tensor, prompts, outputs, repetition) -> torch.Tensor:
    """Hugging Face's processor, one row at a time (it takes one penalty), over the row's prompt and output."""
    rows = [RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits[b:b + 1].clone())
            for b, (prompt, output, penalty) in enumerate(zip(prompts, outputs, repetition, strict=True))]
    return torch.cat(rows)


def openai_penalties(logits: torch.Tensor, outputs, presence, frequency) -> torch.Tensor:
    """OpenAI's formula, token by token: mu[j] - c[j] * frequency - (c[j] > 0) * presence, c[j] counted over the
    *generated* tokens only."""
    want = logits.clone()
    for b, output in enumerate(outputs):
        for token in set(output):
            want[b, token] -= output.count(token) * frequency[b] + presence[b]
    return want


@pytest.mark.exercise("apply_penalties")
def test_apply_penalties_repetition_matches_hugging_face(impl):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=gen) * 3  # about half the logits negative
    logits[:, 5] = torch.tensor([-2.5, 2.5, 0.0])  # token 5 is seen by every row: negative, positive, zero
    prompts, outputs = [[5, 7, 9, 9], [5, 1], [3, 5, 20]], [[11, 7, 7], [], [5, 30, 31, 30]]
    repetition = [1.5, 0.7, 1.3]
    inputs = (f"logits (3, 40) with negative ones; prompts {prompts}, outputs {outputs} (padded with 40); "
              f"repetition_penalty {repetition}, presence and frequency 0")
    got = call_apply_penalties(impl, logits, prompts, outputs, [0.0] * 3, [0.0] * 3, repetition, inputs)
    expect_close(got, hf_repetition(logits, prompts, outputs, repetition), atol=1e-6, rtol=1e-6,
                 inputs=f"{inputs} (oracle: Hugging Face's RepetitionPenaltyLogitsProcessor)")


@pytest.mark.exercise("apply_penalties")
def test_apply_penalties_presence_and_frequency_follow_openais_formula(impl):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 32, generator=gen) * 3
    prompts, outputs = [[4, 4, 8, 9], [2, 3], [1]], [[9, 12, 12, 12], [2, 2, 30], []]
    presence, frequency = [0.5, -0.4, 0.7], [0.3, 0.25, 0.9]
    inputs = (f"logits (3, 32); prompts {prompts}, outputs {outputs} (padded with 32); presence_penalty {presence}, "
              f"frequency_penalty {frequency}, repetition 1")
    got = call_apply_penalties(impl, logits, prompts, outputs, presence, frequency, [1.0] * 3, inputs)
    expect_close(got, openai_penalties(logits, outputs, presence, frequency), atol=1e-5, rtol=1e-6,
                 inputs=f"{inputs} (oracle: OpenAI's formula over the generated tokens; prompt tokens untouched)")


@pytest.mark.exercise("apply_penalties")
def test_apply_penalties_all_three_on_smollm2s_vocabulary(impl):
    vocab_size = 49152  # SmolLM2's; the padding id 49152 is one past its last token
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, vocab_size, generator=gen) * 4
    prompts = [[1, 504, 3575, 49151, 504], [2, 2, 2], [17, 18]]
    outputs = [[504, 282, 282, 49151], [7042, 30, 2, 30], [19]]
    presence, frequency, repetition = [0.4, 0.0, 0.0], [0.6, 0.2, 0.0], [1.2, 1.1, 1.0]
    inputs = (f"logits (3, {vocab_size}); prompts {prompts}, outputs {outputs} (padded with {vocab_size}); "
              f"presence {presence}, frequency {frequency}, repetition {repetition} (row 2: all neutral)")
    got = call_apply_penalties(impl, logits, prompts, outputs, presence, frequency, repetition, inputs)
    want = openai_penalties(hf_repetition(logits, prompts, outputs, repetition), outputs, presence, frequency)
    expect_close(got, want, atol=1e-5, rtol=1e-6,
                 inputs=f"{inputs} (oracle: Hugging Face's repetition penalty, then OpenAI's formula)")
    expect_equal(torch.equal(got[2], logits[2]), True, inputs=f"{inputs}; row 2 (neutral penalties) bit for bit")


@pytest.mark.exercise("apply_penalties")
def test_apply_penalties_in_the_engine_give_hugging_faces_tokens(impl):
    folder = tiny_checkpoint("llama-gqa")
    prompts = [list(range(30, 38)), [5, 9, 5, 9, 5, 9], list(range(70, 82))]
    penalties = [1.8, 1.0, 0.7]
    inputs = (f"tiny llama-gqa, greedy, 16 new tokens, one batch of prompts {prompts} with repetition_penalty "
              f"{penalties} (the engine pads each row's prompt and output tokens)")
    with swap_in(impl, {"apply_penalties": REFERENCE["apply_penalties"]}):
        llm = LLM(model=str(folder), block_size=4)
        params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=r)
                  for r in penalties]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, penalty, output in zip(prompts, penalties, outputs, strict=True):
        want = hf_greedy(folder, tuple(prompt), 16, penalty)
        assert penalty == 1.0 or want != hf_greedy(folder, tuple(prompt), 16), (
            f"{inputs}: the test expected penalty {penalty} to change the tokens of prompt {prompt}")
        expect_equal(output.outputs[0].token_ids, want,
                     inputs=f"{inputs}; prompt {prompt}, penalty {penalty} (oracle: Hugging Face generate)")


# --- the exercises the scheduler's step runs, against the reference on generated workloads ---------------------------

SCHEDULED = ("Scheduler", "select_victim", "allocate_or_preempt")


test_each_exercise_the_scheduler_runs_leaves_the_references_state_on_generated_workloads = differential_test(
    REFERENCE, SCHEDULED, lambda _: scheduler_workloads()
)


# --- capstone: all of it together, on SmolLM2 ---------------------------------------------------------------------

# Two waves: two less important requests (priority 2) start first; three more important ones (priority 0) arrive
# two steps later. 14 blocks of 8 slots cannot hold them all: preemptions (the first victims are the priority-2
# requests, already in the step's batch; the sampled request is preempted too), prompts chunked by a 32-token
# budget and a 16-token threshold, resumed requests finding their blocks in the prefix cache, and the chat prompts
# sharing their system prompt's blocks.
CAPSTONE_ENGINE = dict(block_size=8, num_kv_blocks=14, max_num_seqs=8, max_num_batched_tokens=32,
                       long_prefill_token_threshold=16, max_model_len=256, enable_prefix_caching=True,
                       scheduling_policy="priority")
CAPSTONE_WAVES = [[(0, 2), (7, 2)], [(2, 0), (4, 0), (3, 0)]]  # (index into CAPSTONE_PROMPTS, priority)
CAPSTONE_SAMPLED = 3  # this prompt is sampled; the others are greedy
CAPSTONE_TOKENS = 12
SAMPLED = SamplingParams(temperature=0.8, top_p=0.8, min_p=0.1, seed=5, max_tokens=CAPSTONE_TOKENS, ignore_eos=True,
                         repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=CAPSTONE_TOKENS, ignore_eos=True)


def capstone_engine(**overrides) -> LLMEngine:
    """A front end and engine core on SmolLM2 (its converted weights load in well under a second). Built inside
    `swap_in`, its core runs your Scheduler and the rest."""
    return LLMEngine.from_engine_args(EngineArgs(model="smollm2-135m", **(CAPSTONE_ENGINE | overrides)))


def record_schedules(core) -> list[tuple[list[tuple[int, int, int, int]], list[int]]]:
    """Have `core`'s scheduler record each step: (seq_id, tokens, computed before, total) per scheduled
    sequence, and the resumed ids."""
    steps, schedule = [], core.scheduler.schedule

    def recording():
        out = schedule()
        scheduled = zip(out.scheduled_seqs, out.num_scheduled_tokens, out.num_computed_tokens, strict=True)
        steps.append(([(s.seq_id, n, start, s.num_tokens) for s, n, start in scheduled], list(out.resumed_seq_ids)))
        return out

    core.scheduler.schedule = recording
    return steps


@pytest.mark.exercise("capstone")
@pytest.mark.timeout(180)  # a real model: a few seconds on an idle machine
def test_capstone_a_preemption_storm_on_smollm2_gives_hugging_faces_tokens(impl):
    # The sampled request's oracle: the reference engine, the request alone, before any of your code is swapped in.
    reference = capstone_engine(num_kv_blocks=12, max_num_batched_tokens=64, long_prefill_token_threshold=64)
    reference.add_request("alone", CAPSTONE_PROMPTS[CAPSTONE_SAMPLED], SAMPLED)
    alone: list[int] = []
    while reference.has_unfinished_requests():
        for output in reference.step():  # the reference engine_step: nothing is swapped in yet
            alone += output.outputs[0].token_ids
    inputs = (f"SmolLM2-135M, {CAPSTONE_ENGINE}; prompts {[i for wave in CAPSTONE_WAVES for i, _ in wave]} of "
              f"CAPSTONE_PROMPTS in two waves, {CAPSTONE_TOKENS} new tokens each; prompt {CAPSTONE_SAMPLED} sampled "
              f"(temperature 0.8, top_p 0.8, min_p 0.1, seed 5, repetition 1.3, presence 0.5, frequency 0.5)")
    # Your Scheduler, allocate_or_preempt, prepare_inputs, sampling_rows (in the runner and the scheduler), filters,
    # penalties and engine_step: the engine is built inside, so its core is made of them.
    with swap_in(impl, REFERENCE) as mine:
        engine = capstone_engine()
        core = engine.engine_core  # the in-process client: its core's scheduler and executor
        steps = record_schedules(core)
        tokens: dict[int, list[int]] = {}
        for wave in CAPSTONE_WAVES:
            for i, priority in wave:
                params = SAMPLED if i == CAPSTONE_SAMPLED else GREEDY
                engine.add_request(f"p{i}", CAPSTONE_PROMPTS[i], params, priority)  # the front end's processor
            for _ in range(2 if wave is CAPSTONE_WAVES[0] else 400):
                if not core.has_unfinished_requests():
                    break
                for output in mine.engine_step(core).outputs:
                    tokens.setdefault(int(output.request_id[1:]), []).extend(output.new_token_ids)
        preemptions = core.scheduler.num_preemptions
        used = core.scheduler.kv_cache_manager.num_used_blocks
    chunks = [entry for batch_, _ in steps for entry in batch_ if entry[2] + entry[1] < entry[3]]
    resumed = [seq_id for _, ids in steps for seq_id in ids]
    assert preemptions > 0, f"{inputs}: the capstone expects preemptions; your scheduler made none"
    assert chunks, f"{inputs}: the capstone expects chunked prefill (a prompt over several steps); none happened"
    assert resumed, f"{inputs}: the capstone expects preempted requests to resume; none did"
    for wave in CAPSTONE_WAVES:
        for i, _ in wave:
            want = alone if i == CAPSTONE_SAMPLED else smollm2_greedy(i, CAPSTONE_TOKENS)
            oracle = "the reference engine alone, same seed" if i == CAPSTONE_SAMPLED else "Hugging Face greedy"
            expect_equal(tokens.get(i), want, inputs=f"{inputs}; prompt {i} (oracle: {oracle})")
    expect_equal(used, 0, inputs=f"{inputs}; blocks in use at the end")

"""Grading tests for chapter 12 — data parallelism: several replicas, one block manager.

Each test grades one exercise (`@pytest.mark.exercise`), called as the engine calls it. The oracles owe nothing to
the code under test: the replica the `prefix` policy picks, worked out by hand from each replica's load score
(vLLM's, `vllm/v1/engine/core_client.py` at commit 00080ee, read 2026-12-03: running + waiting, each waiting
sequence weighing 6 x (KV cache usage - 0.5) more once its pool is more than half full), its cached blocks, the
load cap and the near-tie margin; the cached blocks per pool counted
by hand from what each hand-built pool was made to hold (the free queues' order, the reference counts and the
prefix-cache counters read before and after); what a dead replica hands back, in which order and in which state,
worked out by hand from the queues it had, then every request run to its end on the other replica. The capstone
holds SmolLM2's greedy tokens on two replicas, one of them killed mid-run, to Hugging Face's, with the prefix hits
the reference engine gets and no block held at the end. Beyond the hand-made states, each exercise runs where the
engine runs it on generated workloads (arrivals, forks, aborts, a replica's death), and the state after each step
must be the reference's (`grading/differential.py`).
"""

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import strategies as st

from grading import exercising, expect_equal, expect_raises
from grading.capstone import CAPSTONE_PROMPTS, generate_batch, smollm2_greedy, swap_in
from grading.differential import RequestSpec, SchedulerWorld, differential_test, request_specs, sampled_token
from grading.waits import run_bounded
from solutions.core import data_parallel_kv_cache_manager as manager_module
from solutions.core.data_parallel_kv_cache_manager import DataParallelKVCacheManager
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sched import data_parallel_scheduler as dp_scheduler_module
from solutions.core.sched import placement as placement_module
from solutions.core.sched.data_parallel_scheduler import DataParallelModelRunnerOutput, DataParallelScheduler
from solutions.core.sched.output import ModelRunnerOutput, SchedulerOutput, sampling_rows
from solutions.core.sched.placement import PrefixAwarePolicy, ReplicaState
from solutions.core.sched.request_queue import SchedulingPolicy
from solutions.core.sched.scheduler import Scheduler
from solutions.core.sched.swapping_scheduler import SwappingScheduler
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.engine.arg_utils import EngineArgs
from solutions.engine.llm_engine import LLMEngine
from solutions.sampling_params import SamplingParams

REFERENCE = {
    "can_take": dp_scheduler_module.can_take,
    "place_by_prefix": placement_module.place_by_prefix,
    "num_cached_blocks": manager_module.num_cached_blocks,
    "drop_replica": dp_scheduler_module.drop_replica,
}

pytestmark = pytest.mark.timeout(60)

BLOCK_SIZE = 4


# --- place_by_prefix ------------------------------------------------------------------------------------------------


def state(replica: int, running: int = 0, waiting: int = 0, cached: int = 0, free: int = 16) -> ReplicaState:
    """A replica whose pool has 16 blocks, `free` of them free."""
    return ReplicaState(replica, running, waiting, free, cached, num_blocks=16)


def describe_states(states: list[ReplicaState]) -> str:
    return "; ".join(f"replica {s.replica}: {s.num_running} running, {s.num_waiting} waiting, pool "
                     f"{s.kv_cache_usage:.0%} used (load {s.load:g}), {s.num_cached_blocks} blocks cached"
                     for s in states)


def place(impl, states: list[ReplicaState], load_cap: int = 4, near_tie_blocks: int = 1) -> tuple[int, str]:
    inputs = f"load_cap {load_cap}, near_tie_blocks {near_tie_blocks}; {describe_states(states)}"
    with exercising("place_by_prefix", inputs):
        return impl.place_by_prefix(states, load_cap, near_tie_blocks), inputs


@pytest.mark.exercise("place_by_prefix")
def test_place_by_prefix_takes_the_pool_holding_the_longest_prefix(impl):
    got, inputs = place(impl, [state(0, cached=1), state(1, cached=3), state(2)])
    expect_equal(got, 1, inputs=f"{inputs}; the replica chosen (equal loads: 3 cached blocks beat 1 by more than "
                 "the near-tie margin)")


@pytest.mark.exercise("place_by_prefix")
def test_place_by_prefix_sends_a_near_tie_to_the_less_loaded(impl):
    got, inputs = place(impl, [state(0, running=2, cached=5), state(1, running=1, cached=4)])
    expect_equal(got, 1, inputs=f"{inputs}; the replica chosen (4 is within 1 block of 5: a near tie, load decides)")
    got, inputs = place(impl, [state(0, running=2, cached=5), state(1, running=1, cached=3)])
    expect_equal(got, 0, inputs=f"{inputs}; the replica chosen (3 is 2 blocks short of 5: the cache wins)")
    got, inputs = place(impl, [state(0, running=2, cached=5), state(1, running=1, cached=3)], near_tie_blocks=2)
    expect_equal(got, 1, inputs=f"{inputs}; the replica chosen (with a margin of 2, 3 and 5 are a near tie)")


@pytest.mark.exercise("place_by_prefix")
def test_place_by_prefix_prefers_the_longer_prefix_among_equally_loaded_near_ties(impl):
    got, inputs = place(impl, [state(0, running=1, cached=4), state(1, running=1, cached=5)])
    expect_equal(got, 1, inputs=f"{inputs}; the replica chosen (a near tie at equal load: the longer prefix)")
    got, inputs = place(impl, [state(0, running=1, cached=2), state(1, running=1, cached=2)])
    expect_equal(got, 0, inputs=f"{inputs}; the replica chosen (the same in every way: the lowest index)")


@pytest.mark.exercise("place_by_prefix")
def test_place_by_prefix_weighs_every_replica_of_a_near_tie(impl):
    got, inputs = place(impl, [state(0, running=1, cached=5), state(1, running=1, cached=4), state(2, cached=4)])
    expect_equal(got, 2, inputs=f"{inputs}; the replica chosen (4, 4 and 5 blocks are all within 1 of the best: the "
                 "least loaded of the three)")


@pytest.mark.exercise("place_by_prefix")
def test_place_by_prefix_caps_the_load_a_hot_prefix_may_pile_up(impl):
    got, inputs = place(impl, [state(0, running=5, cached=5), state(1, running=1)])
    expect_equal(got, 0, inputs=f"{inputs}; the replica chosen (load 5 is within the cap: 1 + 4)")
    got, inputs = place(impl, [state(0, running=6, cached=5), state(1, running=1)])
    expect_equal(got, 1, inputs=f"{inputs}; the replica chosen (load 6 is past the cap: 1 + 4)")
    got, inputs = place(impl, [state(0, running=2, cached=5), state(1, running=1)], load_cap=0)
    expect_equal(got, 1, inputs=f"{inputs}; the replica chosen (a cap of 0: only the least loaded are candidates)")


@pytest.mark.exercise("place_by_prefix")
def test_place_by_prefix_takes_the_best_prefix_within_the_cap_not_the_least_loaded(impl):
    got, inputs = place(impl, [state(0, running=6, cached=5), state(1, running=1), state(2, running=2, cached=3)])
    expect_equal(got, 2, inputs=f"{inputs}; the replica chosen (replica 0 is past the cap; of the others, replica "
                 "2 holds the longest prefix)")


@pytest.mark.exercise("place_by_prefix")
def test_place_by_prefix_weighs_a_waiting_sequence_by_its_pools_usage(impl):
    got, inputs = place(impl, [state(0, waiting=2, cached=5, free=8), state(1, running=3)])
    expect_equal(got, 0, inputs=f"{inputs}; the replica chosen (half full: load 2 + 0 = 2, the least; the longest "
                 "prefix)")
    got, inputs = place(impl, [state(0, waiting=2, cached=5, free=0), state(1, running=3)])
    expect_equal(got, 1, inputs=f"{inputs}; the replica chosen (full: load 2 + 2 x 6 x 0.5 = 8, past the cap: 3 + 4)")
    got, inputs = place(impl, [state(0, waiting=1, cached=2, free=0), state(1, running=3, cached=2)])
    expect_equal(got, 1, inputs=f"{inputs}; the replica chosen (a tie in cache: load 3 beats load 1 + 3 = 4)")


@pytest.mark.exercise("place_by_prefix")
def test_place_by_prefix_with_nothing_cached_is_least_loaded(impl):
    got, inputs = place(impl, [state(0, running=2), state(1, running=1), state(2, running=3)])
    expect_equal(got, 1, inputs=f"{inputs}; the replica chosen")


@pytest.mark.exercise("place_by_prefix")
def test_place_by_prefix_names_the_replica_not_its_position(impl):
    got, inputs = place(impl, [state(1, running=3), state(3, cached=2)])
    expect_equal(got, 3, inputs=f"{inputs} (replicas 0 and 2 are gone or full, so not offered); the replica chosen "
                 "(`ReplicaState.replica`)")


# --- num_cached_blocks ----------------------------------------------------------------------------------------------

HEAD = list(range(100, 112))  # three full blocks: A, B, C


def make_seq(seq_id: int, tokens: list[int], max_tokens: int = 3, **params) -> Sequence:
    seq = Sequence(seq_id, tokens)
    seq.request_id = f"r{seq_id}"
    seq.sampling_params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    return seq


def cache_on(manager: KVCacheManager, seq_id: int, tokens: list[int]) -> None:
    """Compute `tokens` on `manager`'s pool and free them: their full blocks stay cached, free."""
    seq = make_seq(seq_id, tokens)
    manager.allocate_slots(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    manager.free(seq)


def pools(num_replicas: int = 3, num_blocks: int = 16) -> DataParallelKVCacheManager:
    return DataParallelKVCacheManager([KVCacheManager(num_blocks, BLOCK_SIZE) for _ in range(num_replicas)])


def free_order(manager: KVCacheManager) -> list[int]:
    """The pool's free queue, head (the next to be handed out) first."""
    queue, order = manager.block_pool.free_block_queue, []
    block = queue.head.next_free_block
    while block is not queue.tail:
        order.append(block.block_id)
        block = block.next_free_block
    return order


def cached(impl, manager: DataParallelKVCacheManager, seq: Sequence, inputs: str) -> list[int]:
    with exercising("num_cached_blocks", inputs):
        return impl.num_cached_blocks(manager, seq)


def three_pools() -> tuple[DataParallelKVCacheManager, str]:
    manager = pools()
    cache_on(manager.replicas[1], 0, HEAD[:8])
    cache_on(manager.replicas[2], 1, HEAD + [7])
    return manager, (f"block_size {BLOCK_SIZE}, 3 pools: replica 0 holds nothing, replica 1 the blocks A, B of "
                     "a 12-token head (A B C), replica 2 all three (cached, free)")


@pytest.mark.exercise("num_cached_blocks")
def test_num_cached_blocks_counts_each_pools_leading_blocks(impl):
    manager, inputs = three_pools()
    seq = make_seq(5, HEAD + [9, 9])
    inputs += "; a 14-token prompt: the head, then 2 tokens of its own"
    expect_equal(cached(impl, manager, seq, inputs), [0, 2, 3], inputs=f"{inputs}; cached blocks per replica")


@pytest.mark.exercise("num_cached_blocks")
def test_num_cached_blocks_never_counts_the_block_holding_the_last_token(impl):
    manager, inputs = three_pools()
    got = cached(impl, manager, make_seq(5, HEAD), f"{inputs}; a prompt of exactly the head (12 tokens)")
    expect_equal(got, [0, 2, 2], inputs=f"{inputs}; a prompt of exactly the head (12 tokens); cached blocks per "
                 "replica (block C holds the last token, which must be computed)")
    got = cached(impl, manager, make_seq(6, HEAD + [9]), f"{inputs}; the head and 1 token")
    expect_equal(got, [0, 2, 3], inputs=f"{inputs}; the head and 1 token (13 tokens); cached blocks per replica")


@pytest.mark.exercise("num_cached_blocks")
def test_num_cached_blocks_stops_at_the_first_block_a_pool_lacks(impl):
    manager = pools(2)
    seq = make_seq(5, HEAD + [9])
    manager_module.extend_block_hashes(seq.block_hashes, seq.token_ids, seq.num_tokens, BLOCK_SIZE)
    pool = manager.replicas[1].block_pool
    held = pool.get_new_blocks(2)
    for block, index in zip(held, (0, 2), strict=True):  # blocks A and C cached, B evicted since
        pool.cache_full_block(block, seq.block_hashes[index])
    pool.free_blocks(held)
    inputs = (f"block_size {BLOCK_SIZE}, 2 pools: replica 1 holds blocks A and C of the head A B C (B was evicted); "
              "a 13-token prompt: the head and 1 token")
    expect_equal(cached(impl, manager, seq, inputs), [0, 1], inputs=f"{inputs}; cached blocks per replica (C "
                 "follows a hole: its keys and values need B's)")


@pytest.mark.exercise("num_cached_blocks")
def test_num_cached_blocks_only_looks(impl):
    manager, inputs = three_pools()
    before = [(free_order(m), [b.ref_cnt for b in m.block_pool.blocks]) for m in manager.replicas]
    cached(impl, manager, make_seq(5, HEAD + [9, 9]), f"{inputs}; a 14-token prompt")
    after = [(free_order(m), [b.ref_cnt for b in m.block_pool.blocks]) for m in manager.replicas]
    expect_equal(after, before, inputs=f"{inputs}; a 14-token prompt; (each pool's free queue, head first, and its "
                 "ref_cnts) after the lookup: placement asks every pool, and the sequence runs on one at most")
    queries = [m.prefix_cache_stats.queries for m in manager.replicas]
    expect_equal(queries, [0, 0, 0], inputs=f"{inputs}; a 14-token prompt; each pool's prefix_cache_stats.queries "
                 "(counted when the sequence is admitted on its replica, once)")


@pytest.mark.exercise("num_cached_blocks")
def test_num_cached_blocks_finds_nothing_on_a_gone_replica(impl):
    manager, inputs = three_pools()
    manager.mark_gone(2)
    inputs += "; replica 2's process has died (its pool marked gone); a 14-token prompt"
    expect_equal(cached(impl, manager, make_seq(5, HEAD + [9, 9]), inputs), [0, 2, 0],
                 inputs=f"{inputs}; cached blocks per replica")


@pytest.mark.exercise("num_cached_blocks")
def test_num_cached_blocks_finds_nothing_for_a_prompt_that_must_be_computed_whole(impl):
    manager, inputs = three_pools()
    seq = make_seq(5, HEAD + [9, 9], prompt_logprobs=1)
    inputs += "; a 14-token prompt whose request wants its prompt's logprobs (skip_reading_prefix_cache)"
    expect_equal(cached(impl, manager, seq, inputs), [0, 0, 0], inputs=f"{inputs}; cached blocks per replica")


# --- can_take -------------------------------------------------------------------------------------------------------


def busy_pair(free: int, *, threshold: int = 64, queued: int | None = 9) -> tuple[DataParallelScheduler, str]:
    """Two replicas of 16 blocks, 4 seats, a step budget of 64 and a prefill chunk cap of `threshold`: replica 0 runs
    seq 10 (5 tokens, 2 blocks) and has seq 11 (`queued` tokens, none computed) in its queue, with other blocks taken
    so that `free` are left; replica 1 is idle."""
    replicas = [Scheduler(KVCacheManager(16, BLOCK_SIZE), max_num_seqs=4, max_num_batched_tokens=64,
                          long_prefill_token_threshold=threshold, max_model_len=64) for _ in range(2)]
    scheduler = DataParallelScheduler(replicas, PrefixAwarePolicy(), SchedulingPolicy.FCFS)
    busy, manager = replicas[0], replicas[0].kv_cache_manager
    running = make_seq(10, [1, 2, 3, 4, 5])
    assert manager.allocate_slots(running, 5) is not None
    running.num_computed_tokens = 5
    busy.add_running(running)
    if queued:
        busy.add_seq(make_seq(11, list(range(200, 200 + queued))))
    manager.block_pool.get_new_blocks(manager.num_free_blocks - free)
    inputs = (f"block_size {BLOCK_SIZE}, 2 replicas of 16 blocks, max_num_seqs 4, step budget 64, "
              f"long_prefill_token_threshold {threshold}; replica 0 runs seq 10 (5 tokens) and has "
              f"{f'seq 11 ({queued} tokens) queued' if queued else 'nothing queued'}, {free} blocks free; "
              "replica 1 idle")
    return scheduler, inputs


def take(impl, scheduler: DataParallelScheduler, seq: Sequence, replica: int, inputs: str, cached: int = 0) -> bool:
    """`can_take` as `place_waiting` calls it, for `replica`, with `cached` of `seq`'s blocks in its pool."""
    states = scheduler.replica_states([cached if r == replica else 0 for r in range(len(scheduler.replicas))])
    with exercising("can_take", inputs):
        return impl.can_take(scheduler, seq, next(s for s in states if s.replica == replica))


@pytest.mark.exercise("can_take")
def test_can_take_counts_the_first_steps_of_what_is_queued_there_first(impl):
    scheduler, inputs = busy_pair(free=6)
    seq = make_seq(5, list(range(300, 309)))
    inputs += "; seq 5, 9 tokens, asks replica 0"
    expect_equal(take(impl, scheduler, seq, 0, inputs), True,
                 inputs=f"{inputs}; can it take seq 5 (seq 11 needs 3 blocks, seq 5 needs 3)?")
    scheduler, inputs = busy_pair(free=5)
    inputs += "; seq 5, 9 tokens, asks replica 0"
    expect_equal(take(impl, scheduler, seq, 0, inputs), False,
                 inputs=f"{inputs}; can it take seq 5 (seq 11 needs 3 of the 5 free blocks first, seq 5 needs 3)?")


@pytest.mark.exercise("can_take")
def test_can_take_needs_blocks_only_past_what_the_pool_holds(impl):
    scheduler, inputs = busy_pair(free=4)
    seq = make_seq(5, list(range(300, 309)))
    inputs += "; seq 5, 9 tokens, 2 of its blocks cached in replica 0's pool"
    expect_equal(take(impl, scheduler, seq, 0, inputs, cached=2), True,
                 inputs=f"{inputs}; can replica 0 take seq 5 (seq 11 needs 3, seq 5 one block past its 2 cached)?")
    expect_equal(take(impl, scheduler, seq, 0, inputs, cached=0), False,
                 inputs=f"{inputs.replace('2 of its blocks cached', 'none of its blocks cached')}; can replica 0 take "
                 "seq 5?")


@pytest.mark.exercise("can_take")
def test_can_take_needs_blocks_for_one_step_of_a_long_prompt(impl):
    scheduler, inputs = busy_pair(free=4, threshold=8, queued=None)
    seq = make_seq(5, list(range(300, 340)))
    inputs += "; seq 5, 40 tokens (10 blocks), asks replica 0"
    expect_equal(take(impl, scheduler, seq, 0, inputs), True,
                 inputs=f"{inputs}; can it take seq 5 (its first step computes 8 tokens: 2 blocks)?")
    scheduler, inputs = busy_pair(free=1, threshold=8, queued=9)
    inputs += "; seq 5, 40 tokens, asks replica 0"
    expect_equal(take(impl, scheduler, seq, 0, inputs), False,
                 inputs=f"{inputs}; can it take seq 5 (seq 11's first 8 tokens need 2 blocks, 1 is free)?")


@pytest.mark.exercise("can_take")
def test_can_take_needs_a_seat_for_every_sample_it_will_fork(impl):
    scheduler, inputs = busy_pair(free=16 - 2)
    seq = make_seq(5, [300, 301, 302])
    inputs += "; seq 5, 3 tokens, asks replica 0 (2 of its 4 seats taken)"
    expect_equal(take(impl, scheduler, seq, 0, inputs), True, inputs=f"{inputs}; can it take seq 5 (n=1)?")
    seq.fork_seq_ids = [6]
    expect_equal(take(impl, scheduler, seq, 0, inputs), True, inputs=f"{inputs}; can it take seq 5 (n=2)?")
    seq.fork_seq_ids = [6, 7]
    expect_equal(take(impl, scheduler, seq, 0, inputs), False,
                 inputs=f"{inputs}; can it take seq 5 (n=3: it will fork samples 6 and 7)?")


@pytest.mark.exercise("can_take")
def test_can_take_an_idle_replica_takes_anything(impl):
    scheduler, inputs = busy_pair(free=0)
    seq = make_seq(5, list(range(300, 364)))
    seq.fork_seq_ids = [6, 7, 8, 9]
    inputs += "; seq 5, 64 tokens (16 blocks) and 4 samples to fork, asks replica 1 (idle, 16 blocks free)"
    expect_equal(take(impl, scheduler, seq, 1, inputs), True,
                 inputs=f"{inputs}; can replica 1 take it (its own scheduler chunks the prompt and caps the seats)?")
    expect_equal(take(impl, scheduler, seq, 0, inputs), False,
                 inputs=f"{inputs}; can replica 0 (busy, no block free) take it?")

# --- drop_replica ---------------------------------------------------------------------------------------------------


def hand_built(num_replicas: int = 2, num_blocks: int = 16, num_swap_blocks: int = 0) -> DataParallelScheduler:
    replicas = []
    for _ in range(num_replicas):
        manager = KVCacheManager(num_blocks, BLOCK_SIZE)
        if num_swap_blocks:
            manager.enable_swapping(num_swap_blocks)
        cls = SwappingScheduler if num_swap_blocks else Scheduler
        replicas.append(cls(manager, max_num_seqs=4, max_num_batched_tokens=64, long_prefill_token_threshold=64,
                              max_model_len=64))
    return DataParallelScheduler(replicas, PrefixAwarePolicy(), SchedulingPolicy.FCFS)


def run_step(scheduler: DataParallelScheduler) -> None:
    """One step, every sampling sequence given token 7 (the scheduler's side of a step, without a model)."""
    out = scheduler.schedule()
    sampled = {}
    for replica, part in out.replica_outputs.items():
        _, seqs = sampling_rows(part)
        sampled[replica] = ModelRunnerOutput([s.seq_id for s in seqs], [[7] for _ in seqs], [None] * len(seqs))
    scheduler.update_from_output(out, DataParallelModelRunnerOutput(sampled))


def run_to_the_end(scheduler: DataParallelScheduler, seqs: list[Sequence], dead: int, inputs: str) -> None:
    steps = 0
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
        steps += 1
        on_dead = [seq.seq_id for seq in seqs if seq.replica == dead and not seq.is_finished]
        expect_equal(on_dead, [], inputs=f"{inputs}; then {steps} steps: unfinished sequences on the dead replica")
        assert steps < 100, f"on input {inputs}: the requests did not finish in 100 steps after the drop"


def expect_no_leak(scheduler: DataParallelScheduler, inputs: str) -> None:
    for replica, manager in enumerate(scheduler.kv_cache_manager.replicas):
        pools_ = [("device", manager.block_pool)] + ([("host", manager.swap_pool)] if manager.swap_pool else [])
        for name, pool in pools_:
            expect_equal([b.ref_cnt for b in pool.blocks if b.ref_cnt], [],
                         inputs=f"{inputs}; the ref_cnts still held in replica {replica}'s {name} pool at the end")


def three_queues() -> tuple[DataParallelScheduler, list[Sequence], str]:
    """Seqs 0-3 (9 tokens each) ran one step: 0, 2 on replica 0, 1, 3 on replica 1; seq 4 (seq 1's prompt and
    more) placed on replica 1 and waiting there; seq 5 unplaced. Seq 3 carries two draft tokens."""
    scheduler = hand_built()
    seqs = [make_seq(i, list(range(10 * i, 10 * i + 9))) for i in range(4)]
    for seq in seqs:
        scheduler.add_request(seq)
    run_step(scheduler)
    later = make_seq(4, seqs[1].token_ids[:8] + [1, 2, 3])
    scheduler.add_request(later)
    scheduler.place_waiting()
    last = make_seq(5, [5, 5, 5, 5, 5])
    scheduler.add_request(last)
    seqs[3].spec_token_ids = [8, 9]
    seqs += [later, last]
    assert [seq.replica for seq in seqs] == [0, 1, 0, 1, 1, None], [seq.replica for seq in seqs]
    inputs = (f"block_size {BLOCK_SIZE}, 2 replicas of 16 blocks; seqs 0 and 2 run on replica 0; seqs 1 and 3 run on "
              "replica 1 (9 prompt tokens computed and 1 sampled each; seq 3 with draft tokens [8, 9]); seq 4 "
              "(arrived after them) placed on replica 1, waiting there; seq 5 arrived last, not placed yet; "
              "replica 1 dies")
    return scheduler, seqs, inputs


def drop(impl, scheduler: DataParallelScheduler, replica: int, inputs: str) -> None:
    with exercising("drop_replica", inputs):
        impl.drop_replica(scheduler, replica)


@pytest.mark.exercise("drop_replica")
def test_drop_replica_requeues_its_sequences_first_in_arrival_order(impl):
    scheduler, seqs, inputs = three_queues()
    drop(impl, scheduler, 1, inputs)
    expect_equal([seq.seq_id for seq in scheduler.waiting], [1, 3, 4, 5],
                 inputs=f"{inputs}; the unplaced queue afterwards (its head first)")
    expect_equal(scheduler.num_requeued, 3, inputs=f"{inputs}; scheduler.num_requeued")


@pytest.mark.exercise("drop_replica")
def test_drop_replica_resets_what_lived_in_the_dead_pool_and_keeps_the_tokens(impl):
    scheduler, seqs, inputs = three_queues()
    drop(impl, scheduler, 1, inputs)
    got = [(s.seq_id, s.status.name, s.replica, s.num_computed_tokens, s.block_table, s.spec_token_ids, s.num_tokens)
           for s in seqs[1::2]]
    want = [(1, "PREEMPTED", None, 0, [], [], 10), (3, "PREEMPTED", None, 0, [], [], 10),
            (5, "WAITING", None, 0, [], [], 5)]
    expect_equal(got, want, inputs=f"{inputs}; (seq id, status, replica, computed tokens, block table, draft tokens, "
                 "tokens) of seqs 1, 3, 5")
    got = (seqs[4].status.name, seqs[4].replica, seqs[4].num_computed_tokens)
    expect_equal(got, ("WAITING", None, 0), inputs=f"{inputs}; (status, replica, computed tokens) of seq 4, never "
                 "admitted")
    expect_equal(sorted(scheduler.requests), ["r0", "r1", "r2", "r3", "r4", "r5"],
                 inputs=f"{inputs}; the requests the scheduler still serves")


@pytest.mark.exercise("drop_replica")
def test_drop_replica_leaves_the_live_replica_alone(impl):
    scheduler, seqs, inputs = three_queues()
    drop(impl, scheduler, 1, inputs)
    got = [(s.seq_id, s.status.name, s.replica, s.num_computed_tokens) for s in seqs[0:3:2]]
    expect_equal(got, [(0, "RUNNING", 0, 9), (2, "RUNNING", 0, 9)],
                 inputs=f"{inputs}; (seq id, status, replica, computed tokens) of seqs 0 and 2")


@pytest.mark.exercise("drop_replica")
def test_drop_replica_marks_the_pool_gone_and_balances_its_books(impl):
    scheduler, seqs, inputs = three_queues()
    drop(impl, scheduler, 1, inputs)
    manager = scheduler.kv_cache_manager
    expect_equal(manager.alive, [True, False], inputs=f"{inputs}; kv_cache_manager.alive")
    gone = manager.replicas[1]
    expect_equal(gone.num_free_blocks, gone.num_blocks, inputs=f"{inputs}; free blocks of the gone pool (of 16)")
    run_to_the_end(scheduler, seqs, 1, inputs)
    expect_equal([seq.num_output_tokens for seq in seqs], [3] * 6,
                 inputs=f"{inputs}; then every step run: the tokens each sequence sampled (max_tokens 3)")
    expect_no_leak(scheduler, inputs)


@pytest.mark.exercise("drop_replica")
def test_drop_replica_requeues_a_swapped_group_whole_and_frees_the_host(impl):
    scheduler = hand_built(num_swap_blocks=8)
    dead = scheduler.replicas[1]
    parent = make_seq(0, HEAD[:10], max_tokens=4, n=2)
    parent.replica = 1
    dead.kv_cache_manager.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    group = [parent, parent.fork(1)]
    dead.kv_cache_manager.fork(parent, group[1])
    scheduler.requests["r0"] = list(group)
    for seq in group:
        seq.append_token(7)
        dead.add_running(seq)
    dead._preempt_by_swap(list(group), SchedulerOutput(num_computed_tokens=[]), {})  # its own list: finish empties it
    other = make_seq(2, [1, 2, 3, 4, 5])
    scheduler.add_request(other)
    inputs = (f"block_size {BLOCK_SIZE}, 2 replicas of 16 blocks and 8 host blocks each; request r0's two samples "
              "(a 10-token prompt and 1 token each) swapped out of replica 1 to its host pool; seq 2 not placed yet; "
              "replica 1 dies")
    drop(impl, scheduler, 1, inputs)
    got = [(s.seq_id, s.status.name, s.num_computed_tokens, s.block_table) for s in scheduler.waiting]
    expect_equal(got, [(0, "PREEMPTED", 0, []), (1, "PREEMPTED", 0, []), (2, "WAITING", 0, [])],
                 inputs=f"{inputs}; (seq id, status, computed tokens, block table) of the unplaced queue, head first")
    expect_equal(dead.kv_cache_manager.swap_pool.num_free_blocks, 8,
                 inputs=f"{inputs}; free blocks of the gone replica's host pool")
    run_to_the_end(scheduler, [*group, other], 1, inputs)
    expect_equal([seq.num_output_tokens for seq in (*group, other)], [4, 4, 3],
                 inputs=f"{inputs}; then every step run: the tokens each sequence sampled")
    expect_no_leak(scheduler, inputs)


@pytest.mark.exercise("drop_replica")
def test_drop_replica_refuses_to_go_on_without_a_replica_but_requeues_first(impl):
    scheduler, seqs, inputs = three_queues()
    drop(impl, scheduler, 1, inputs)
    inputs += "; then replica 0 dies too"
    with exercising("drop_replica", inputs):
        expect_raises(RuntimeError, lambda: impl.drop_replica(scheduler, 0), inputs=inputs)
    expect_equal([seq.seq_id for seq in scheduler.waiting], [0, 2, 1, 3, 4, 5],
                 inputs=f"{inputs}; the unplaced queue afterwards (nothing is lost, whatever the caller does next)")
    expect_equal(scheduler.kv_cache_manager.alive, [False, False], inputs=f"{inputs}; kv_cache_manager.alive")


# --- every exercise against the reference, on generated workloads ----------------------------------------------------


@dataclass
class DataParallelWorld(SchedulerWorld):
    """A `SchedulerWorld` over replicas, one of which may die: (before step, replica), or None."""

    death: tuple[int, int] | None = None


def data_parallel_step(world: DataParallelWorld) -> SchedulerOutput:
    """A replica that died in the previous step is dropped (as the engine core does), then one step of every live
    replica, each sampling row given a token of its own (`sampled_token`: forked samples diverge)."""
    if world.death is not None and world.death[0] == world.step:
        world.scheduler.drop_replica(world.death[1])
    world.arrive()
    out = world.scheduler.schedule()
    sampled = {}
    for replica, part in out.replica_outputs.items():
        _, seqs = sampling_rows(part)
        sampled[replica] = ModelRunnerOutput([s.seq_id for s in seqs], [[sampled_token(s)] for s in seqs],
                                             [None] * len(seqs))
    world.scheduler.update_from_output(out, DataParallelModelRunnerOutput(sampled))
    world.step += 1
    return out


@st.composite
def data_parallel_workloads(draw) -> tuple[Callable[[list[RequestSpec]], DataParallelWorld], list, str]:
    """2 or 3 replicas with small pools (swapping, in some), the prefix policy with a generated cap and margin, a
    generated workload, and perhaps a replica that dies: placements, near ties, requeues and prefix hits happen on
    their own. Returns (the world of a workload, the workload, the setting in words)."""
    num_replicas, num_blocks = draw(st.integers(2, 3)), draw(st.integers(8, 16))
    num_swap = draw(st.sampled_from([0, 0, 8]))
    load_cap, near_tie = draw(st.integers(0, 4)), draw(st.integers(0, 2))
    policy, max_num_seqs = draw(st.sampled_from(SchedulingPolicy)), draw(st.integers(2, 4))
    death = draw(st.one_of(st.none(), st.tuples(st.integers(1, 10), st.integers(0, num_replicas - 1))))

    def make_world(specs: list[RequestSpec]) -> DataParallelWorld:
        replicas = []
        for _ in range(num_replicas):
            manager = KVCacheManager(num_blocks, BLOCK_SIZE)
            if num_swap:
                manager.enable_swapping(num_swap)
            cls = SwappingScheduler if num_swap else Scheduler
            replicas.append(cls(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=16,
                                long_prefill_token_threshold=16, max_model_len=64, policy=policy))
        scheduler = DataParallelScheduler(replicas, PrefixAwarePolicy(load_cap, near_tie), policy)
        return DataParallelWorld(scheduler, specs, death=death)

    inputs = (f"block_size {BLOCK_SIZE}, {num_replicas} replicas of {num_blocks} blocks (a swap pool of {num_swap}), "
              f"max_num_seqs {max_num_seqs}, policy {policy.name}, PrefixAwarePolicy(load_cap={load_cap}, "
              f"near_tie_blocks={near_tie}), death (before step, replica) {death}")
    return make_world, draw(request_specs(max_n=2)), inputs


test_each_exercise_leaves_the_references_state_on_generated_workloads = differential_test(
    REFERENCE, tuple(REFERENCE), lambda _: data_parallel_workloads(), data_parallel_step
)


# --- capstone: your placement, your accounting and your requeue in the engine, on SmolLM2 -----------------------------

CAPSTONE_BLOCK_SIZE = 8
FIRST_IDS = [0, 1]  # a chat question and a plain text: one on each replica
SECOND_IDS = [2, 4, 6, 3, 5]  # three chat questions (the first's system prompt is cached on one replica), two texts
CAPSTONE_TOKENS = 12
CAPSTONE_SEATS = 2  # max_num_seqs per replica: the second batch does not fit where the cache would send it
KILL_AT_STEP = 4  # of the second batch: replica 1's worker is SIGKILLed before it
# Where the second batch is placed (worked out by hand: the five are placed one after another before the batch's
# first step, each joining its replica's queue while that replica has a seat, 2 each; both pools hold no block then
# (only cached free ones), so a waiting request weighs one running one. Prompts 2 and 4 go where prompt 0 left the
# system prompt: replica 0's load is 0, then 1 against 0 there, within the cap of 4. Replica 0 then has no seat:
# prompt 6 and the first text go to replica 1, the only replica that can take them, and the last text stays
# unplaced, None), and the prompt tokens the prefix caches supplied over the run, recomputed prompts included. The
# hits are the reference's: `pytest --impl=reference` and the notebook's nbval run hold them to it.
CAPSTONE_PLACEMENT = [0, 0, 1, 1, None]
CAPSTONE_HITS = 72


def capstone_run() -> dict:
    """FIRST_IDS, then SECOND_IDS on a fresh SmolLM2 engine with two replicas and `prefix` placement; replica 1's
    worker is killed during the second batch. Returns the tokens, the hits, the replicas alive, the sequences
    requeued and the blocks still in use."""
    engine = LLMEngine.from_engine_args(EngineArgs(
        model="smollm2-135m", block_size=CAPSTONE_BLOCK_SIZE, max_num_seqs=CAPSTONE_SEATS, max_model_len=256,
        data_parallel_size=2, data_parallel_placement="prefix", worker_multiproc_method="fork",
    ))
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=CAPSTONE_TOKENS, ignore_eos=True)
        first = generate_batch(engine, [(CAPSTONE_PROMPTS[i], greedy) for i in FIRST_IDS])
        client = engine.engine_core  # the in-process core's client: its executor's workers, its scheduler
        for i in SECOND_IDS:
            engine.add_request(f"second-{i}", CAPSTONE_PROMPTS[i], greedy)

        placed: list[int | None] = []

        def second_batch() -> dict[str, list[int]]:
            tokens: dict[str, list[int]] = {f"second-{i}": [] for i in SECOND_IDS}
            steps = 0
            while engine.has_unfinished_requests():
                steps += 1
                if steps == KILL_AT_STEP:
                    os.kill(client.model_executor.workers[1].pid, signal.SIGKILL)
                for out in engine.step():
                    tokens[out.request_id] += out.outputs[0].token_ids
                if steps == 1:
                    placed.extend(client.scheduler.requests[f"second-{i}"][0].replica for i in SECOND_IDS)
            return tokens

        second = run_bounded(second_batch, 150, what="the capstone's second batch (a replica killed mid-run)",
                             likely="a requeued sequence that is never placed again, or placed on the dead replica")
        scheduler = client.scheduler
        return {
            "tokens": [o.outputs[0].token_ids for o in first] + [second[f"second-{i}"] for i in SECOND_IDS],
            "placed": placed, "hits": engine.stats.prefix_cache_hits, "alive": list(scheduler.kv_cache_manager.alive),
            "requeued": scheduler.num_requeued, "used": scheduler.kv_cache_manager.replicas[0].num_used_blocks,
        }
    finally:
        engine.shutdown()


@pytest.mark.exercise("capstone")
@pytest.mark.timeout(300)  # a real model on two worker processes: seconds on an idle 2-core machine
def test_capstone_two_replicas_of_smollm2_one_killed_give_hugging_faces_tokens(impl):
    inputs = (f"SmolLM2-135M on 2 replicas, block_size {CAPSTONE_BLOCK_SIZE}, placement 'prefix'; "
              f"CAPSTONE_PROMPTS{FIRST_IDS} in one batch, then CAPSTONE_PROMPTS{SECOND_IDS}, replica 1's worker "
              f"killed before step {KILL_AT_STEP} of the second; greedy, {CAPSTONE_TOKENS} tokens each")
    with swap_in(impl, REFERENCE):  # your placement, your accounting, your requeue, inside the engine
        run = capstone_run()
    for tokens, i in zip(run["tokens"], FIRST_IDS + SECOND_IDS, strict=True):
        expect_equal(tokens, smollm2_greedy(i, CAPSTONE_TOKENS),
                     inputs=f"{inputs}; the greedy tokens of prompt {i} (oracle: Hugging Face greedy)")
    expect_equal(run["placed"], CAPSTONE_PLACEMENT,
                 inputs=f"{inputs}; the replica each request of the second batch was placed on at its first step")
    expect_equal((run["alive"], run["requeued"] > 0), ([True, False], True),
                 inputs=f"{inputs}; (replicas alive, whether the dead replica handed sequences back)")
    expect_equal(run["hits"], CAPSTONE_HITS,
                 inputs=f"{inputs}; prompt tokens the prefix caches supplied (oracle: the reference engine)")
    expect_equal(run["used"], 0, inputs=f"{inputs}; blocks in use on the live replica after every request finished")

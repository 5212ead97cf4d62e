"""Grading tests for chapter 11 — swapping, recomputation and a host tier.

Each test grades one exercise (`@pytest.mark.exercise`), called as the engine calls it. The oracles owe nothing to
the code under test: which group leaves and how, worked out by hand from the running order, the policy, the free
host blocks and the device pool's size (at the boundaries: a host pool of exactly the group's blocks, a device pool
of exactly its blocks and one more per sample); which swapped groups come back, and the budget left to admissions,
worked out by hand from the free device blocks, the seats and the step's preemptions; the host tier's hits and LRU
order counted by hand. The capstone holds SmolLM2's greedy tokens, in a preemption storm that both swaps and
recomputes groups and with prefixes found on the host, to Hugging Face's, and finds nothing held on either host pool.
Beyond the hand-made states, each exercise runs where the engine runs it on generated workloads (arrivals, forks,
aborts, preemptions), and the state after each step must be the reference's
(`grading/differential.py`).
"""

from collections.abc import Callable

import pytest
from hypothesis import strategies as st

from grading import exercising, expect_equal
from grading.differential import RequestSpec, SchedulerWorld, differential_test, request_specs
from grading.capstone import CAPSTONE_PROMPTS, generate_batch, smollm2, smollm2_greedy, swap_in
from solutions.attention.paged import KVCache
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sched import swapping_scheduler as swapping_module
from solutions.core.sched.output import SchedulerOutput
from solutions.core.sched.request_queue import SchedulingPolicy
from solutions.core.sched.swapping_scheduler import PreemptionMode, SwappingScheduler
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.engine.arg_utils import EngineArgs
from solutions.engine.llm_engine import LLMEngine
from solutions.kv_offload import manager as offload_manager
from solutions.kv_offload.manager import CPUOffloadingManager, update_state_after_alloc
from solutions.sampling_params import SamplingParams

REFERENCE = {
    "select_preemption": swapping_module.select_preemption,
    "schedule_swapped": swapping_module.schedule_swapped,
    "prepare_store": offload_manager.prepare_store,
    "get_num_new_matched_tokens": offload_manager.get_num_new_matched_tokens,
}
reference_prepare_store = offload_manager.prepare_store  # taken at load time: inside the capstone's `swap_in` the
# attribute is yours

pytestmark = pytest.mark.timeout(60)

BLOCK_SIZE = 4
PROMPT = list(range(100, 110))  # 10 tokens: blocks A (positions 0-3), B (4-7), C (8-9)


# --- a running set: seq 5 (request "q", 5 tokens), then samples 0, 1, 2 of request "r" ---------------------------


def running_set(
    num_device_blocks: int = 16, num_host_blocks: int = 8, *, policy: SchedulingPolicy = SchedulingPolicy.FCFS,
    priorities: tuple[int, int] = (0, 0), max_num_seqs: int = 8,
) -> tuple[SwappingScheduler, list[Sequence], str]:
    """Seq 5 (request q: 4 computed tokens and 1 new, 1 block) started first, then request r: a 10-token prompt
    forked into samples 0, 1, 2, each with one new token (the prompt's blocks A, B, C shared: 3 distinct blocks).
    `priorities` = (q's, r's). Returns (scheduler, [seq 5, sample 0, 1, 2], a description)."""
    manager = KVCacheManager(num_device_blocks, BLOCK_SIZE, enable_prefix_caching=False)
    manager.enable_swapping(num_host_blocks)
    scheduler = SwappingScheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                          long_prefill_token_threshold=64, policy=policy)
    first = Sequence(5, [1, 2, 3, 4], priority=priorities[0], arrival=0)
    first.request_id = "q"
    assert manager.allocate_slots(first, 4) is not None
    first.num_computed_tokens = 4
    first.append_token(7)
    parent = Sequence(0, PROMPT, priority=priorities[1], arrival=1)
    assert manager.allocate_slots(parent, len(PROMPT)) is not None
    parent.num_computed_tokens = len(PROMPT)
    group = [parent, parent.fork(1), parent.fork(2)]
    for seq in group[1:]:
        manager.fork(parent, seq)
    for seq in group:
        seq.request_id = "r"
        seq.append_token(200 + seq.seq_id)
    scheduler.requests = {"q": [first], "r": list(group)}
    for seq in (first, *group):
        scheduler.add_running(seq)
    inputs = (f"block_size {BLOCK_SIZE}, {num_device_blocks} device blocks, {num_host_blocks} free host blocks, "
              f"policy {policy.name}; running in order: seq 5 (request q, priority {priorities[0]}, 1 block), then "
              f"samples 0, 1, 2 of request r (priority {priorities[1]}; a 10-token prompt's 3 blocks shared by all "
              "three, 11 tokens each)")
    return scheduler, [first, *group], inputs


def run_select(impl, scheduler: SwappingScheduler, inputs: str) -> tuple[list[int], PreemptionMode]:
    with exercising("select_preemption", inputs):
        group, mode = impl.select_preemption(scheduler)
    return [seq.seq_id for seq in group], mode


# --- select_preemption ------------------------------------------------------------------------------------------------


@pytest.mark.exercise("select_preemption")
def test_select_preemption_takes_the_last_started_group_whole(impl):
    scheduler, _, inputs = running_set()
    expect_equal(run_select(impl, scheduler, inputs), ([0, 1, 2], PreemptionMode.SWAP),
                 inputs=f"{inputs}; (the group's seq ids, the mode): sample 2 started last, its request's running "
                 "samples share blocks and leave together; 3 host blocks are free enough, 3 + 3 fit 16")


@pytest.mark.exercise("select_preemption")
def test_select_preemption_takes_the_lowest_priority_under_the_priority_policy(impl):
    scheduler, _, inputs = running_set(policy=SchedulingPolicy.PRIORITY, priorities=(1, 0))
    expect_equal(run_select(impl, scheduler, inputs), ([5], PreemptionMode.SWAP),
                 inputs=f"{inputs}; (the group's seq ids, the mode): request q has the larger priority value")


@pytest.mark.exercise("select_preemption")
def test_select_preemption_swaps_into_a_host_pool_of_exactly_the_groups_blocks(impl):
    scheduler, _, inputs = running_set(num_host_blocks=3)
    expect_equal(run_select(impl, scheduler, inputs), ([0, 1, 2], PreemptionMode.SWAP),
                 inputs=f"{inputs}; (the group's seq ids, the mode): the group's 3 distinct blocks, 3 free host blocks")
    scheduler, _, inputs = running_set(num_host_blocks=2)
    expect_equal(run_select(impl, scheduler, inputs), ([0, 1, 2], PreemptionMode.RECOMPUTE),
                 inputs=f"{inputs}; (the group's seq ids, the mode): 3 distinct blocks do not fit 2 free host blocks; "
                 "the group is recomputed whole, never split")


@pytest.mark.exercise("select_preemption")
def test_select_preemption_counts_free_host_blocks_not_the_host_pools_size(impl):
    scheduler, _, inputs = running_set(num_host_blocks=4)
    scheduler.kv_cache_manager.swap_pool.get_new_blocks(2)  # another group is out already
    inputs += "; 2 of the 4 host blocks hold another swapped group"
    expect_equal(run_select(impl, scheduler, inputs), ([0, 1, 2], PreemptionMode.RECOMPUTE),
                 inputs=f"{inputs}; (the group's seq ids, the mode)")


@pytest.mark.exercise("select_preemption")
def test_select_preemption_swaps_a_group_the_device_pool_can_exactly_take_back(impl):
    # 6 device blocks: seq 5 holds 1, the group 3; coming back needs the group's 3 and one per sample: 6.
    scheduler, _, inputs = running_set(num_device_blocks=6)
    expect_equal(run_select(impl, scheduler, inputs), ([0, 1, 2], PreemptionMode.SWAP),
                 inputs=f"{inputs}; (the group's seq ids, the mode): back it needs 3 + 3 = 6 blocks, the pool's size")


@pytest.mark.exercise("select_preemption")
def test_select_preemption_recomputes_a_group_that_could_never_come_back(impl):
    # 5 device blocks: seq 5 holds 1, the group 3 (1 free). Coming back needs 3 + 3 = 6 > 5.
    scheduler, _, inputs = running_set(num_device_blocks=5)
    expect_equal(run_select(impl, scheduler, inputs), ([0, 1, 2], PreemptionMode.RECOMPUTE),
                 inputs=f"{inputs}; (the group's seq ids, the mode): the group's 3 blocks and one per sample exceed "
                 "the 5-block device pool, so a swap-out could never end; the free device blocks do not matter")


@pytest.mark.exercise("select_preemption")
def test_select_preemption_takes_only_running_samples(impl):
    scheduler, seqs, inputs = running_set()
    scheduler.finish(seqs[3], SequenceStatus.FINISHED_STOPPED)
    late = Sequence(9, [5, 6, 7], arrival=2)
    late.request_id = "w"
    scheduler.add_request(late)
    inputs += "; sample 2 has finished (its request still lists it), request w (arrived last) waits"
    expect_equal(run_select(impl, scheduler, inputs), ([0, 1], PreemptionMode.SWAP),
                 inputs=f"{inputs}; (the group's seq ids, the mode): the running samples of the last to start")


# --- schedule_swapped -------------------------------------------------------------------------------------------------


def swapped_set(num_device_blocks: int, *, max_num_seqs: int = 8):
    """Request r's three samples swapped out (3 distinct blocks), then seq 5 (1 block) too, and request w (seq 9)
    waiting behind them: (scheduler, [seq 5, samples], seq 9, inputs), before a new step."""
    scheduler, seqs, inputs = running_set(num_device_blocks=num_device_blocks, max_num_seqs=max_num_seqs)
    first, group = seqs[0], seqs[1:]
    out = SchedulerOutput(num_computed_tokens=[])
    for seqs_out in (group, [first]):
        scheduler._preempt_by_swap(seqs_out, out, {})
    late = Sequence(9, [5, 6, 7], arrival=2)
    late.request_id = "w"
    scheduler.add_request(late)
    inputs = (f"block_size {BLOCK_SIZE}, {num_device_blocks} free device blocks, max_num_seqs {max_num_seqs}; "
              "swapped out in this order: request r's samples (3 distinct blocks), then seq 5 (1 block); seq 9 "
              "waits; a new step, budget 64")
    return scheduler, seqs, late, inputs


def run_swapped(impl, scheduler: SwappingScheduler, out: SchedulerOutput, budget: int, inputs: str) -> int:
    with exercising("schedule_swapped", inputs):
        return impl.schedule_swapped(scheduler, out, budget, {})


def swapped_ids(scheduler: SwappingScheduler) -> list[list[int]]:
    return [[seq.seq_id for seq in group] for group in scheduler.swapped]


@pytest.mark.exercise("schedule_swapped")
def test_schedule_swapped_brings_groups_back_oldest_first(impl):
    scheduler, _, _, inputs = swapped_set(16)
    out = SchedulerOutput(num_computed_tokens=[])
    left = run_swapped(impl, scheduler, out, 64, inputs)
    expect_equal(out.swapped_in_seq_ids, [0, 1, 2, 5], inputs=f"{inputs}; out.swapped_in_seq_ids (oldest first)")
    expect_equal([s.seq_id for s in scheduler.running], [0, 1, 2, 5], inputs=f"{inputs}; running afterwards")
    expect_equal(left, 64 - 4, inputs=f"{inputs}; the budget left to admissions (4 tokens scheduled, none out)")


@pytest.mark.exercise("schedule_swapped")
def test_schedule_swapped_leaves_no_budget_to_admissions_while_a_group_is_out(impl):
    # r needs 3 + 3 = 6 free blocks, seq 5 needs 1 + 1 = 2: 6 free blocks bring r back, not seq 5.
    scheduler, _, _, inputs = swapped_set(6)
    out = SchedulerOutput(num_computed_tokens=[])
    left = run_swapped(impl, scheduler, out, 64, inputs)
    expect_equal(swapped_ids(scheduler), [[5]], inputs=f"{inputs}; the groups still out afterwards")
    expect_equal(left, 0, inputs=f"{inputs}; the budget left to admissions (seq 5 is still out: seq 9 must wait, or "
                 "it takes the blocks seq 5 comes back into)")


@pytest.mark.exercise("schedule_swapped")
def test_schedule_swapped_keeps_the_order_no_group_jumps_one_that_does_not_fit(impl):
    scheduler, _, _, inputs = swapped_set(16)
    scheduler.kv_cache_manager.block_pool.get_new_blocks(11)  # 5 free: r needs 6, seq 5 needs 2
    inputs += "; 11 of the 16 device blocks taken by others (5 free)"
    out = SchedulerOutput(num_computed_tokens=[])
    left = run_swapped(impl, scheduler, out, 64, inputs)
    expect_equal((swapped_ids(scheduler), left), ([[0, 1, 2], [5]], 0),
                 inputs=f"{inputs}; (the groups still out, the budget left): r went out first and needs 6; seq 5 "
                 "would fit but must not jump it")


@pytest.mark.exercise("schedule_swapped")
def test_schedule_swapped_needs_the_groups_blocks_and_one_per_sequence(impl):
    scheduler, _, _, inputs = swapped_set(16)
    scheduler.kv_cache_manager.block_pool.get_new_blocks(10)  # 6 free: exactly r's 3 blocks and 3 next tokens
    inputs += "; 10 of the 16 device blocks taken by others (6 free)"
    out = SchedulerOutput(num_computed_tokens=[])
    left = run_swapped(impl, scheduler, out, 64, inputs)
    expect_equal((swapped_ids(scheduler), out.swapped_in_seq_ids, left), ([[5]], [0, 1, 2], 0),
                 inputs=f"{inputs}; (the groups still out, swapped in, the budget left)")
    scheduler, _, _, inputs = swapped_set(16)
    scheduler.kv_cache_manager.block_pool.get_new_blocks(11)  # 5 free: r's 3 blocks, but not 3 next tokens
    inputs += "; 11 of the 16 device blocks taken by others (5 free)"
    out = SchedulerOutput(num_computed_tokens=[])
    run_swapped(impl, scheduler, out, 64, inputs)
    expect_equal(swapped_ids(scheduler), [[0, 1, 2], [5]],
                 inputs=f"{inputs}; the groups still out (r's 3 blocks fit, but not one more per sample)")


@pytest.mark.exercise("schedule_swapped")
def test_schedule_swapped_brings_nobody_back_in_a_step_that_preempted(impl):
    scheduler, _, _, inputs = swapped_set(16)
    out = SchedulerOutput(num_computed_tokens=[])
    out.preempted_seq_ids.append(42)
    inputs += "; this step already preempted seq 42"
    left = run_swapped(impl, scheduler, out, 64, inputs)
    expect_equal((swapped_ids(scheduler), left), ([[0, 1, 2], [5]], 0),
                 inputs=f"{inputs}; (the groups still out, the budget left): the memory just freed is the running "
                 "sequences'")


@pytest.mark.exercise("schedule_swapped")
def test_schedule_swapped_needs_seats_in_the_running_set(impl):
    scheduler, _, _, inputs = swapped_set(16, max_num_seqs=3)
    out = SchedulerOutput(num_computed_tokens=[])
    left = run_swapped(impl, scheduler, out, 64, inputs)
    expect_equal((swapped_ids(scheduler), out.swapped_in_seq_ids, left), ([[5]], [0, 1, 2], 0),
                 inputs=f"{inputs}; (the groups still out, swapped in, the budget left): 3 seats, r takes them all")


@pytest.mark.exercise("schedule_swapped")
def test_schedule_swapped_with_no_budget_left_brings_nobody_back(impl):
    scheduler, _, _, inputs = swapped_set(16)
    out = SchedulerOutput(num_computed_tokens=[])
    left = run_swapped(impl, scheduler, out, 0, inputs.replace("budget 64", "budget 0 (the running took it all)"))
    expect_equal((swapped_ids(scheduler), out.swapped_in_seq_ids, left), ([[0, 1, 2], [5]], [], 0),
                 inputs=f"{inputs}, but a budget of 0; (the groups still out, swapped in, the budget left)")


@pytest.mark.exercise("schedule_swapped")
def test_schedule_swapped_counts_the_seats_of_samples_not_yet_forked(impl):
    scheduler, seqs, inputs = running_set(max_num_seqs=3)
    first, group = seqs[0], seqs[1:]
    for seq in group:  # request r is dropped: a new request p takes its place, its prompt half computed
        scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
    del scheduler.requests["r"]
    parent = Sequence(0, PROMPT, arrival=1)
    parent.request_id, parent.fork_seq_ids = "p", [1, 2]
    assert scheduler.kv_cache_manager.allocate_slots(parent, 8) is not None
    parent.num_computed_tokens = 8
    scheduler.requests["p"] = [parent]
    scheduler.add_running(parent)
    scheduler._preempt_by_swap([parent], SchedulerOutput(num_computed_tokens=[]), {})
    inputs = (f"block_size {BLOCK_SIZE}, 16 device blocks, max_num_seqs 3; seq 5 runs (1 seat); swapped out: seq 0, "
              "the first sample of a request of n=3 whose 10-token prompt is 8 tokens in (samples 1 and 2 are forked "
              "once it is in); a new step, budget 64")
    out = SchedulerOutput(num_computed_tokens=[])
    left = run_swapped(impl, scheduler, out, 64, inputs)
    expect_equal((swapped_ids(scheduler), [s.seq_id for s in scheduler.running], left), ([[0]], [5], 0),
                 inputs=f"{inputs}; (the groups still out, running afterwards, the budget left)")


@pytest.mark.exercise("schedule_swapped")
def test_schedule_swapped_with_nothing_out_leaves_the_whole_budget(impl):
    scheduler, _, inputs = running_set()
    out = SchedulerOutput(num_computed_tokens=[])
    left = run_swapped(impl, scheduler, out, 64, inputs + "; nothing swapped out; a new step, budget 64")
    expect_equal(left, 64, inputs=f"{inputs}; nothing swapped out; the budget left to admissions")


# --- prepare_store ----------------------------------------------------------------------------------------------------


def host_ids(offloading: CPUOffloadingManager, hashes: list[bytes]) -> list[int | None]:
    """The host block holding each hash, or None."""
    return [None if (b := offloading.host_pool.get_cached_block(h)) is None else b.block_id for h in hashes]


def run_store(impl, offloading: CPUOffloadingManager, evicted: list[tuple[int, bytes]], inputs: str):
    """`prepare_store` as `take_transfers` calls it; returns the step's (stores, loads)."""
    with exercising("prepare_store", inputs):
        impl.prepare_store(offloading, evicted)
    return offloading.take_transfers()


@pytest.mark.exercise("prepare_store")
def test_prepare_store_copies_each_evicted_block_under_its_hash(impl):
    offloading = CPUOffloadingManager(4)
    inputs = "an empty 4-block host tier; the device evicted (10, a), (11, b) this step"
    stores, _ = run_store(impl, offloading, [(10, b"a"), (11, b"b")], inputs)
    a, b = host_ids(offloading, [b"a", b"b"])
    expect_equal((stores, a != b), ([(10, a), (11, b)], True),
                 inputs=f"{inputs}; (the stores (device, host), two different host blocks)")
    expect_equal(offloading.stats.num_blocks_stored, 2, inputs=f"{inputs}; stats.num_blocks_stored")
    offloading.complete_transfers()
    expect_equal([blk.ref_cnt for blk in offloading.host_pool.blocks], [0] * 4,
                 inputs=f"{inputs}; host ref_cnts once the step has run")


@pytest.mark.exercise("prepare_store")
def test_prepare_store_refreshes_a_hash_the_host_holds_without_copying_it(impl):
    offloading = host_holding([0, 1, 2], num_host_blocks=3)  # full; block 0 the least recently used
    inputs = "a full 3-block host tier holding prompt blocks 0, 1, 2 (stored in that order)"
    stores, _ = run_store(impl, offloading, [(7, HASHES[0])], f"{inputs}; the device evicted (7, block 0's hash)")
    expect_equal(stores, [], inputs=f"{inputs}; the device evicted (7, block 0's hash); the stores (the host has it)")
    offloading.complete_transfers()
    stores, _ = run_store(impl, offloading, [(8, b"new")], f"{inputs}; then, a step later, (8, a new hash)")
    expect_equal(host_ids(offloading, HASHES[:3]).count(None), 1, inputs=f"{inputs}; blocks lost to the new one")
    expect_equal(host_ids(offloading, HASHES[:3])[1], None,
                 inputs=f"{inputs}; the device evicted block 0's hash again, then a step later a new hash: the host "
                 "block it overwrites is block 1's (block 0 was just used again)")


@pytest.mark.exercise("prepare_store")
def test_prepare_store_overwrites_the_least_recently_used_block(impl):
    offloading = host_holding([0, 1, 2], num_host_blocks=3)
    inputs = "a full 3-block host tier holding prompt blocks 0, 1, 2 (stored in that order); the device evicted (8, x)"
    stores, _ = run_store(impl, offloading, [(8, b"new")], inputs)
    expect_equal((host_ids(offloading, HASHES[:3]), stores), ([None, 1, 2], [(8, 0)]),
                 inputs=f"{inputs}; (the host blocks of prompt blocks 0-2, the stores)")


@pytest.mark.exercise("prepare_store")
def test_prepare_store_drops_a_store_when_every_host_block_is_held(impl):
    offloading = CPUOffloadingManager(2)
    inputs = "an empty 2-block host tier; the device evicted (10, a), (11, b), (12, c) in one step"
    stores, _ = run_store(impl, offloading, [(10, b"a"), (11, b"b"), (12, b"c")], inputs)
    expect_equal(([d for d, _ in stores], host_ids(offloading, [b"a", b"b", b"c"])), ([10, 11], [0, 1, None]),
                 inputs=f"{inputs}; (the devices blocks stored, the host blocks of a, b, c): the two host blocks are "
                 "being written this step, so c is not stored")


@pytest.mark.exercise("prepare_store")
def test_prepare_store_never_overwrites_a_block_loaded_this_step(impl):
    offloading = host_holding([0, 1], num_host_blocks=2)  # block 0 the least recently used
    offloading.prepare_load([HASHES[0]], [5])  # a hit admitted this step: host block 0 is read this step
    inputs = "a full 2-block host tier holding prompt blocks 0, 1; block 0 loaded this step; the device evicted (8, x)"
    stores, loads = run_store(impl, offloading, [(8, b"new")], inputs)
    expect_equal((host_ids(offloading, HASHES[:2]), stores, loads), ([0, None], [(8, 1)], [(0, 5)]),
                 inputs=f"{inputs}; (the host blocks of prompt blocks 0-1, the stores, the loads)")


# --- get_num_new_matched_tokens ---------------------------------------------------------------------------------------

HASHES = [bytes([i]) * 8 for i in range(6)]  # stand-ins for the chained hashes of a prompt's blocks 0-5


def host_holding(blocks: list[int], num_host_blocks: int = 4) -> CPUOffloadingManager:
    """A host tier that stored the prompt's `blocks` (evicted from the device in an earlier step)."""
    offloading = CPUOffloadingManager(num_host_blocks)
    reference_prepare_store(offloading, [(i, HASHES[i]) for i in blocks])
    offloading.take_transfers()
    offloading.complete_transfers()
    offloading.stats.queries = offloading.stats.hits = 0
    return offloading


def matched(impl, offloading, num_tokens: int, num_computed: int, host_blocks: list[int]) -> tuple[int, str]:
    inputs = (f"block_size {BLOCK_SIZE}, a prompt of {num_tokens} tokens, the device's prefix hits cover "
              f"{num_computed} tokens, the host holds blocks {host_blocks}")
    with exercising("get_num_new_matched_tokens", inputs):
        got = impl.get_num_new_matched_tokens(offloading, HASHES[: num_tokens // BLOCK_SIZE], num_tokens,
                                              num_computed, BLOCK_SIZE)
    return got, inputs


@pytest.mark.exercise("get_num_new_matched_tokens")
def test_lookup_counts_the_host_run_after_the_devices_hits(impl):
    offloading = host_holding([1, 2])
    got, inputs = matched(impl, offloading, 17, 4, [1, 2])
    expect_equal(got, 8, inputs=f"{inputs}; tokens found on the host (blocks 1 and 2)")
    offloading = host_holding([0, 1, 2])
    got, inputs = matched(impl, offloading, 17, 8, [0, 1, 2])
    expect_equal(got, 4, inputs=f"{inputs}; tokens found on the host (block 2; blocks 0-1 are the device's)")


@pytest.mark.exercise("get_num_new_matched_tokens")
def test_lookup_stops_at_the_first_host_miss(impl):
    offloading = host_holding([0, 2, 3])
    got, inputs = matched(impl, offloading, 17, 0, [0, 2, 3])
    expect_equal(got, 4, inputs=f"{inputs}; tokens found on the host (block 0; block 1 is missing, so 2-3 follow "
                 "a hole and cannot be used)")
    got, inputs = matched(impl, host_holding([1, 2]), 17, 0, [1, 2])
    expect_equal(got, 0, inputs=f"{inputs}; tokens found on the host (block 0 is missing)")


@pytest.mark.exercise("get_num_new_matched_tokens")
def test_lookup_never_covers_the_last_token(impl):
    offloading = host_holding([0, 1, 2, 3])
    got, inputs = matched(impl, offloading, 16, 0, [0, 1, 2, 3])
    expect_equal(got, 12, inputs=f"{inputs}; tokens found on the host (block 3 holds the last token, which the "
                 "forward pass must compute to sample from)")
    got, inputs = matched(impl, host_holding([0, 1, 2, 3]), 17, 0, [0, 1, 2, 3])
    expect_equal(got, 16, inputs=f"{inputs}; tokens found on the host (the last token, 16, starts block 4)")


@pytest.mark.exercise("get_num_new_matched_tokens")
def test_lookup_marks_its_hits_most_recently_used(impl):
    offloading = host_holding([0, 1, 2, 3])  # full, stored in this order: block 0 is the least recently used
    got, inputs = matched(impl, offloading, 13, 0, [0, 1, 2, 3])
    reference_prepare_store(offloading, [(9, b"new block")])  # a later step's eviction takes the LRU host block
    lru = [h for h in HASHES[:4] if offloading.host_pool.get_cached_block(h) is None]
    expect_equal(lru, [HASHES[3]], inputs=f"{inputs}; then a store into the full host: the prompt block it evicts "
                 "(blocks 0-2 were just hit, so block 3 is now the least recently used)")


@pytest.mark.exercise("get_num_new_matched_tokens")
def test_lookup_holds_nothing_a_load_holds_and_the_step_releases(impl):
    offloading = host_holding([0, 1, 2, 3])
    got, inputs = matched(impl, offloading, 13, 0, [0, 1, 2, 3])
    expect_equal([b.ref_cnt for b in offloading.host_pool.blocks], [0] * 4,
                 inputs=f"{inputs}; host ref_cnts after the lookup (the sequence may not be admitted: a block that "
                 "will not be loaded must not be held)")
    update_state_after_alloc(offloading, HASHES, [4, 5, 6, 7], 0, got, BLOCK_SIZE)  # admitted: the scheduler loads
    offloading.take_transfers()
    offloading.complete_transfers()  # the step has run
    expect_equal([b.ref_cnt for b in offloading.host_pool.blocks], [0] * 4,
                 inputs=f"{inputs}; then loaded and the step run: host ref_cnts")


@pytest.mark.exercise("get_num_new_matched_tokens")
def test_lookup_counts_queries_and_hits_in_tokens(impl):
    offloading = host_holding([1])
    got, inputs = matched(impl, offloading, 14, 4, [1])
    expect_equal((offloading.stats.queries, offloading.stats.hits), (10, 4),
                 inputs=f"{inputs}; (stats.queries, stats.hits): the 10 tokens past the device's hits, 4 found")


# --- every exercise against the reference, on generated workloads ----------------------------------------------------


HOST_TIER_EXERCISES = ("prepare_store", "get_num_new_matched_tokens")


@st.composite
def swapping_workloads(draw, host_tier: bool) -> tuple[Callable[[list[RequestSpec]], SchedulerWorld], list, str]:
    """A swapping scheduler on a small device pool (with `host_tier`, a host tier too: prefix caching on) and a
    generated workload for it: preemptions, swaps, forks, aborts and prefix hits happen on their own. Returns (the
    world of a workload, the workload, the setting in words)."""
    num_device = draw(st.integers(8, 16) if host_tier else st.integers(8, 12))
    num_swap = draw(st.integers(1, 16))
    caching = True if host_tier else draw(st.booleans())
    num_offload = draw(st.integers(1, 8)) if host_tier else 0
    policy, max_num_seqs = draw(st.sampled_from(SchedulingPolicy)), draw(st.integers(2, 8))
    budget = draw(st.integers(2, 24))

    def make_world(specs: list[RequestSpec]) -> SchedulerWorld:
        manager = KVCacheManager(num_device, BLOCK_SIZE, enable_prefix_caching=caching)
        manager.enable_swapping(num_swap)
        if num_offload:
            manager.enable_offloading(num_offload)
        scheduler = SwappingScheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                      long_prefill_token_threshold=budget, policy=policy, max_model_len=64)
        return SchedulerWorld(scheduler, specs)

    inputs = (f"block_size {BLOCK_SIZE}, {num_device} device blocks, a swap pool of {num_swap}, a host tier of "
              f"{num_offload} blocks, prefix caching {caching}, policy {policy.name}, max_num_seqs {max_num_seqs}, "
              f"budget {budget}")
    return make_world, draw(request_specs(last_arrival=10 if host_tier else 3)), inputs


test_each_exercise_leaves_the_references_state_on_generated_workloads = differential_test(
    REFERENCE, tuple(REFERENCE), lambda exercise: swapping_workloads(exercise in HOST_TIER_EXERCISES)
)


# --- capstone: your swaps, your scheduler's choice and your lookup in the engine, on SmolLM2 --------------------------

CAPSTONE_BLOCK_SIZE = 8
CAPSTONE_IDS = [0, 3, 4, 6]  # chat prompts 0, 4, 6 share the template's system prompt
CAPSTONE_N = {0: 2, 4: 2}  # requests with two samples each (greedy: both give Hugging Face's tokens)
CAPSTONE_TOKENS = 16
CAPSTONE_KV_BLOCKS = 16  # too few for the batch: a preemption storm
CAPSTONE_SWAP_BLOCKS = 8  # room on the host for some groups, not all: some are swapped, some recomputed
OFFLOAD_FIRST, OFFLOAD_BETWEEN = [0, 2], [3, 4]  # run, evicted by other prompts, run again: prefixes on the host
OFFLOAD_KV_BLOCKS, OFFLOAD_TOKENS = 12, 8  # OFFLOAD_FIRST fills the device pool
OFFLOAD_HOST_BLOCKS = 2  # fewer than a step of OFFLOAD_BETWEEN evicts: the host tier must choose
# What the reference engine's host tier supplies in that run: one block of prompt 0. (Prompt 2's next block is evicted
# while the last batch is being scheduled, and a block is stored when its step is decided: too late for that step.)
# The stored constant is the reference's: `pytest --impl=reference` and the notebook's nbval run hold it to it.
OFFLOAD_HITS = 8


def host_gib(num_blocks: int) -> float:
    """GiB of host memory for `num_blocks` of SmolLM2's blocks (what `swap_space` and `kv_offloading_size` take)."""
    return num_blocks * KVCache.bytes_per_block(smollm2()[0].config, CAPSTONE_BLOCK_SIZE) / 2**30


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


def capstone_swap_run() -> tuple[list[list[list[int]]], int, int, int, int]:
    """The CAPSTONE_IDS prompts in one batch on a fresh engine that swaps: (tokens per request per sample, sequences
    preempted, sequences swapped out, device blocks in use at the end, host blocks in use at the end)."""
    engine = LLMEngine.from_engine_args(EngineArgs(
        model="smollm2-135m", block_size=CAPSTONE_BLOCK_SIZE, max_num_seqs=8, max_model_len=256,
        num_kv_blocks=CAPSTONE_KV_BLOCKS, preemption_mode="swap", swap_space=host_gib(CAPSTONE_SWAP_BLOCKS),
    ))
    requests = [(CAPSTONE_PROMPTS[i], greedy(CAPSTONE_TOKENS, CAPSTONE_N.get(i, 1))) for i in CAPSTONE_IDS]
    outputs = generate_batch(engine, requests)
    scheduler = engine.engine_core.scheduler
    tokens = [[sample.token_ids for sample in output.outputs] for output in outputs]
    host = scheduler.kv_cache_manager.swap_pool
    return tokens, engine.stats.num_preemptions, engine.stats.num_swapped_out, \
        scheduler.kv_cache_manager.num_used_blocks, len(host.blocks) - host.num_free_blocks


def capstone_offload_run() -> tuple[list[list[int]], int, int]:
    """OFFLOAD_FIRST, then OFFLOAD_BETWEEN, then OFFLOAD_FIRST again on an engine whose small device pool evicts
    the first prompts' blocks to a host tier: (the tokens of the last batch, tokens the host tier supplied, host
    blocks still held at the end)."""
    engine = LLMEngine.from_engine_args(EngineArgs(
        model="smollm2-135m", block_size=CAPSTONE_BLOCK_SIZE, max_num_seqs=8, max_model_len=256,
        num_kv_blocks=OFFLOAD_KV_BLOCKS, kv_offloading_size=host_gib(OFFLOAD_HOST_BLOCKS),
    ))
    for ids in (OFFLOAD_FIRST, OFFLOAD_BETWEEN):
        generate_batch(engine, [(CAPSTONE_PROMPTS[i], greedy(OFFLOAD_TOKENS)) for i in ids])
    outputs = generate_batch(engine, [(CAPSTONE_PROMPTS[i], greedy(OFFLOAD_TOKENS)) for i in OFFLOAD_FIRST])
    host = engine.engine_core.scheduler.kv_cache_manager.offloading.host_pool
    held = sum(block.ref_cnt > 0 for block in host.blocks)
    return [output.outputs[0].token_ids for output in outputs], engine.stats.external_prefix_cache_hits, held


@pytest.mark.exercise("capstone")
@pytest.mark.timeout(300)  # a real model, three engines: seconds on an idle 2-core machine
def test_capstone_swapping_and_the_host_tier_on_smollm2_give_hugging_faces_tokens(impl):
    inputs = (f"SmolLM2-135M, block_size {CAPSTONE_BLOCK_SIZE}, {CAPSTONE_KV_BLOCKS} device blocks, "
              f"preemption_mode='swap' with {CAPSTONE_SWAP_BLOCKS} host blocks; CAPSTONE_PROMPTS{CAPSTONE_IDS} in one "
              f"batch (n = 2 for prompts {sorted(CAPSTONE_N)}), greedy, {CAPSTONE_TOKENS} tokens each")
    with swap_in(impl, REFERENCE):  # your choices in the scheduler, your lookup at admission
        tokens, preempted, swapped_out, device_used, host_used = capstone_swap_run()
        offload_tokens, hits, held = capstone_offload_run()
    for request, i in zip(tokens, CAPSTONE_IDS, strict=True):
        expect_equal(request, [smollm2_greedy(i, CAPSTONE_TOKENS)] * CAPSTONE_N.get(i, 1),
                     inputs=f"{inputs}; the greedy tokens of prompt {i}'s samples (oracle: Hugging Face greedy)")
    assert 0 < swapped_out < preempted, (f"{inputs}: {swapped_out} of {preempted} preempted sequences swapped out; "
                                         "the storm should swap some groups and recompute others")
    expect_equal((device_used, host_used), (0, 0),
                 inputs=f"{inputs}; (device, host) blocks in use after every request finished")
    inputs = (f"SmolLM2-135M, {OFFLOAD_KV_BLOCKS} device blocks and a {OFFLOAD_HOST_BLOCKS}-block host tier; prompts "
              f"{OFFLOAD_FIRST}, then {OFFLOAD_BETWEEN}, then {OFFLOAD_FIRST} again (their prefixes evicted to the "
              f"host), {OFFLOAD_TOKENS} greedy tokens each")
    for output, i in zip(offload_tokens, OFFLOAD_FIRST, strict=True):
        expect_equal(output, smollm2_greedy(i, OFFLOAD_TOKENS),
                     inputs=f"{inputs}; the last run's greedy tokens of prompt {i} (oracle: Hugging Face greedy)")
    expect_equal(hits, OFFLOAD_HITS, inputs=f"{inputs}; tokens the host tier supplied (oracle: the reference engine)")
    expect_equal(held, 0, inputs=f"{inputs}; host-tier blocks still held after every request finished")
    assert hits > 0, f"{inputs}: the host tier supplied nothing"

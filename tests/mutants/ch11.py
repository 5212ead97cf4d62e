"""Plausible wrong answers to chapter 11's exercises; each must fail at least one test of its exercise."""

from solutions.core.sched.output import SchedulerOutput
from solutions.core.sched.request_queue import SchedulingPolicy
from solutions.core.sched.scheduler import SchedulerBase, select_victim
from solutions.core.sched.swapping_scheduler import PreemptionMode
from solutions.core.sequence import Sequence
from solutions.kv_offload.manager import CPUOffloadingManager
from solutions.kv_offload.swap import num_group_blocks

# --- select_preemption ----------------------------------------------------------------------------------------------


def _mode(scheduler: SchedulerBase, group: list[Sequence], *, host: int | None = None, way_back: int = 0,
          check_way_back: bool = True) -> PreemptionMode:
    num_blocks = num_group_blocks(group)
    host = scheduler.kv_cache_manager.swap_pool.num_free_blocks if host is None else host
    fits = num_blocks <= host and (not check_way_back
                                   or num_blocks + len(group) + way_back <= scheduler.kv_cache_manager.num_blocks)
    return PreemptionMode.SWAP if fits else PreemptionMode.RECOMPUTE


def select_preemption_victim_alone(scheduler: SchedulerBase) -> tuple[list[Sequence], PreemptionMode]:
    """The victim without its sister samples: the group is split (its shared blocks stay on the device, held by
    the sisters, and come back apart)."""
    group = [select_victim(scheduler)]
    return group, _mode(scheduler, group)


def select_preemption_every_sample_of_the_request(scheduler: SchedulerBase) -> tuple[list[Sequence], PreemptionMode]:
    """The group is every sample the request ever had, finished (or already out) ones included."""
    victim = select_victim(scheduler)
    group = list(scheduler.requests.get(victim.request_id, [victim]))
    return group, _mode(scheduler, group)


def select_preemption_latest_arrival_anywhere(scheduler: SchedulerBase) -> tuple[list[Sequence], PreemptionMode]:
    """The latest request to arrive, whether it runs, waits or is swapped out already."""
    seqs = [seq for samples in scheduler.requests.values() for seq in samples if not seq.is_finished]
    victim = max(seqs, key=lambda s: (s.arrival, s.seq_id))
    group = [s for s in seqs if s.request_id == victim.request_id]
    return group, _mode(scheduler, group)


def select_preemption_always_swaps(scheduler: SchedulerBase) -> tuple[list[Sequence], PreemptionMode]:
    """Never asks whether the host has room (or the group a way back): a full host pool fails the swap-out."""
    return scheduler.group_of(select_victim(scheduler)), PreemptionMode.SWAP


def select_preemption_host_pool_size(scheduler: SchedulerBase) -> tuple[list[Sequence], PreemptionMode]:
    """Compares the group with the host pool's size, not its free blocks: another group out already is forgotten."""
    group = scheduler.group_of(select_victim(scheduler))
    return group, _mode(scheduler, group, host=scheduler.kv_cache_manager.swap_pool.num_blocks)


def select_preemption_strict_host_room(scheduler: SchedulerBase) -> tuple[list[Sequence], PreemptionMode]:
    """Wants a spare host block: a host pool of exactly the group's blocks is refused."""
    group = scheduler.group_of(select_victim(scheduler))
    return group, _mode(scheduler, group, host=scheduler.kv_cache_manager.swap_pool.num_free_blocks - 1)


def select_preemption_ignores_the_way_back(scheduler: SchedulerBase) -> tuple[list[Sequence], PreemptionMode]:
    """Checks the host only: swaps out a group too large for the device ever to take back."""
    group = scheduler.group_of(select_victim(scheduler))
    return group, _mode(scheduler, group, check_way_back=False)


def select_preemption_strict_way_back(scheduler: SchedulerBase) -> tuple[list[Sequence], PreemptionMode]:
    """Wants a spare device block beyond the group's blocks and one per sample: exactly enough is refused."""
    group = scheduler.group_of(select_victim(scheduler))
    return group, _mode(scheduler, group, way_back=1)


def select_preemption_free_device_blocks(scheduler: SchedulerBase) -> tuple[list[Sequence], PreemptionMode]:
    """Asks the way back of the device's free blocks now (all but none, mid-preemption) instead of its size."""
    group = scheduler.group_of(select_victim(scheduler))
    num_blocks = num_group_blocks(group)
    fits = (num_blocks <= scheduler.kv_cache_manager.swap_pool.num_free_blocks
            and num_blocks + len(group) <= scheduler.kv_cache_manager.num_free_blocks)
    return group, PreemptionMode.SWAP if fits else PreemptionMode.RECOMPUTE



def select_preemption_first_samples_blocks(scheduler: SchedulerBase) -> tuple[list[Sequence], PreemptionMode]:
    """Counts the group's blocks as one sample's table, as if the samples shared every block: once they have
    diverged after the fork, each holds blocks of its own, and the host pool is asked for too few."""
    group = scheduler.group_of(select_victim(scheduler))
    num_blocks = len(group[0].block_table)
    fits = num_blocks <= scheduler.kv_cache_manager.swap_pool.num_free_blocks
    back = num_blocks + len(group) <= scheduler.kv_cache_manager.num_blocks
    return group, PreemptionMode.SWAP if fits and back else PreemptionMode.RECOMPUTE


def select_preemption_latest_arrival_runs(scheduler: SchedulerBase) -> tuple[list[Sequence], PreemptionMode]:
    """Takes the running request that arrived last, not the one that started running last: an early arrival
    resumed behind later ones is spared."""
    victim = max(scheduler.running, key=lambda s: (s.arrival, s.seq_id))
    if scheduler.policy is not SchedulingPolicy.FCFS:
        victim = select_victim(scheduler)
    group = scheduler.group_of(victim)
    return group, _mode(scheduler, group)

# --- schedule_swapped -----------------------------------------------------------------------------------------------


def _bring_back(scheduler: SchedulerBase, out: SchedulerOutput, budget: int, copies: dict[int, list[tuple[int, int]]],
                *, when_preempted: bool = False, per_seq: int = 1, seats: bool = True, skip: bool = False,
                newest_first: bool = False, room: bool = True, gate: bool = True) -> int:
    manager = scheduler.kv_cache_manager
    while scheduler.swapped and budget > 0 and (when_preempted or not out.preempted_seq_ids):
        queue = scheduler.swapped[::-1] if newest_first else list(scheduler.swapped)
        fitting = [g for g in queue if (not room or num_group_blocks(g) + per_seq * len(g) <= manager.num_free_blocks)
                   and (not seats or scheduler._num_seats() + len(g) <= scheduler.max_num_seqs)]
        if not fitting or (not skip and fitting[0] is not queue[0]):
            break
        budget = scheduler._swap_in_group(fitting[0], out, budget, copies)
    return 0 if gate and scheduler.swapped else budget


def schedule_swapped_admits_while_a_group_is_out(scheduler: SchedulerBase, out: SchedulerOutput, budget: int,
                                                copies: dict[int, list[tuple[int, int]]]) -> int:
    """Leaves the rest of the budget to new admissions though a group is still out: they take its blocks."""
    return _bring_back(scheduler, out, budget, copies, gate=False)


def schedule_swapped_in_a_step_that_preempted(scheduler: SchedulerBase, out: SchedulerOutput, budget: int,
                                              copies: dict[int, list[tuple[int, int]]]) -> int:
    """Brings groups back in a step that has just preempted: the memory freed for the running goes back out."""
    return _bring_back(scheduler, out, budget, copies, when_preempted=True)


def schedule_swapped_without_room_for_the_next_tokens(scheduler: SchedulerBase, out: SchedulerOutput, budget: int,
                                                      copies: dict[int, list[tuple[int, int]]]) -> int:
    """Asks room for the group's blocks only: the samples come back with no block for their next token."""
    return _bring_back(scheduler, out, budget, copies, per_seq=0)


def schedule_swapped_ignores_the_room(scheduler: SchedulerBase, out: SchedulerOutput, budget: int,
                                      copies: dict[int, list[tuple[int, int]]]) -> int:
    """Brings the oldest group back whatever the free device blocks: the swap-in runs out of blocks."""
    return _bring_back(scheduler, out, budget, copies, room=False)


def schedule_swapped_jumps_the_queue(scheduler: SchedulerBase, out: SchedulerOutput, budget: int,
                                     copies: dict[int, list[tuple[int, int]]]) -> int:
    """Passes over a group that does not fit to one that does: small groups keep the oldest out for ever."""
    return _bring_back(scheduler, out, budget, copies, skip=True)


def schedule_swapped_newest_first(scheduler: SchedulerBase, out: SchedulerOutput, budget: int,
                                  copies: dict[int, list[tuple[int, int]]]) -> int:
    """Brings the group that went out last back first."""
    return _bring_back(scheduler, out, budget, copies, newest_first=True)


def schedule_swapped_ignores_the_seats(scheduler: SchedulerBase, out: SchedulerOutput, budget: int,
                                       copies: dict[int, list[tuple[int, int]]]) -> int:
    """Never counts seats: the running set grows past `max_num_seqs`."""
    return _bring_back(scheduler, out, budget, copies, seats=False)



def schedule_swapped_seats_without_forks(scheduler: SchedulerBase, out: SchedulerOutput, budget: int,
                                         copies: dict[int, list[tuple[int, int]]]) -> int:
    """Counts one seat per sequence of the group: a parent swapped out before it forked brings its samples in past
    `max_num_seqs`."""
    manager = scheduler.kv_cache_manager
    while scheduler.swapped and budget > 0 and not out.preempted_seq_ids:
        group = scheduler.swapped[0]
        if num_group_blocks(group) + len(group) > manager.num_free_blocks:
            break
        if scheduler._num_seats() + len(group) > scheduler.max_num_seqs:
            break
        budget = scheduler._swap_in_group(group, out, budget, copies)
    return 0 if scheduler.swapped else budget


def schedule_swapped_with_no_budget(scheduler: SchedulerBase, out: SchedulerOutput, budget: int,
                                    copies: dict[int, list[tuple[int, int]]]) -> int:
    """Brings groups back though the step's budget is spent: they hold their blocks and seats without running."""
    return _bring_back(scheduler, out, budget + 1, copies) - 1 if budget == 0 else _bring_back(
        scheduler, out, budget, copies)

# --- prepare_store ------------------------------------------------------------------------------------------------


def _store(offloading: CPUOffloadingManager, evicted: list[tuple[int, bytes]], *, dedupe: bool = True,
           refresh: bool = True, room: bool = True) -> None:
    for device_block_id, block_hash in evicted:
        if dedupe and offloading.host_pool.get_cached_block(block_hash) is not None:
            if refresh:
                offloading.touch([block_hash])
            continue
        if room and offloading.host_pool.num_free_blocks == 0:
            continue
        (host,) = offloading.host_pool.get_new_blocks(1)
        offloading.host_pool.cache_full_block(host, block_hash)
        offloading.queue_store(device_block_id, host)


def prepare_store_copies_a_stored_hash_again(offloading: CPUOffloadingManager,
                                             evicted: list[tuple[int, bytes]]) -> None:
    """Stores every evicted block, though the host may hold its hash already: another host block, copied for nothing."""
    _store(offloading, evicted, dedupe=False)


def prepare_store_does_not_refresh_a_stored_hash(offloading: CPUOffloadingManager,
                                                 evicted: list[tuple[int, bytes]]) -> None:
    """Skips a hash the host holds but leaves its LRU place: the block the device used last is the next overwritten."""
    _store(offloading, evicted, refresh=False)


def prepare_store_without_room_check(offloading: CPUOffloadingManager, evicted: list[tuple[int, bytes]]) -> None:
    """Takes a host block for every store: with every host block held this step, the pool has none to give."""
    _store(offloading, evicted, room=False)


def prepare_store_releases_at_once(offloading: CPUOffloadingManager, evicted: list[tuple[int, bytes]]) -> None:
    """Queues the copy but does not hold the host block: a later store in the same step may take it again."""
    for device_block_id, block_hash in evicted:
        if offloading.host_pool.get_cached_block(block_hash) is not None:
            offloading.touch([block_hash])
            continue
        (host,) = offloading.host_pool.get_new_blocks(1)
        offloading.host_pool.cache_full_block(host, block_hash)
        offloading._stores.append((device_block_id, host.block_id))
        offloading.stats.num_blocks_stored += 1
        offloading.host_pool.free_blocks([host])


def prepare_store_never_overwrites(offloading: CPUOffloadingManager, evicted: list[tuple[int, bytes]]) -> None:
    """Stores only into host blocks that hold nothing yet: once the host is full, it keeps its oldest for ever."""
    for device_block_id, block_hash in evicted:
        if offloading.host_pool.get_cached_block(block_hash) is not None:
            offloading.touch([block_hash])
            continue
        lru = offloading.host_pool.free_block_queue.head.next_free_block
        if offloading.host_pool.num_free_blocks == 0 or lru.block_hash is not None:
            continue
        (host,) = offloading.host_pool.get_new_blocks(1)
        offloading.host_pool.cache_full_block(host, block_hash)
        offloading.queue_store(device_block_id, host)


# --- get_num_new_matched_tokens -------------------------------------------------------------------------------------


def _lookup(offloading: CPUOffloadingManager, hashes: list[bytes], first: int, last: int, *, past_misses: bool = False,
            touch: bool = True, hold: bool = False) -> list[bytes]:
    if past_misses:
        hits = [h for h in hashes[first:last] if offloading.host_pool.get_cached_block(h) is not None]
    else:
        hits = hashes[first : first + offloading.lookup(hashes[first:last])]
    if touch:
        offloading.touch(hits)
    if hold:
        offloading.host_pool.touch([offloading.host_pool.get_cached_block(h) for h in hits])
    return hits


def _count(offloading: CPUOffloadingManager, hits: list[bytes], num_tokens: int, num_computed_tokens: int,
           block_size: int) -> int:
    offloading.stats.queries += num_tokens - num_computed_tokens
    offloading.stats.hits += len(hits) * block_size
    return len(hits) * block_size


def lookup_past_the_first_miss(offloading: CPUOffloadingManager, block_hashes: list[bytes], num_tokens: int,
                               num_computed_tokens: int, block_size: int) -> int:
    """Counts every block the host holds, holes included: the tokens after a hole have no K/V to load."""
    first, last = num_computed_tokens // block_size, (num_tokens - 1) // block_size
    hits = _lookup(offloading, block_hashes, first, last, past_misses=True)
    return _count(offloading, hits, num_tokens, num_computed_tokens, block_size)


def lookup_covers_the_last_token(offloading: CPUOffloadingManager, block_hashes: list[bytes], num_tokens: int,
                                 num_computed_tokens: int, block_size: int) -> int:
    """Lets the run reach the last token's block: the step would have nothing to compute and nothing to sample."""
    first, last = num_computed_tokens // block_size, num_tokens // block_size
    hits = _lookup(offloading, block_hashes, first, last)
    return _count(offloading, hits, num_tokens, num_computed_tokens, block_size)


def lookup_does_not_touch_the_hits(offloading: CPUOffloadingManager, block_hashes: list[bytes], num_tokens: int,
                                   num_computed_tokens: int, block_size: int) -> int:
    """Finds the hits but leaves the LRU order as it was: the prefix just used is the next the host overwrites."""
    first, last = num_computed_tokens // block_size, (num_tokens - 1) // block_size
    hits = _lookup(offloading, block_hashes, first, last, touch=False)
    return _count(offloading, hits, num_tokens, num_computed_tokens, block_size)


def lookup_holds_the_hits(offloading: CPUOffloadingManager, block_hashes: list[bytes], num_tokens: int,
                          num_computed_tokens: int, block_size: int) -> int:
    """Holds the hits (one more reference each) at the lookup: a sequence that is then not admitted, or the load's
    own hold, leaves them held for ever."""
    first, last = num_computed_tokens // block_size, (num_tokens - 1) // block_size
    hits = _lookup(offloading, block_hashes, first, last, hold=True)
    return _count(offloading, hits, num_tokens, num_computed_tokens, block_size)


def lookup_from_the_first_block(offloading: CPUOffloadingManager, block_hashes: list[bytes], num_tokens: int,
                                num_computed_tokens: int, block_size: int) -> int:
    """Starts at block 0 instead of after the device's hits: counts (and loads over) blocks the device has."""
    last = (num_tokens - 1) // block_size
    hits = _lookup(offloading, block_hashes, 0, last)
    return _count(offloading, hits, num_tokens, num_computed_tokens, block_size)


def lookup_counts_every_prompt_token(offloading: CPUOffloadingManager, block_hashes: list[bytes], num_tokens: int,
                                     num_computed_tokens: int, block_size: int) -> int:
    """Right answer, wrong statistics: counts the whole prompt as queried, the device's hits included."""
    first, last = num_computed_tokens // block_size, (num_tokens - 1) // block_size
    hits = _lookup(offloading, block_hashes, first, last)
    return _count(offloading, hits, num_tokens, 0, block_size)


MUTANTS = {
    "select_preemption_victim_alone": {"select_preemption": select_preemption_victim_alone},
    "select_preemption_every_sample_of_the_request":
        {"select_preemption": select_preemption_every_sample_of_the_request},
    "select_preemption_latest_arrival_anywhere": {"select_preemption": select_preemption_latest_arrival_anywhere},
    "select_preemption_always_swaps": {"select_preemption": select_preemption_always_swaps},
    "select_preemption_host_pool_size": {"select_preemption": select_preemption_host_pool_size},
    "select_preemption_strict_host_room": {"select_preemption": select_preemption_strict_host_room},
    "select_preemption_ignores_the_way_back": {"select_preemption": select_preemption_ignores_the_way_back},
    "select_preemption_strict_way_back": {"select_preemption": select_preemption_strict_way_back},
    "select_preemption_free_device_blocks": {"select_preemption": select_preemption_free_device_blocks},
    "select_preemption_first_samples_blocks": {"select_preemption": select_preemption_first_samples_blocks},
    "select_preemption_latest_arrival_runs": {"select_preemption": select_preemption_latest_arrival_runs},
    "schedule_swapped_seats_without_forks": {"schedule_swapped": schedule_swapped_seats_without_forks},
    "schedule_swapped_with_no_budget": {"schedule_swapped": schedule_swapped_with_no_budget},
    "schedule_swapped_admits_while_a_group_is_out": {"schedule_swapped": schedule_swapped_admits_while_a_group_is_out},
    "schedule_swapped_in_a_step_that_preempted": {"schedule_swapped": schedule_swapped_in_a_step_that_preempted},
    "schedule_swapped_without_room_for_the_next_tokens":
        {"schedule_swapped": schedule_swapped_without_room_for_the_next_tokens},
    "schedule_swapped_ignores_the_room": {"schedule_swapped": schedule_swapped_ignores_the_room},
    "schedule_swapped_jumps_the_queue": {"schedule_swapped": schedule_swapped_jumps_the_queue},
    "schedule_swapped_newest_first": {"schedule_swapped": schedule_swapped_newest_first},
    "schedule_swapped_ignores_the_seats": {"schedule_swapped": schedule_swapped_ignores_the_seats},
    "prepare_store_copies_a_stored_hash_again": {"prepare_store": prepare_store_copies_a_stored_hash_again},
    "prepare_store_does_not_refresh_a_stored_hash": {"prepare_store": prepare_store_does_not_refresh_a_stored_hash},
    "prepare_store_without_room_check": {"prepare_store": prepare_store_without_room_check},
    "prepare_store_releases_at_once": {"prepare_store": prepare_store_releases_at_once},
    "prepare_store_never_overwrites": {"prepare_store": prepare_store_never_overwrites},
    "lookup_past_the_first_miss": {"get_num_new_matched_tokens": lookup_past_the_first_miss},
    "lookup_covers_the_last_token": {"get_num_new_matched_tokens": lookup_covers_the_last_token},
    "lookup_does_not_touch_the_hits": {"get_num_new_matched_tokens": lookup_does_not_touch_the_hits},
    "lookup_holds_the_hits": {"get_num_new_matched_tokens": lookup_holds_the_hits},
    "lookup_from_the_first_block": {"get_num_new_matched_tokens": lookup_from_the_first_block},
    "lookup_counts_every_prompt_token": {"get_num_new_matched_tokens": lookup_counts_every_prompt_token},
}

# One mutant per exercise that must also break the capstone (the capstone runs every piece).
CAPSTONE_MUTANTS = {
    "select_preemption": "select_preemption_always_swaps",
    "schedule_swapped": "schedule_swapped_ignores_the_room",
    "prepare_store": "prepare_store_without_room_check",
    "get_num_new_matched_tokens": "lookup_holds_the_hits",
}

# The statements each exercise's question is about, as `ast.unparse` writes them (a compound statement by its
# header). Hint 2 may show none of them, and nothing under chapters/ may state them (tests/test_hints.py): they
# live here, beside the wrong answers, because a learner reads the chapter's test file.
DECISIVE = {
    "select_preemption": [
        "group = scheduler.group_of(select_victim(scheduler))",
        "fits_host = num_blocks <= scheduler.kv_cache_manager.swap_pool.num_free_blocks",
        "can_return = num_blocks + len(group) <= scheduler.kv_cache_manager.num_blocks",
    ],
    "schedule_swapped": [
        "while scheduler.swapped and budget > 0 and (not out.preempted_seq_ids):",
        "group = scheduler.swapped[0]",
        "if num_group_blocks(group) + len(group) > manager.num_free_blocks:",
        "return 0 if scheduler.swapped else budget",
    ],
    "prepare_store": [
        "if offloading.host_pool.get_cached_block(block_hash) is not None:",
        "offloading.touch([block_hash])",
        "if offloading.host_pool.num_free_blocks == 0:",
        "host, = offloading.host_pool.get_new_blocks(1)",
    ],
    "get_num_new_matched_tokens": [
        "first = num_computed_tokens // block_size",
        "last = (num_tokens - 1) // block_size",
        "hits = block_hashes[first:first + offloading.lookup(block_hashes[first:last])]",
        "offloading.touch(hits)",
        "offloading.stats.queries += num_tokens - num_computed_tokens",
    ],
}

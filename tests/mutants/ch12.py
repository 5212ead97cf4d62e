"""Plausible wrong answers to chapter 12's exercises; each must fail at least one test of its exercise."""

from solutions.core.block_hash import extend_block_hashes
from solutions.core.data_parallel_kv_cache_manager import DataParallelKVCacheManager
from solutions.core.sched.data_parallel_scheduler import DataParallelScheduler
from solutions.core.sched.placement import ReplicaState
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.utils.math_utils import cdiv

# --- can_take ---------------------------------------------------------------------------------------------------------


def _take(scheduler: DataParallelScheduler, seq: Sequence, state: ReplicaState, *, idle: bool = True,
          samples: bool = True, queue: bool = True, chunked: bool = True, cached: bool = True,
          seats: bool = True) -> bool:
    replica = scheduler.replicas[state.replica]
    if idle and not replica.has_work():
        return True
    if seats and state.num_running + state.num_waiting + 1 + (len(seq.fork_seq_ids) if samples else 0) \
            > replica.max_num_seqs:
        return False
    block_size = replica.kv_cache_manager.block_size
    chunk = min(replica.long_prefill_token_threshold, replica.max_num_batched_tokens) if chunked else 10**9
    own = seq.num_tokens - (state.num_cached_blocks * block_size if cached else 0)
    needed = cdiv(min(own, chunk), block_size)
    if queue:
        needed += sum(cdiv(min(queued.num_tokens, chunk), block_size) for queued in replica.waiting)
    return needed <= state.num_free_blocks


def take_ignores_the_queue_there(scheduler: DataParallelScheduler, seq: Sequence, state: ReplicaState) -> bool:
    """Counts the free blocks against `seq` alone: the replica's own queue takes them first, and `seq` waits there."""
    return _take(scheduler, seq, state, queue=False)


def take_whole_prompt(scheduler: DataParallelScheduler, seq: Sequence, state: ReplicaState) -> bool:
    """Wants blocks for the whole prompt at once: a long prompt is refused by a busy replica that could chunk it."""
    return _take(scheduler, seq, state, chunked=False)


def take_ignores_the_cache(scheduler: DataParallelScheduler, seq: Sequence, state: ReplicaState) -> bool:
    """Asks blocks for the cached prefix too: the pool that holds it looks fuller than it is."""
    return _take(scheduler, seq, state, cached=False)


def take_one_seat(scheduler: DataParallelScheduler, seq: Sequence, state: ReplicaState) -> bool:
    """One seat per sequence: the samples it forks later overfill the replica's running set."""
    return _take(scheduler, seq, state, samples=False)


def take_refuses_when_idle(scheduler: DataParallelScheduler, seq: Sequence, state: ReplicaState) -> bool:
    """No exception for an idle replica: a prompt longer than any pool's free blocks at once is never placed."""
    return _take(scheduler, seq, state, idle=False)


def take_ignores_the_seats(scheduler: DataParallelScheduler, seq: Sequence, state: ReplicaState) -> bool:
    """Counts blocks but not seats: a full replica is handed sequences that then wait in its queue."""
    return _take(scheduler, seq, state, seats=False)


def take_any_free_block(scheduler: DataParallelScheduler, seq: Sequence, state: ReplicaState) -> bool:
    """A seat and one free block are enough (the old, optimistic rule): a sequence is placed where it then waits."""
    replica = scheduler.replicas[state.replica]
    seats = state.num_running + state.num_waiting + 1 + len(seq.fork_seq_ids) <= replica.max_num_seqs
    return not replica.has_work() or (seats and state.num_free_blocks > 0)

# --- place_by_prefix ------------------------------------------------------------------------------------------------


def _choose(good: list[ReplicaState]) -> int:
    return min(good, key=lambda s: (s.load, -s.num_cached_blocks, s.replica)).replica


def place_uncapped(replicas: list[ReplicaState], load_cap: int, near_tie_blocks: int) -> int:
    """No load cap: the longest prefix wins however long the queue there (a hot prefix piles onto one replica)."""
    best = max(s.num_cached_blocks for s in replicas)
    return _choose([s for s in replicas if s.num_cached_blocks >= best - near_tie_blocks])


def place_strict_cap(replicas: list[ReplicaState], load_cap: int, near_tie_blocks: int) -> int:
    """A replica exactly at the cap is refused (`<` for `<=`)."""
    low = min(s.load for s in replicas)
    candidates = [s for s in replicas if s.load < low + load_cap] or [min(replicas, key=lambda s: (s.load, s.replica))]
    best = max(s.num_cached_blocks for s in candidates)
    return _choose([s for s in candidates if s.num_cached_blocks >= best - near_tie_blocks])


def place_cap_after_the_choice(replicas: list[ReplicaState], load_cap: int, near_tie_blocks: int) -> int:
    """Picks the best prefix first, then, if it is too loaded, falls back to the least loaded of all (a second-best
    prefix within the cap is never considered)."""
    low = min(s.load for s in replicas)
    best = max(s.num_cached_blocks for s in replicas)
    choice = _choose([s for s in replicas if s.num_cached_blocks >= best - near_tie_blocks])
    if next(s for s in replicas if s.replica == choice).load > low + load_cap:
        return min(replicas, key=lambda s: (s.load, s.replica)).replica
    return choice


def place_exact_ties_only(replicas: list[ReplicaState], load_cap: int, near_tie_blocks: int) -> int:
    """No near ties: one block more cached always wins, however loaded (the margin ignored)."""
    low = min(s.load for s in replicas)
    candidates = [s for s in replicas if s.load <= low + load_cap]
    best = max(s.num_cached_blocks for s in candidates)
    return _choose([s for s in candidates if s.num_cached_blocks == best])


def place_near_ties_by_cache(replicas: list[ReplicaState], load_cap: int, near_tie_blocks: int) -> int:
    """Near ties go to the longer prefix, not to the less loaded."""
    low = min(s.load for s in replicas)
    candidates = [s for s in replicas if s.load <= low + load_cap]
    best = max(s.num_cached_blocks for s in candidates)
    good = [s for s in candidates if s.num_cached_blocks >= best - near_tie_blocks]
    return min(good, key=lambda s: (-s.num_cached_blocks, s.load, s.replica)).replica


def place_counts_sequences(replicas: list[ReplicaState], load_cap: int, near_tie_blocks: int) -> int:
    """Load as the number of sequences, running + waiting: a waiting one weighs as little as a running one, however
    full its pool."""
    def load(s: ReplicaState) -> int:
        return s.num_running + s.num_waiting

    low = min(load(s) for s in replicas)
    candidates = [s for s in replicas if load(s) <= low + load_cap]
    best = max(s.num_cached_blocks for s in candidates)
    good = [s for s in candidates if s.num_cached_blocks >= best - near_tie_blocks]
    return min(good, key=lambda s: (load(s), -s.num_cached_blocks, s.replica)).replica


def place_old_score(replicas: list[ReplicaState], load_cap: int, near_tie_blocks: int) -> int:
    """Load as vLLM's score before PR #49204, waiting x 4 + running, written in instead of `load`: a waiting one
    weighs four running ones even in an empty pool."""
    def load(s: ReplicaState) -> int:
        return s.num_waiting * 4 + s.num_running

    low = min(load(s) for s in replicas)
    candidates = [s for s in replicas if load(s) <= low + load_cap]
    best = max(s.num_cached_blocks for s in candidates)
    good = [s for s in candidates if s.num_cached_blocks >= best - near_tie_blocks]
    return min(good, key=lambda s: (load(s), -s.num_cached_blocks, s.replica)).replica


def place_ties_to_the_first(replicas: list[ReplicaState], load_cap: int, near_tie_blocks: int) -> int:
    """Among near ties of equal load, the lowest index, not the longer prefix."""
    low = min(s.load for s in replicas)
    candidates = [s for s in replicas if s.load <= low + load_cap]
    best = max(s.num_cached_blocks for s in candidates)
    good = [s for s in candidates if s.num_cached_blocks >= best - near_tie_blocks]
    return min(good, key=lambda s: (s.load, s.replica)).replica


def place_returns_the_position(replicas: list[ReplicaState], load_cap: int, near_tie_blocks: int) -> int:
    """The position in the offered list, not the replica's index (they differ once a replica is gone or full)."""
    low = min(s.load for s in replicas)
    candidates = [s for s in replicas if s.load <= low + load_cap]
    best = max(s.num_cached_blocks for s in candidates)
    good = [s for s in candidates if s.num_cached_blocks >= best - near_tie_blocks]
    return replicas.index(min(good, key=lambda s: (s.load, -s.num_cached_blocks, s.replica)))


def place_default_knobs(replicas: list[ReplicaState], load_cap: int, near_tie_blocks: int) -> int:
    """The defaults (a cap of 4, a margin of 1) written in, the arguments ignored."""
    low = min(s.load for s in replicas)
    candidates = [s for s in replicas if s.load <= low + 4]
    best = max(s.num_cached_blocks for s in candidates)
    return _choose([s for s in candidates if s.num_cached_blocks >= best - 1])


# --- num_cached_blocks ----------------------------------------------------------------------------------------------


def _hashes(manager: DataParallelKVCacheManager, seq: Sequence, num_blocks: int | None = None) -> list[bytes]:
    extend_block_hashes(seq.block_hashes, seq.token_ids, seq.num_tokens, manager.block_size)
    return seq.block_hashes[: (seq.num_tokens - 1) // manager.block_size if num_blocks is None else num_blocks]


def _leading(pool, hashes: list[bytes]) -> int:
    count = 0
    while count < len(hashes) and pool.block_pool.get_cached_block(hashes[count]) is not None:
        count += 1
    return count


def place_near_tie_of_the_first_two(replicas: list[ReplicaState], load_cap: int, near_tie_blocks: int) -> int:
    """A near tie between the best candidate and the runner-up only: with three replicas within the margin, the
    third is never weighed, however lightly loaded."""
    low = min(s.load for s in replicas)
    candidates = sorted((s for s in replicas if s.load <= low + load_cap), key=lambda s: -s.num_cached_blocks)
    good = [s for s in candidates[:2] if s.num_cached_blocks >= candidates[0].num_cached_blocks - near_tie_blocks]
    return _choose(good)


def cached_past_a_miss(manager: DataParallelKVCacheManager, seq: Sequence) -> list[int]:
    """Counts every block of the prompt a pool holds, after a hole too."""
    if seq.skip_reading_prefix_cache:
        return [0] * len(manager.replicas)
    hashes = _hashes(manager, seq)
    return [sum(m.block_pool.get_cached_block(h) is not None for h in hashes) if manager.alive[r] else 0
            for r, m in enumerate(manager.replicas)]


def cached_covers_the_last_token(manager: DataParallelKVCacheManager, seq: Sequence) -> list[int]:
    """Every full block of the prompt may count, the one holding the last token included."""
    if seq.skip_reading_prefix_cache:
        return [0] * len(manager.replicas)
    hashes = _hashes(manager, seq, seq.num_tokens // manager.block_size)
    return [_leading(m, hashes) if manager.alive[r] else 0 for r, m in enumerate(manager.replicas)]


def cached_by_asking_each_pool(manager: DataParallelKVCacheManager, seq: Sequence) -> list[int]:
    """Each pool's own `get_computed_blocks`: right counts, but every pool counts a prefix-cache query for a
    sequence that will run on one of them."""
    return [len(m.get_computed_blocks(seq)[0]) if manager.alive[r] else 0 for r, m in enumerate(manager.replicas)]


def cached_touches_the_hits(manager: DataParallelKVCacheManager, seq: Sequence) -> list[int]:
    """Takes a reference to the blocks it finds, as a prefix hit at admission does: on every pool, for a sequence
    that will run on one (the others' blocks are held for ever)."""
    if seq.skip_reading_prefix_cache:
        return [0] * len(manager.replicas)
    hashes, counts = _hashes(manager, seq), []
    for r, m in enumerate(manager.replicas):
        count = _leading(m, hashes) if manager.alive[r] else 0
        m.block_pool.touch([m.block_pool.get_cached_block(h) for h in hashes[:count]])
        counts.append(count)
    return counts


def cached_on_a_gone_pool(manager: DataParallelKVCacheManager, seq: Sequence) -> list[int]:
    """Looks in a dead replica's pool too (its blocks are still in the books)."""
    if seq.skip_reading_prefix_cache:
        return [0] * len(manager.replicas)
    hashes = _hashes(manager, seq)
    return [_leading(m, hashes) for m in manager.replicas]


def cached_for_prompt_logprobs(manager: DataParallelKVCacheManager, seq: Sequence) -> list[int]:
    """Counts the cache for a request that must compute its whole prompt (it wants the prompt's logprobs)."""
    hashes = _hashes(manager, seq)
    return [_leading(m, hashes) if manager.alive[r] else 0 for r, m in enumerate(manager.replicas)]


# --- drop_replica ---------------------------------------------------------------------------------------------------


def _drop(scheduler: DataParallelScheduler, replica: int, *, mark: bool = True, queues: str = "all",
          reset_computed: bool = True, free: bool = True, keep_waiting_status: bool = True, order: str = "front",
          raise_first: bool = False, raise_at_all: bool = True, clear_drafts: bool = True) -> None:
    if raise_first and len(scheduler.live_replicas) == 1 and scheduler.live_replicas[0] == replica:
        raise RuntimeError("every data-parallel replica has died")
    if mark:
        scheduler.kv_cache_manager.mark_gone(replica)
    dead = scheduler.replicas[replica]
    seqs = list(dead.running)
    if queues == "all":
        seqs += [*dead.waiting, *(seq for group in dead.swapped for seq in group)]
    for seq in seqs:
        new = seq.status is SequenceStatus.WAITING and keep_waiting_status
        status = SequenceStatus.WAITING if new else SequenceStatus.PREEMPTED
        if free:
            dead.finish(seq, SequenceStatus.FINISHED_ABORTED)
        else:  # out of the dead replica's queues, its blocks left as they were
            if seq in dead.running:
                dead.running.remove(seq)
        seq.status, seq.replica = status, None
        if reset_computed:
            seq.num_computed_tokens = 0
        if clear_drafts:
            seq.spec_token_ids = []
    ordered = sorted(seqs, key=lambda s: (s.arrival, s.seq_id))
    if order == "front":
        for seq in reversed(ordered):
            scheduler.waiting.prepend(seq)
    elif order == "front_reversed":
        for seq in ordered:
            scheduler.waiting.prepend(seq)
    else:
        for seq in ordered:
            scheduler.waiting.add(seq)
    scheduler.num_requeued += len(seqs)
    if raise_at_all and not scheduler.live_replicas:
        raise RuntimeError("every data-parallel replica has died")


def drop_requeues_at_the_back(scheduler: DataParallelScheduler, replica: int) -> None:
    """Requeued behind the unplaced sequences, as new arrivals: work already half done waits behind newcomers."""
    _drop(scheduler, replica, order="back")


def drop_requeues_in_reverse(scheduler: DataParallelScheduler, replica: int) -> None:
    """Each prepended in arrival order, so the last to arrive ends up at the head."""
    _drop(scheduler, replica, order="front_reversed")


def drop_running_only(scheduler: DataParallelScheduler, replica: int) -> None:
    """Only the running sequences come back: those waiting on the replica, or swapped out of it, are lost."""
    _drop(scheduler, replica, queues="running")


def drop_keeps_the_computed_tokens(scheduler: DataParallelScheduler, replica: int) -> None:
    """Keeps `num_computed_tokens`: the sequence resumes as if its keys and values were somewhere."""
    _drop(scheduler, replica, reset_computed=False)


def drop_without_freeing(scheduler: DataParallelScheduler, replica: int) -> None:
    """The pool is dead, so its blocks are left alone: the sequences keep their block tables (ids of a gone pool)."""
    _drop(scheduler, replica, free=False)


def drop_every_one_preempted(scheduler: DataParallelScheduler, replica: int) -> None:
    """Every requeued sequence marked PREEMPTED, the never-admitted ones too (they would resume, not start)."""
    _drop(scheduler, replica, keep_waiting_status=False)


def drop_forgets_the_swapped(scheduler: DataParallelScheduler, replica: int) -> None:
    """Requeues the running and the waiting, but not the groups swapped out on the dead replica."""
    scheduler.kv_cache_manager.mark_gone(replica)
    dead = scheduler.replicas[replica]
    seqs = [*dead.running, *dead.waiting]
    for seq in seqs:
        status = SequenceStatus.WAITING if seq.status is SequenceStatus.WAITING else SequenceStatus.PREEMPTED
        dead.finish(seq, SequenceStatus.FINISHED_ABORTED)
        seq.status, seq.num_computed_tokens, seq.spec_token_ids, seq.replica = status, 0, [], None
    for seq in sorted(seqs, key=lambda s: (s.arrival, s.seq_id), reverse=True):
        scheduler.waiting.prepend(seq)
    scheduler.num_requeued += len(seqs)
    if not scheduler.live_replicas:
        raise RuntimeError("every data-parallel replica has died")

def drop_keeps_the_drafts(scheduler: DataParallelScheduler, replica: int) -> None:
    """Keeps the draft tokens the dead replica was to verify."""
    _drop(scheduler, replica, clear_drafts=False)


def drop_without_marking_the_pool(scheduler: DataParallelScheduler, replica: int) -> None:
    """Requeues, but never marks the pool gone: placement may send sequences straight back to the dead replica."""
    _drop(scheduler, replica, mark=False, raise_at_all=False)


def drop_raises_before_requeueing(scheduler: DataParallelScheduler, replica: int) -> None:
    """Raises as soon as the last replica dies, leaving its sequences in the dead replica's queues."""
    _drop(scheduler, replica, raise_first=True)


MUTANTS = {
    "take_ignores_the_queue_there": {"can_take": take_ignores_the_queue_there},
    "take_whole_prompt": {"can_take": take_whole_prompt},
    "take_ignores_the_cache": {"can_take": take_ignores_the_cache},
    "take_one_seat": {"can_take": take_one_seat},
    "take_refuses_when_idle": {"can_take": take_refuses_when_idle},
    "take_any_free_block": {"can_take": take_any_free_block},
    "take_ignores_the_seats": {"can_take": take_ignores_the_seats},
    "place_uncapped": {"place_by_prefix": place_uncapped},
    "place_strict_cap": {"place_by_prefix": place_strict_cap},
    "place_cap_after_the_choice": {"place_by_prefix": place_cap_after_the_choice},
    "place_exact_ties_only": {"place_by_prefix": place_exact_ties_only},
    "place_near_ties_by_cache": {"place_by_prefix": place_near_ties_by_cache},
    "place_counts_sequences": {"place_by_prefix": place_counts_sequences},
    "place_old_score": {"place_by_prefix": place_old_score},
    "place_ties_to_the_first": {"place_by_prefix": place_ties_to_the_first},
    "place_returns_the_position": {"place_by_prefix": place_returns_the_position},
    "place_default_knobs": {"place_by_prefix": place_default_knobs},
    "place_near_tie_of_the_first_two": {"place_by_prefix": place_near_tie_of_the_first_two},
    "drop_forgets_the_swapped": {"drop_replica": drop_forgets_the_swapped},
    "cached_past_a_miss": {"num_cached_blocks": cached_past_a_miss},
    "cached_covers_the_last_token": {"num_cached_blocks": cached_covers_the_last_token},
    "cached_by_asking_each_pool": {"num_cached_blocks": cached_by_asking_each_pool},
    "cached_touches_the_hits": {"num_cached_blocks": cached_touches_the_hits},
    "cached_on_a_gone_pool": {"num_cached_blocks": cached_on_a_gone_pool},
    "cached_for_prompt_logprobs": {"num_cached_blocks": cached_for_prompt_logprobs},
    "drop_requeues_at_the_back": {"drop_replica": drop_requeues_at_the_back},
    "drop_requeues_in_reverse": {"drop_replica": drop_requeues_in_reverse},
    "drop_running_only": {"drop_replica": drop_running_only},
    "drop_keeps_the_computed_tokens": {"drop_replica": drop_keeps_the_computed_tokens},
    "drop_without_freeing": {"drop_replica": drop_without_freeing},
    "drop_every_one_preempted": {"drop_replica": drop_every_one_preempted},
    "drop_keeps_the_drafts": {"drop_replica": drop_keeps_the_drafts},
    "drop_without_marking_the_pool": {"drop_replica": drop_without_marking_the_pool},
    "drop_raises_before_requeueing": {"drop_replica": drop_raises_before_requeueing},
}

# One mutant per exercise that must also make the capstone fail (its run is in tests/test_grading.py).
CAPSTONE_MUTANTS = {
    "can_take": "take_ignores_the_seats",
    "place_by_prefix": "place_returns_the_position",
    "num_cached_blocks": "cached_touches_the_hits",
    "drop_replica": "drop_keeps_the_computed_tokens",
}

# The statements each exercise's question is about, as `ast.unparse` writes them (a compound statement by its
# header). Hint 2 may show none of them, and nothing under chapters/ may state them (tests/test_hints.py): they
# live here, beside the wrong answers, because a learner reads the chapter's test file.
DECISIVE = {
    "can_take": [
        "if not replica.has_work():",
        "if state.num_running + state.num_waiting + 1 + len(seq.fork_seq_ids) > replica.max_num_seqs:",
        "chunk = min(replica.long_prefill_token_threshold, replica.max_num_batched_tokens)",
        "needed = cdiv(min(seq.num_tokens - state.num_cached_blocks * block_size, chunk), block_size)",
        "needed += sum((cdiv(min(queued.num_tokens, chunk), block_size) for queued in replica.waiting))",
    ],
    "place_by_prefix": [
        "min_load = min((state.load for state in replicas))",
        "candidates = [state for state in replicas if state.load <= min_load + load_cap]",
        "best = max((state.num_cached_blocks for state in candidates))",
        "good = [state for state in candidates if state.num_cached_blocks >= best - near_tie_blocks]",
        "return min(good, key=lambda state: (state.load, -state.num_cached_blocks, state.replica)).replica",
    ],
    "num_cached_blocks": [
        "hashes = seq.block_hashes[:(seq.num_tokens - 1) // manager.block_size]",
        "if manager.alive[replica]:",
        "while count < len(hashes) and replica_manager.block_pool.get_cached_block(hashes[count]) is not None:",
    ],
    "drop_replica": [
        "scheduler.kv_cache_manager.mark_gone(replica)",
        "seqs = [*dead.running, *dead.waiting, *(seq for group in dead.swapped for seq in group)]",
        "status = SequenceStatus.WAITING if seq.status is SequenceStatus.WAITING else SequenceStatus.PREEMPTED",
        "dead.finish(seq, SequenceStatus.FINISHED_ABORTED)",
        "seq.status, seq.num_computed_tokens, seq.spec_token_ids, seq.replica = (status, 0, [], None)",
        "for seq in sorted(seqs, key=lambda s: (s.arrival, s.seq_id), reverse=True):",
        "scheduler.waiting.prepend(seq)",
        "if not scheduler.live_replicas:",
    ],
}

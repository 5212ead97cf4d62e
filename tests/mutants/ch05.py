"""Plausible wrong answers to chapter 05's exercises; each must fail at least one test of its exercise.

Class exercises are mutated by subclassing the reference and overriding the method that goes wrong.
"""

import torch

from solutions.attention.paged import AttentionMetadata
from solutions.core.block_manager import slot_mapping
from solutions.core.sched.output import SchedulerOutput, sampling_rows
from solutions.core.sched.request_queue import SchedulingPolicy
from solutions.core.sched.scheduler import Scheduler, SchedulerBase
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.engine import EngineCoreOutput, EngineCoreOutputs
from solutions.engine.core import EngineCore
from solutions.sample.ops.penalties import get_token_bin_counts_and_mask

# --- Scheduler.schedule -------------------------------------------------------------------------------------------


class _Template(Scheduler):
    """The reference `schedule`, with hooks that the mutants below get wrong."""

    def _num_new(self, behind: int, budget: int) -> int:
        return min(behind, budget, self.long_prefill_token_threshold)

    def _running_first(self, out, copies, budget):
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new_tokens = self._num_new(seq.num_tokens - seq.num_computed_tokens, budget)
            seq_copies, returned = self._allocate_or_preempt(seq, num_new_tokens, out, copies)
            budget += returned
            if seq_copies is None:
                continue
            self._add_to_batch(out, seq, num_new_tokens, seq_copies, copies)
            budget -= num_new_tokens
            index = self.running.index(seq) + 1
        return budget

    def _lookup(self, seq):
        """(computed blocks, cached tokens) for a sequence about to be admitted."""
        return self.kv_cache_manager.get_computed_blocks(seq)

    def _num_new_admitted(self, seq, num_cached, budget):
        return self._num_new(seq.num_tokens - num_cached, budget)

    def _allocate_admitted(self, seq, num_new_tokens, computed_blocks, num_cached):
        return self.kv_cache_manager.allocate_slots(seq, num_new_tokens, computed_blocks)

    def _start_running(self, out, seq, num_cached):
        (out.resumed_seq_ids if seq.status is SequenceStatus.PREEMPTED else out.new_seq_ids).append(seq.seq_id)
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = num_cached

    def _has_room(self, seq):
        return self.can_admit(seq)

    def _admit(self, out, copies, budget):
        while not out.preempted_seq_ids and self.waiting and budget > 0 and self._has_room(self.waiting.peek()):
            seq = self.waiting.peek()
            computed_blocks, num_cached = self._lookup(seq)
            num_new_tokens = self._num_new_admitted(seq, num_cached, budget)
            seq_copies = self._allocate_admitted(seq, num_new_tokens, computed_blocks, num_cached)
            if seq_copies is None:
                break
            self.waiting.pop()
            self._start_running(out, seq, num_cached)
            out.num_cached_tokens[seq.seq_id] = num_cached
            self.running.append(seq)
            self._add_to_batch(out, seq, num_new_tokens, seq_copies, copies)
            budget -= num_new_tokens
        return budget

    def schedule(self) -> SchedulerOutput:
        out, copies = SchedulerOutput(), {}
        budget = self._running_first(out, copies, self.max_num_batched_tokens)
        self._admit(out, copies, budget)
        out.blocks_to_copy = [c for seq in out.scheduled_seqs for c in copies.get(seq.seq_id, [])]
        self._update_after_schedule(out)
        return out


class DropsTheCopies(_Template):
    """Allocates the copy-on-write blocks but never tells the runner to copy: forked samples that write into a
    block they shared read K/V that was never copied there."""

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        out.blocks_to_copy = []
        return out


class NeverAdvancesTheBatch(_Template):
    """Returns the batch without advancing its sequences' computed tokens (leaves it to the model runner, as
    the engine once did): the next `schedule()` sees the same tokens still behind."""

    def _update_after_schedule(self, out):
        pass


class CountsOnlyRunningSequences(_Template):
    """Admits while fewer than `max_num_seqs` run, forgetting the samples an `n > 1` request will fork."""

    def _has_room(self, seq):
        return len(self.running) < self.max_num_seqs


class IgnoresTheBudget(_Template):
    """Gives every sequence all the tokens it is behind (up to the threshold), whatever the budget has left."""

    def _num_new(self, behind: int, budget: int) -> int:
        return min(behind, self.long_prefill_token_threshold)


class StarvesRunning(_Template):
    """Admits waiting prompts first: a long prompt takes the whole budget and running sequences stall."""

    def schedule(self) -> SchedulerOutput:
        out, copies = SchedulerOutput(), {}
        budget = self._admit(out, copies, self.max_num_batched_tokens)
        already = list(out.scheduled_seqs)
        index = 0
        while index < len(self.running) and budget > 0:  # then the running ones not admitted just now
            seq = self.running[index]
            index += 1
            if seq in already:
                continue
            num_new_tokens = self._num_new(seq.num_tokens - seq.num_computed_tokens, budget)
            seq_copies, returned = self._allocate_or_preempt(seq, num_new_tokens, out, copies)
            budget += returned
            if seq_copies is None:
                index = 0
                continue
            self._add_to_batch(out, seq, num_new_tokens, seq_copies, copies)
            budget -= num_new_tokens
        out.blocks_to_copy = [c for seq in out.scheduled_seqs for c in copies.get(seq.seq_id, [])]
        self._update_after_schedule(out)
        return out


class NoChunking(_Template):
    """All or nothing: a prompt that does not fit in the budget left waits for a later step."""

    def _num_new(self, behind: int, budget: int) -> int:
        num_new = min(behind, self.long_prefill_token_threshold)
        return num_new if num_new <= budget else 0

    def _admit(self, out, copies, budget):
        if self.waiting and self._num_new(self.waiting.peek().num_tokens, budget) == 0:
            return budget
        return super()._admit(out, copies, budget)


class IgnoresMaxNumSeqs(_Template):
    """Admits while there is budget, however many sequences already run."""

    def schedule(self) -> SchedulerOutput:
        limit, self.max_num_seqs = self.max_num_seqs, 10**9
        try:
            return super().schedule()
        finally:
            self.max_num_seqs = limit


class SkipsTheBlockedHead(_Template):
    """When the head of the queue does not fit in memory, admits the ones behind it that do."""

    def _admit(self, out, copies, budget):
        blocked = []
        while self.waiting:
            head = self.waiting.peek()
            need = -(-self._num_new(head.num_tokens, budget) // self.kv_cache_manager.block_size)
            if need <= self.kv_cache_manager.num_free_blocks:
                break
            blocked.append(self.waiting.pop())  # set aside, to go back to the front afterwards
        budget = super()._admit(out, copies, budget)
        for seq in reversed(blocked):
            self.waiting.prepend(seq)
        return budget


class AdmitsAfterPreempting(_Template):
    """Admits waiting prompts even in a step that preempted: the blocks just freed go to a newcomer."""

    def _admit(self, out, copies, budget):
        preempted, out.preempted_seq_ids = out.preempted_seq_ids, []
        try:
            return super()._admit(out, copies, budget)
        finally:
            out.preempted_seq_ids = preempted + out.preempted_seq_ids


class IgnoresCachedTokens(_Template):
    """Sizes an admitted sequence's chunk from its whole length, as if the prefix cache had found nothing."""

    def _num_new_admitted(self, seq, num_cached, budget):
        return self._num_new(seq.num_tokens, budget)


class ComputedBeforeAllocating(_Template):
    """Marks the cached tokens computed before `allocate_slots`, which then counts the prefix hits twice."""

    def _allocate_admitted(self, seq, num_new_tokens, computed_blocks, num_cached):
        before = seq.num_computed_tokens
        seq.num_computed_tokens = num_cached
        seq_copies = super()._allocate_admitted(seq, num_new_tokens, computed_blocks, num_cached)
        if seq_copies is None:
            seq.num_computed_tokens = before
        return seq_copies


class CountsResumedAsNew(_Template):
    """Reports every admission in `new_seq_ids`, a sequence coming back from a preemption too."""

    def _start_running(self, out, seq, num_cached):
        out.new_seq_ids.append(seq.seq_id)
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = num_cached


class LeavesResumedPreempted(_Template):
    """Sets RUNNING only on a new sequence: a resumed one runs with its status still PREEMPTED."""

    def _start_running(self, out, seq, num_cached):
        if seq.status is SequenceStatus.WAITING:
            out.new_seq_ids.append(seq.seq_id)
            seq.status = SequenceStatus.RUNNING
        else:
            out.resumed_seq_ids.append(seq.seq_id)
        seq.num_computed_tokens = num_cached


class ResumesFromZero(_Template):
    """Restarts a resumed sequence at position 0: only new prompts look up the prefix cache."""

    def _lookup(self, seq):
        return ([], 0) if seq.status is SequenceStatus.PREEMPTED else super()._lookup(seq)


class StepsPastAVictimAhead(_Template):
    """Moves on with `index += 1` after serving a sequence: when a victim *before* it (PRIORITY) left `running`,
    everything shifted left and the sequence after it is skipped this step."""

    def _running_first(self, out, copies, budget):
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new_tokens = self._num_new(seq.num_tokens - seq.num_computed_tokens, budget)
            seq_copies, returned = self._allocate_or_preempt(seq, num_new_tokens, out, copies)
            budget += returned
            if seq_copies is None:
                continue
            self._add_to_batch(out, seq, num_new_tokens, seq_copies, copies)
            budget -= num_new_tokens
            index += 1
        return budget


class KeepsTheVictimsBudget(_Template):
    """Ignores the budget `_allocate_or_preempt` hands back: a victim taken out of the batch keeps its tokens
    spent, and the sequences after it go without."""

    def _allocate_or_preempt(self, seq, num_new_tokens, out, copies):
        seq_copies, _ = super()._allocate_or_preempt(seq, num_new_tokens, out, copies)
        return seq_copies, 0


# --- select_victim -------------------------------------------------------------------------------------------


def _victim(scheduler: SchedulerBase, *, priority_key=None, fcfs_index: int = -1) -> Sequence:
    if scheduler.policy is SchedulingPolicy.PRIORITY:
        return max(scheduler.running, key=priority_key or (lambda s: (s.priority, s.arrival, s.seq_id)))
    return scheduler.running[fcfs_index]


def select_victim_picks_the_first(scheduler: SchedulerBase) -> Sequence:
    """FCFS: the first to start running (the oldest) instead of the last."""
    return _victim(scheduler, fcfs_index=0)


def select_victim_fcfs_latest_arrival(scheduler: SchedulerBase) -> Sequence:
    """FCFS: the latest arrival instead of the last to start running (a preempted early arrival restarts late)."""
    if scheduler.policy is SchedulingPolicy.PRIORITY:
        return _victim(scheduler)
    return max(scheduler.running, key=lambda s: (s.arrival, s.seq_id))


def select_victim_priority_picks_the_smallest(scheduler: SchedulerBase) -> Sequence:
    """PRIORITY: the smallest `priority` value, which is the most important request."""
    return _victim(scheduler, priority_key=lambda s: (-s.priority, s.arrival, s.seq_id))


def select_victim_priority_ties_to_the_oldest(scheduler: SchedulerBase) -> Sequence:
    """PRIORITY: among equal priorities, the earliest arrival instead of the latest."""
    return _victim(scheduler, priority_key=lambda s: (s.priority, -s.arrival, -s.seq_id))


def select_victim_priority_ignores_the_seq_id(scheduler: SchedulerBase) -> Sequence:
    """PRIORITY: (priority, arrival) alone, so a full tie goes to whichever started first."""
    return _victim(scheduler, priority_key=lambda s: (s.priority, s.arrival))


def select_victim_ignores_the_policy(scheduler: SchedulerBase) -> Sequence:
    """The last to start running whatever the policy: under PRIORITY a more important request goes."""
    return scheduler.running[-1]


def select_victim_lowest_priority_anywhere(scheduler: SchedulerBase) -> Sequence:
    """The least important sequence running *or waiting*: a waiting one holds no blocks to give back."""
    candidates = [*scheduler.running, *scheduler.waiting]
    if scheduler.policy is SchedulingPolicy.PRIORITY:
        return max(candidates, key=lambda s: (s.priority, s.arrival, s.seq_id))
    return candidates[-1]


# --- allocate_or_preempt -----------------------------------------------------------------------------------------


def _allocate_or_preempt(scheduler, seq, num_new_tokens, out, copies, *, choose=_victim, give_back=True,
                         take_out=True, retry=True, stop_at_self=True):
    returned = 0
    while (seq_copies := scheduler.kv_cache_manager.allocate_slots(seq, num_new_tokens)) is None:
        victim = choose(scheduler)
        if take_out and victim in out.scheduled_seqs:
            tokens = scheduler._remove_from_batch(out, victim, copies)
            returned += tokens if give_back else 0
        scheduler._preempt_request(victim, out)
        if stop_at_self and victim is seq:
            return None, returned
        if not retry:
            return scheduler.kv_cache_manager.allocate_slots(seq, num_new_tokens), returned
    return seq_copies, returned


def allocate_or_preempt_forgets_the_budget(
    scheduler: SchedulerBase, seq: Sequence, num_new_tokens: int, out: SchedulerOutput,
    copies: dict[int, list[tuple[int, int]]],
) -> tuple[list[tuple[int, int]] | None, int]:
    """Takes a scheduled victim out of the batch but never hands its tokens back to the budget."""
    return _allocate_or_preempt(scheduler, seq, num_new_tokens, out, copies, give_back=False)


def allocate_or_preempt_keeps_the_victim_scheduled(
    scheduler: SchedulerBase, seq: Sequence, num_new_tokens: int, out: SchedulerOutput,
    copies: dict[int, list[tuple[int, int]]],
) -> tuple[list[tuple[int, int]] | None, int]:
    """Preempts a victim that is already in this step's batch without taking it out of the batch."""
    return _allocate_or_preempt(scheduler, seq, num_new_tokens, out, copies, take_out=False)


def allocate_or_preempt_only_once(
    scheduler: SchedulerBase, seq: Sequence, num_new_tokens: int, out: SchedulerOutput,
    copies: dict[int, list[tuple[int, int]]],
) -> tuple[list[tuple[int, int]] | None, int]:
    """`if` where a `while` belongs: one victim, one more try, whether or not that freed enough blocks."""
    return _allocate_or_preempt(scheduler, seq, num_new_tokens, out, copies, retry=False)


def allocate_or_preempt_runs_past_itself(
    scheduler: SchedulerBase, seq: Sequence, num_new_tokens: int, out: SchedulerOutput,
    copies: dict[int, list[tuple[int, int]]],
) -> tuple[list[tuple[int, int]] | None, int]:
    """Does not stop when the victim is `seq` itself: it allocates again for a sequence now waiting."""
    return _allocate_or_preempt(scheduler, seq, num_new_tokens, out, copies, stop_at_self=False)


def _victim_behind_first(scheduler: SchedulerBase, seq: Sequence) -> Sequence:
    behind = scheduler.running[scheduler.running.index(seq) + 1:] if seq in scheduler.running else []
    return max(behind or scheduler.running, key=lambda s: (s.priority, s.arrival, s.seq_id))


def allocate_or_preempt_priority_looks_behind_first(
    scheduler: SchedulerBase, seq: Sequence, num_new_tokens: int, out: SchedulerOutput,
    copies: dict[int, list[tuple[int, int]]],
) -> tuple[list[tuple[int, int]] | None, int]:
    """PRIORITY: picks the lowest priority among the sequences *after* `seq` (as FCFS would), looking at the whole
    running list only when none follows: a less important victim ahead of `seq` is passed over."""
    if scheduler.policy is not SchedulingPolicy.PRIORITY:
        return _allocate_or_preempt(scheduler, seq, num_new_tokens, out, copies)
    return _allocate_or_preempt(scheduler, seq, num_new_tokens, out, copies,
                                choose=lambda s: _victim_behind_first(s, seq))


def _preempt_by_hand(scheduler: SchedulerBase, victim: Sequence, out: SchedulerOutput, *, reset_first=False,
                     free_cached=True, reset_cached=True) -> None:
    """`_preempt_request` written out by hand, with the slips the flags name."""
    manager = scheduler.kv_cache_manager
    scheduler.running.remove(victim)
    if reset_first:
        victim.num_computed_tokens = 0
    if free_cached or not manager.enable_prefix_caching:
        manager.free(victim)
    else:  # "the prefix cache keeps the cached blocks": only the others are freed
        blocks = [manager.block_pool.blocks[b] for b in victim.block_table]
        manager.block_pool.free_blocks(reversed([b for b in blocks if b.block_hash is None]))
        victim.block_table.clear()
    if reset_cached or not manager.enable_prefix_caching:
        victim.num_computed_tokens = 0
    victim.status = SequenceStatus.PREEMPTED
    scheduler.waiting.prepend(victim)
    out.preempted_seq_ids.append(victim.seq_id)
    scheduler.num_preemptions += 1


def _allocate_or_preempt_by_hand(scheduler, seq, num_new_tokens, out, copies, **slips):
    returned = 0
    while (seq_copies := scheduler.kv_cache_manager.allocate_slots(seq, num_new_tokens)) is None:
        victim = _victim(scheduler)
        if victim in out.scheduled_seqs:
            returned += scheduler._remove_from_batch(out, victim, copies)
        _preempt_by_hand(scheduler, victim, out, **slips)
        if victim is seq:
            return None, returned
    return seq_copies, returned


def allocate_or_preempt_resets_before_freeing(
    scheduler: SchedulerBase, seq: Sequence, num_new_tokens: int, out: SchedulerOutput,
    copies: dict[int, list[tuple[int, int]]],
) -> tuple[list[tuple[int, int]] | None, int]:
    """Preempts by hand, resetting `num_computed_tokens` before freeing: with prefix caching on, the manager then
    takes every block for never computed and drops its hash, so a re-admission finds nothing cached."""
    return _allocate_or_preempt_by_hand(scheduler, seq, num_new_tokens, out, copies, reset_first=True)


def allocate_or_preempt_keeps_the_cached_blocks(
    scheduler: SchedulerBase, seq: Sequence, num_new_tokens: int, out: SchedulerOutput,
    copies: dict[int, list[tuple[int, int]]],
) -> tuple[list[tuple[int, int]] | None, int]:
    """Preempts by hand, freeing only the victim's uncached blocks ("the prefix cache keeps the others"): with
    prefix caching on its cached blocks keep a reference nobody holds, leaked for ever."""
    return _allocate_or_preempt_by_hand(scheduler, seq, num_new_tokens, out, copies, free_cached=False)


def allocate_or_preempt_keeps_the_computed_tokens(
    scheduler: SchedulerBase, seq: Sequence, num_new_tokens: int, out: SchedulerOutput,
    copies: dict[int, list[tuple[int, int]]],
) -> tuple[list[tuple[int, int]] | None, int]:
    """Preempts by hand and, with prefix caching on, keeps `num_computed_tokens` ("its blocks are cached, so its
    tokens stay computed"): a sequence without blocks claims computed K/V."""
    return _allocate_or_preempt_by_hand(scheduler, seq, num_new_tokens, out, copies, reset_cached=False)


# --- prepare_inputs -----------------------------------------------------------------------------------------------


def _prepare(scheduler_output: SchedulerOutput, block_size: int, *, position_start, seq_len, slot_start=None,
             query_end=None, start_of=None):
    input_ids, positions, slots, query_start_loc, seq_lens = [], [], [], [0], []
    for seq, start, num_new in zip(scheduler_output.scheduled_seqs, scheduler_output.num_computed_tokens,
                                   scheduler_output.num_scheduled_tokens, strict=True):
        start = start if start_of is None else start_of(seq)
        end = start + num_new
        input_ids += seq.token_ids[start:end]
        positions += range(position_start(start), position_start(start) + num_new)
        first_slot = start if slot_start is None else slot_start(start)
        slots += slot_mapping(seq.block_table, first_slot, first_slot + num_new, block_size)
        previous = query_start_loc[-1]
        query_start_loc.append(previous + num_new if query_end is None else query_end(previous, num_new))
        seq_lens.append(seq_len(end, num_new))
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.long),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long),
        block_tables=[seq.block_table for seq in scheduler_output.scheduled_seqs],
    )
    return torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), metadata


def prepare_inputs_reads_the_sequences(
    scheduler_output: SchedulerOutput, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Starts each sequence at its own `num_computed_tokens`, which the scheduler has already advanced past
    this step's tokens: right only before `schedule()` returns."""
    return _prepare(scheduler_output, block_size, position_start=lambda start: start, seq_len=lambda end, n: end,
                    start_of=lambda seq: seq.num_computed_tokens)


def prepare_inputs_chunk_positions_from_zero(
    scheduler_output: SchedulerOutput, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Numbers each sequence's new tokens from 0, as if every chunk were a whole prompt."""
    return _prepare(scheduler_output, block_size, position_start=lambda start: 0, seq_len=lambda end, n: end)


def prepare_inputs_seq_lens_are_query_lens(
    scheduler_output: SchedulerOutput, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Gives each sequence the length of its new tokens as its context: the cached context is never read."""
    return _prepare(scheduler_output, block_size, position_start=lambda start: start, seq_len=lambda end, n: n)


def prepare_inputs_chunk_slots_from_zero(
    scheduler_output: SchedulerOutput, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Maps a chunk's tokens to the slots of positions 0.. of its block table: every chunk overwrites the first."""
    return _prepare(scheduler_output, block_size, position_start=lambda start: start, seq_len=lambda end, n: end,
                    slot_start=lambda start: 0)


def prepare_inputs_query_start_loc_inclusive(
    scheduler_output: SchedulerOutput, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Off by one in `query_start_loc`: stores each sequence's last row (inclusive) instead of where the next starts."""
    return _prepare(scheduler_output, block_size, position_start=lambda start: start, seq_len=lambda end, n: end,
                    query_end=lambda previous, n: previous + n - (1 if previous == 0 else 0))


def prepare_inputs_last_token_only(
    scheduler_output: SchedulerOutput, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Feeds each sequence only its newest token, as a decode-only engine would."""
    seqs = scheduler_output.scheduled_seqs
    input_ids = [seq.token_ids[seq.num_computed_tokens + n - 1]
                 for seq, n in zip(seqs, scheduler_output.num_scheduled_tokens)]
    ends = [seq.num_computed_tokens + n for seq, n in zip(seqs, scheduler_output.num_scheduled_tokens)]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([slot_mapping(s.block_table, e - 1, e, block_size)[0] for s, e in zip(seqs, ends)]),
        query_start_loc=torch.arange(len(seqs) + 1),
        seq_lens=torch.tensor(ends),
        block_tables=[seq.block_table for seq in seqs],
    )
    return torch.tensor(input_ids), torch.tensor([e - 1 for e in ends]), metadata


# --- sampling_rows ------------------------------------------------------------------------------------------------


def _rows(scheduler_output: SchedulerOutput, *, samples=lambda seq, start, n: seq.num_computed_tokens == seq.num_tokens,
          forks=True) -> tuple[list[int], list[Sequence]]:
    rows, seqs = [], []
    for row, (seq, start, n) in enumerate(zip(scheduler_output.scheduled_seqs, scheduler_output.num_computed_tokens,
                                              scheduler_output.num_scheduled_tokens, strict=True)):
        if not samples(seq, start, n):
            continue
        for sample_seq in [*scheduler_output.forked_seqs.get(seq.seq_id, []), seq] if forks else [seq]:
            rows.append(row)
            seqs.append(sample_seq)
    return rows, seqs


def sampling_rows_first_rows(scheduler_output: SchedulerOutput) -> tuple[list[int], list[Sequence]]:
    """Takes the first rows of the logits for the sequences that sample, not each sequence's own row."""
    _, seqs = _rows(scheduler_output)
    return list(range(len(seqs))), seqs


def sampling_rows_samples_prompt_chunks(scheduler_output: SchedulerOutput) -> tuple[list[int], list[Sequence]]:
    """Samples for every scheduled sequence, even a prompt chunk whose prompt is not finished: its draw is a
    token appended in the middle of the prompt, and uses up a seeded request's random numbers."""
    return _rows(scheduler_output, samples=lambda seq, start, n: True)


def sampling_rows_never_forks(scheduler_output: SchedulerOutput) -> tuple[list[int], list[Sequence]]:
    """Ignores the samples the scheduler forked: one sample per request, so an `n > 1` request never completes."""
    return _rows(scheduler_output, forks=False)


def sampling_rows_once_the_prompt_is_in(scheduler_output: SchedulerOutput) -> tuple[list[int], list[Sequence]]:
    """Samples once the *prompt* is computed: a preempted sequence recomputed in chunks samples in the middle of its
    own earlier outputs. (Takes the place of the old engine-step mutant that sampled every row and then dropped
    the chunks' draws: the runner now samples exactly the rows this function returns.)"""
    return _rows(scheduler_output, samples=lambda seq, start, n: seq.num_computed_tokens >= seq.num_prompt_tokens)


def sampling_rows_from_where_the_tokens_start(scheduler_output: SchedulerOutput) -> tuple[list[int], list[Sequence]]:
    """Compares where the step's tokens start (`scheduler_output.num_computed_tokens`) with the sequence's length,
    forgetting the step's own tokens: no sequence ever samples."""
    return _rows(scheduler_output, samples=lambda seq, start, n: start == seq.num_tokens)


def sampling_rows_forks_take_the_next_rows(scheduler_output: SchedulerOutput) -> tuple[list[int], list[Sequence]]:
    """Gives each forked sample a row of its own, after its parent's, as if each sample had been scheduled."""
    rows, seqs = _rows(scheduler_output)
    shifted, previous, k = [], None, 0
    for row in rows:
        k = k + 1 if row == previous else 0
        shifted.append(min(row + k, len(scheduler_output.scheduled_seqs) - 1))
        previous = row
    return shifted, seqs


# --- engine_step --------------------------------------------------------------------------------------------------


def engine_step_never_updates(core: EngineCore) -> EngineCoreOutputs:
    """Returns the sampled tokens as the step's outputs without `update_from_output`: no token is appended to its
    sequence, no stop is checked, no block freed."""
    scheduler_output = core.scheduler.schedule()
    grammar_output = core.scheduler.get_grammar_bitmask(scheduler_output)
    core.model_executor.execute_model(scheduler_output)
    model_output = core.model_executor.sample_tokens(grammar_output)
    _, seqs = sampling_rows(scheduler_output)
    outputs = [EngineCoreOutput(seq.request_id, seq.sample_index, tokens)
               for seq, tokens in zip(seqs, model_output.sampled_token_ids, strict=True)]
    return EngineCoreOutputs(outputs, core.scheduler.make_stats(scheduler_output, model_output.seconds))


def engine_step_samples_before_executing(core: EngineCore) -> EngineCoreOutputs:
    """Asks the executor for the sampled tokens before the forward pass that computes their logits."""
    scheduler_output = core.scheduler.schedule()
    grammar_output = core.scheduler.get_grammar_bitmask(scheduler_output)
    model_output = core.model_executor.sample_tokens(grammar_output)
    core.model_executor.execute_model(scheduler_output)
    return core.scheduler.update_from_output(scheduler_output, model_output)


def engine_step_drops_the_grammar(core: EngineCore) -> EngineCoreOutputs:
    """Samples without the grammar masks (passes None): a constrained request draws from the whole vocabulary."""
    scheduler_output = core.scheduler.schedule()
    core.model_executor.execute_model(scheduler_output)
    model_output = core.model_executor.sample_tokens(None)
    return core.scheduler.update_from_output(scheduler_output, model_output)


def engine_step_calls_core_step(core: EngineCore) -> EngineCoreOutputs:
    """Delegates to `core.step()`, which is itself nothing but a call of `engine_step`: endless recursion once
    `engine_step` is yours."""
    return core.step()


def engine_step_schedules_twice(core: EngineCore) -> EngineCoreOutputs:
    """Schedules once for the forward pass and again for the update: the second `schedule()` advances the
    sequences past tokens no forward pass ever computes."""
    scheduler_output = core.scheduler.schedule()
    grammar_output = core.scheduler.get_grammar_bitmask(scheduler_output)
    core.model_executor.execute_model(scheduler_output)
    model_output = core.model_executor.sample_tokens(grammar_output)
    return core.scheduler.update_from_output(core.scheduler.schedule(), model_output)


# --- apply_top_p, apply_min_p -------------------------------------------------------------------------------------


def apply_top_p_drops_the_crossing_token(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Drops the token whose probability carries the mass past p: the nucleus can come out empty."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    drop = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1) > top_p[:, None]
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def apply_top_p_trusts_the_float_sum(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Right in exact arithmetic; at top_p 1 on a real vocabulary the float cumulative sum reaches 1 early and
    the tail is dropped."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= top_p[:, None]
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def apply_top_p_without_sorting(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Accumulates probability in vocabulary order instead of from the most likely token down."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs.cumsum(dim=-1) - probs >= top_p[:, None], float("-inf"))


def apply_top_p_first_rows_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Uses the first row's p for every row."""
    from solutions.sample.sampler import apply_top_p

    return apply_top_p(logits, top_p[:1].expand(logits.shape[0]))


def apply_top_p_ascending_keeps_none(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """vLLM's ascending form (drop a token while the mass up to it is <= 1 - p) without its "keep at least one"
    line: with a tiny p, 1 - p rounds to 1.0 in float32 and a row whose mass sums to just under 1 loses every token."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)  # (B, V) least likely first
    drop = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1) <= 1 - top_p[:, None]
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def apply_min_p_absolute(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Compares each probability with min_p itself, not with min_p times the most likely token's."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p[:, None], float("-inf"))


def apply_min_p_on_logits(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Scales the largest *logit* by min_p: logits are log-probabilities up to a constant, not probabilities."""
    return logits.masked_fill(logits < min_p[:, None] * logits.max(dim=-1, keepdim=True).values, float("-inf"))


def apply_min_p_max_over_the_batch(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Takes the maximum over the wrong dimension: per vocabulary entry across the batch, not per row."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p[:, None] * probs.max(dim=0, keepdim=True).values, float("-inf"))


# --- apply_penalties ----------------------------------------------------------------------------------------------


def _penalties(logits, prompt_token_ids, output_token_ids, presence_penalties, frequency_penalties,
               repetition_penalties, *, divide_negatives=False, repeat_over_prompt=True, openai_over_prompt=False,
               count_once=False):
    vocab_size = logits.shape[1]
    prompt_counts, prompt_mask = get_token_bin_counts_and_mask(prompt_token_ids, vocab_size)
    output_counts, output_mask = get_token_bin_counts_and_mask(output_token_ids, vocab_size)
    seen = (prompt_mask | output_mask) if repeat_over_prompt else output_mask
    penalty = torch.where(seen, repetition_penalties[:, None], 1.0).to(logits.dtype)
    logits = logits / penalty if divide_negatives else torch.where(logits > 0, logits / penalty, logits * penalty)
    counts, mask = output_counts, output_mask
    if openai_over_prompt:
        counts, mask = prompt_counts + output_counts, prompt_mask | output_mask
    logits = logits - frequency_penalties[:, None] * (mask if count_once else counts)
    return logits - presence_penalties[:, None] * mask


def apply_penalties_divides_negative_logits(
    logits: torch.Tensor, prompt_token_ids: torch.Tensor, output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor, frequency_penalties: torch.Tensor, repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Divides every seen token's logit by the repetition penalty: a negative logit moves towards 0, so the token
    becomes *more* likely (the classic mistake; CTRL's and Hugging Face's multiply a negative logit)."""
    return _penalties(logits, prompt_token_ids, output_token_ids, presence_penalties, frequency_penalties,
                      repetition_penalties, divide_negatives=True)


def apply_penalties_repetition_over_the_output_only(
    logits: torch.Tensor, prompt_token_ids: torch.Tensor, output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor, frequency_penalties: torch.Tensor, repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Applies the repetition penalty to the output tokens only, like the other two: a token the prompt repeats
    is not penalised (vLLM's and Hugging Face's cover the prompt too)."""
    return _penalties(logits, prompt_token_ids, output_token_ids, presence_penalties, frequency_penalties,
                      repetition_penalties, repeat_over_prompt=False)


def apply_penalties_presence_and_frequency_over_the_prompt(
    logits: torch.Tensor, prompt_token_ids: torch.Tensor, output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor, frequency_penalties: torch.Tensor, repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Counts the prompt's tokens for the presence and frequency penalties too, as for the repetition penalty:
    OpenAI's formula counts only what was generated."""
    return _penalties(logits, prompt_token_ids, output_token_ids, presence_penalties, frequency_penalties,
                      repetition_penalties, openai_over_prompt=True)


def apply_penalties_frequency_counts_each_token_once(
    logits: torch.Tensor, prompt_token_ids: torch.Tensor, output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor, frequency_penalties: torch.Tensor, repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Subtracts the frequency penalty once per distinct output token (the mask), not once per occurrence: it
    becomes a second presence penalty."""
    return _penalties(logits, prompt_token_ids, output_token_ids, presence_penalties, frequency_penalties,
                      repetition_penalties, count_once=True)


MUTANTS = {
    "schedule_drops_the_copies": {"Scheduler": DropsTheCopies},
    "schedule_ignores_the_budget": {"Scheduler": IgnoresTheBudget},
    "schedule_starves_running": {"Scheduler": StarvesRunning},
    "schedule_without_chunking": {"Scheduler": NoChunking},
    "schedule_ignores_max_num_seqs": {"Scheduler": IgnoresMaxNumSeqs},
    "schedule_skips_the_blocked_head": {"Scheduler": SkipsTheBlockedHead},
    "schedule_admits_after_preempting": {"Scheduler": AdmitsAfterPreempting},
    "schedule_ignores_cached_tokens": {"Scheduler": IgnoresCachedTokens},
    "schedule_computed_before_allocating": {"Scheduler": ComputedBeforeAllocating},
    "schedule_counts_resumed_as_new": {"Scheduler": CountsResumedAsNew},
    "schedule_leaves_resumed_preempted": {"Scheduler": LeavesResumedPreempted},
    "schedule_resumes_from_zero": {"Scheduler": ResumesFromZero},
    "schedule_never_advances_the_batch": {"Scheduler": NeverAdvancesTheBatch},
    "schedule_counts_only_running_sequences": {"Scheduler": CountsOnlyRunningSequences},
    "schedule_steps_past_a_victim_ahead": {"Scheduler": StepsPastAVictimAhead},
    "schedule_keeps_the_victims_budget": {"Scheduler": KeepsTheVictimsBudget},
    "select_victim_picks_the_first": {"select_victim": select_victim_picks_the_first},
    "select_victim_fcfs_latest_arrival": {"select_victim": select_victim_fcfs_latest_arrival},
    "select_victim_priority_picks_the_smallest": {"select_victim": select_victim_priority_picks_the_smallest},
    "select_victim_priority_ties_to_the_oldest": {"select_victim": select_victim_priority_ties_to_the_oldest},
    "select_victim_priority_ignores_the_seq_id": {"select_victim": select_victim_priority_ignores_the_seq_id},
    "select_victim_ignores_the_policy": {"select_victim": select_victim_ignores_the_policy},
    "select_victim_lowest_priority_anywhere": {"select_victim": select_victim_lowest_priority_anywhere},
    "allocate_or_preempt_forgets_the_budget": {"allocate_or_preempt": allocate_or_preempt_forgets_the_budget},
    "allocate_or_preempt_keeps_the_victim_scheduled":
        {"allocate_or_preempt": allocate_or_preempt_keeps_the_victim_scheduled},
    "allocate_or_preempt_only_once": {"allocate_or_preempt": allocate_or_preempt_only_once},
    "allocate_or_preempt_runs_past_itself": {"allocate_or_preempt": allocate_or_preempt_runs_past_itself},
    "allocate_or_preempt_priority_looks_behind_first":
        {"allocate_or_preempt": allocate_or_preempt_priority_looks_behind_first},
    "allocate_or_preempt_resets_before_freeing": {"allocate_or_preempt": allocate_or_preempt_resets_before_freeing},
    "allocate_or_preempt_keeps_the_cached_blocks": {"allocate_or_preempt": allocate_or_preempt_keeps_the_cached_blocks},
    "allocate_or_preempt_keeps_the_computed_tokens":
        {"allocate_or_preempt": allocate_or_preempt_keeps_the_computed_tokens},
    "prepare_inputs_reads_the_sequences": {"prepare_inputs": prepare_inputs_reads_the_sequences},
    "prepare_inputs_chunk_positions_from_zero": {"prepare_inputs": prepare_inputs_chunk_positions_from_zero},
    "prepare_inputs_seq_lens_are_query_lens": {"prepare_inputs": prepare_inputs_seq_lens_are_query_lens},
    "prepare_inputs_last_token_only": {"prepare_inputs": prepare_inputs_last_token_only},
    "prepare_inputs_chunk_slots_from_zero": {"prepare_inputs": prepare_inputs_chunk_slots_from_zero},
    "prepare_inputs_query_start_loc_inclusive": {"prepare_inputs": prepare_inputs_query_start_loc_inclusive},
    "sampling_rows_first_rows": {"sampling_rows": sampling_rows_first_rows},
    "sampling_rows_samples_prompt_chunks": {"sampling_rows": sampling_rows_samples_prompt_chunks},
    "sampling_rows_never_forks": {"sampling_rows": sampling_rows_never_forks},
    "sampling_rows_once_the_prompt_is_in": {"sampling_rows": sampling_rows_once_the_prompt_is_in},
    "sampling_rows_from_where_the_tokens_start": {"sampling_rows": sampling_rows_from_where_the_tokens_start},
    "sampling_rows_forks_take_the_next_rows": {"sampling_rows": sampling_rows_forks_take_the_next_rows},
    "engine_step_never_updates": {"engine_step": engine_step_never_updates},
    "engine_step_samples_before_executing": {"engine_step": engine_step_samples_before_executing},
    "engine_step_drops_the_grammar": {"engine_step": engine_step_drops_the_grammar},
    "engine_step_calls_core_step": {"engine_step": engine_step_calls_core_step},
    "engine_step_schedules_twice": {"engine_step": engine_step_schedules_twice},
    "apply_top_p_drops_the_crossing_token": {"apply_top_p": apply_top_p_drops_the_crossing_token},
    "apply_top_p_without_sorting": {"apply_top_p": apply_top_p_without_sorting},
    "apply_top_p_trusts_the_float_sum": {"apply_top_p": apply_top_p_trusts_the_float_sum},
    "apply_top_p_first_rows_p": {"apply_top_p": apply_top_p_first_rows_p},
    "apply_top_p_ascending_keeps_none": {"apply_top_p": apply_top_p_ascending_keeps_none},
    "apply_min_p_absolute": {"apply_min_p": apply_min_p_absolute},
    "apply_min_p_on_logits": {"apply_min_p": apply_min_p_on_logits},
    "apply_min_p_max_over_the_batch": {"apply_min_p": apply_min_p_max_over_the_batch},
    "apply_penalties_divides_negative_logits": {"apply_penalties": apply_penalties_divides_negative_logits},
    "apply_penalties_repetition_over_the_output_only":
        {"apply_penalties": apply_penalties_repetition_over_the_output_only},
    "apply_penalties_presence_and_frequency_over_the_prompt":
        {"apply_penalties": apply_penalties_presence_and_frequency_over_the_prompt},
    "apply_penalties_frequency_counts_each_token_once":
        {"apply_penalties": apply_penalties_frequency_counts_each_token_once},
}

# For every exercise, a mutant that makes the capstone (SmolLM2, preemption storm, chunked prefill, prefix caching,
# a sampled request with penalties) fail: the capstone really runs each exercise.
CAPSTONE_MUTANTS = {
    "Scheduler": "schedule_ignores_cached_tokens",
    "select_victim": "select_victim_lowest_priority_anywhere",
    "allocate_or_preempt": "allocate_or_preempt_keeps_the_victim_scheduled",
    "prepare_inputs": "prepare_inputs_chunk_slots_from_zero",
    "sampling_rows": "sampling_rows_samples_prompt_chunks",
    "engine_step": "engine_step_never_updates",
    "apply_top_p": "apply_top_p_drops_the_crossing_token",
    "apply_min_p": "apply_min_p_absolute",
    "apply_penalties": "apply_penalties_repetition_over_the_output_only",
}

# The statements each exercise's question is about, as `ast.unparse` writes them (a compound statement by its
# header). Hint 2 may show none of them, and nothing under chapters/ may state them (tests/test_hints.py): they
# live here, beside the wrong answers, because a learner reads the chapter's test file.
DECISIVE = {
    "Scheduler": [
        'while not out.preempted_seq_ids and self.waiting and (budget > 0) and self.can_admit(self.waiting.peek()):',
        'index = self.running.index(seq) + 1',
        'num_new_tokens = min(num_behind + len(seq.spec_token_ids), budget, self.long_prefill_token_threshold)',
    ],
    "select_victim": [
        'return scheduler.running[-1]',
        'return max(scheduler.running, key=lambda s: (s.priority, s.arrival, s.seq_id))',
    ],
    "allocate_or_preempt": [
        'while (seq_copies := scheduler.kv_cache_manager.allocate_slots(seq, num_new_tokens)) is None:',
        'if victim in out.scheduled_seqs:',
        'if victim is seq:',
    ],
    "prepare_inputs": [
        'positions += range(start, end)',
        'query_start_loc.append(query_start_loc[-1] + num_new)',
        'seq_lens.append(end)',
    ],
    "apply_top_p": [
        'mass_before = probs.cumsum(dim=-1) - probs',
        'drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)',
    ],
    "apply_min_p": [
        'drop = probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values',
    ],
    "apply_penalties": [
        'seen = prompt_mask | output_mask',
        'logits = torch.where(logits > 0, logits / penalty, logits * penalty)',
        'logits = logits - frequency_penalties[:, None] * output_counts',
    ],
    "sampling_rows": [
        'if seq.num_computed_tokens < seq.num_tokens:',
    ],
    "engine_step": [
        'model_output = core.model_executor.sample_tokens(grammar_output)',
        'return core.scheduler.update_from_output(scheduler_output, model_output, schedule_seconds)',
    ],
}

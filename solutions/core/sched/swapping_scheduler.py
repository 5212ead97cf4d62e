"""Preemption by swapping (chapter 11, `preemption_mode="swap"`), beside the scheduler as data parallelism is.

`SwappingScheduler` is the `Scheduler` with a second way to preempt. When a running sequence needs a block and none
is free, `allocate_or_swap_out` asks `select_preemption` which group leaves (the victim `select_victim` names and
every running sample of its request, which share blocks) and how: swapped out whole to the swap pool
(`_preempt_by_swap`, shared blocks copied once) or recomputed (`_preempt_by_recompute`); a group always moves whole
(the paper's §4.5). `schedule_swapped` brings groups back (`_swap_in_group`) after the running sequences and before
the waiting queue. The KV cache manager alone takes or frees swap blocks; the copies travel in the
`SchedulerOutput`.

Where this lives in vLLM: vLLM v0's `vllm/core/scheduler.py` (`_preempt`, `_preempt_by_swap`, `_preempt_by_recompute`,
`_schedule_swapped`, `PreemptionMode`). vLLM v1 preempts by recompute only.
"""

from enum import Enum

from solutions.config import VllmConfig
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sched.output import SchedulerOutput
from solutions.core.sched.scheduler import Scheduler, select_victim
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.kv_offload.swap import num_group_blocks


class PreemptionMode(Enum):
    """How a preempted group gets its K/V back (vLLM v0's `PreemptionMode`)."""

    SWAP = "swap"  # its blocks copied to the host pool and back
    RECOMPUTE = "recompute"  # its blocks freed; one prefill computes them again


class SwappingScheduler(Scheduler):
    """A `Scheduler` whose KV cache manager has a swap pool: preempted groups may wait there, whole."""

    def __init__(self, kv_cache_manager: KVCacheManager, **kwargs) -> None:
        if kv_cache_manager.swap_pool is None:
            raise ValueError("kv_cache_manager: a SwappingScheduler needs one with a swap pool (enable_swapping)")
        super().__init__(kv_cache_manager, **kwargs)

    @classmethod
    def _make_kv_cache_manager(cls, vllm_config: VllmConfig) -> KVCacheManager:
        """`Scheduler`'s KV cache manager, given the swap pool the config sizes."""
        manager = super()._make_kv_cache_manager(vllm_config)
        manager.enable_swapping(vllm_config.cache_config.num_swap_blocks)
        return manager

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """`Scheduler.finish`; a swapped-out sequence leaves its group and its host blocks are freed."""
        if seq.status is SequenceStatus.SWAPPED:
            group = next(group for group in self.swapped if seq in group)
            group.remove(seq)
            if not group:
                self.swapped.remove(group)
            self.kv_cache_manager.free_swapped(seq)
        super().finish(seq, status)

    def _allocate_or_preempt(
        self, seq: Sequence, num_new_tokens: int, out: SchedulerOutput, copies: dict[int, list[tuple[int, int]]]
    ) -> tuple[list[tuple[int, int]] | None, int]:
        """`allocate_or_swap_out(self, ...)`, looked up in this module when called (chapter 11's decisions)."""
        return allocate_or_swap_out(self, seq, num_new_tokens, out, copies)

    def _schedule_swapped(self, out: SchedulerOutput, budget: int, copies: dict[int, list[tuple[int, int]]]) -> int:
        """`schedule_swapped(self, ...)`, looked up in this module when called (chapter 11's decision)."""
        return schedule_swapped(self, out, budget, copies)

    def group_of(self, seq: Sequence) -> list[Sequence]:
        """`seq`'s sequence group: the running samples of its request, in running order (just `seq` for a sequence
        made by hand, without a request)."""
        return [seq] if seq.request_id is None else [s for s in self.running if s.request_id == seq.request_id]

    def _preempt_by_recompute(
        self, group: list[Sequence], out: SchedulerOutput, copies: dict[int, list[tuple[int, int]]]
    ) -> int:
        """Preempt every sequence of `group` by recompute (vLLM v0: `_preempt_by_recompute`), each out of the batch
        first if it is in it; they wait at the front of the queue in their running order. Returns the budget handed
        back by those that were in the batch."""
        returned = 0
        for seq in reversed(group):
            if seq in out.scheduled_seqs:
                returned += self._remove_from_batch(out, seq, copies)
            self._preempt_request(seq, out)
        return returned

    def _preempt_by_swap(
        self, group: list[Sequence], out: SchedulerOutput, copies: dict[int, list[tuple[int, int]]]
    ) -> int:
        """Preempt `group` by swapping it out whole (vLLM v0: `_preempt_by_swap`): its blocks go to the host pool,
        each sequence leaves the running set for `swapped`. Returns the budget handed back by those that were in this
        step's batch.

        A sequence in the batch leaves it first, with the blocks allocated for this step's tokens (they will now not
        run: `free_uncomputed_blocks`). A copy-on-write this step gave it leaves with its place, so its destination
        holds nothing yet: the swap-out reads the shared block it would have copied instead. The caller has checked
        that the host pool has `num_group_blocks(group)` free blocks.
        """
        returned, read_from = 0, {}
        for seq in group:
            if seq in out.scheduled_seqs:
                read_from.update((dst, src) for src, dst in copies.get(seq.seq_id, []))
                returned += self._remove_from_batch(out, seq, copies)
            self.kv_cache_manager.free_uncomputed_blocks(seq)
        for seq in group:
            self.running.remove(seq)
            seq.spec_token_ids = []
            seq.status = SequenceStatus.SWAPPED
            out.preempted_seq_ids.append(seq.seq_id)
            out.swapped_out_seq_ids.append(seq.seq_id)
        pairs = self.kv_cache_manager.swap_out(group)
        out.blocks_to_swap_out += [(read_from.get(device_id, device_id), host_id) for device_id, host_id in pairs]
        self.swapped.append(group)
        self.num_preemptions += len(group)
        return returned

    def _swap_in_group(
        self, group: list[Sequence], out: SchedulerOutput, budget: int, copies: dict[int, list[tuple[int, int]]]
    ) -> int:
        """Bring swapped-out `group` back (vLLM v0: `_swap_in`): its blocks into fresh device blocks, each sequence
        running again, its full blocks prefix hits again, and scheduled this step if its next tokens fit in `budget`
        and in the free blocks. The caller has checked the room. Returns the budget left."""
        manager = self.kv_cache_manager
        self.swapped.remove(group)
        out.blocks_to_swap_in += manager.swap_in(group)
        for seq in group:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.swapped_in_seq_ids.append(seq.seq_id)
            manager.cache_blocks(seq, 0, seq.num_computed_tokens)
            num_new_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget, self.long_prefill_token_threshold)
            seq_copies = manager.allocate_slots(seq, num_new_tokens) if num_new_tokens > 0 else None
            if seq_copies is not None:  # else it runs from the next step
                self._add_to_batch(out, seq, num_new_tokens, seq_copies, copies)
                budget -= num_new_tokens
        return budget


def scheduler_cls(vllm_config: VllmConfig) -> type[Scheduler]:
    """The scheduler of one KV cache pool: a `SwappingScheduler` with `preemption_mode="swap"`, else a `Scheduler`."""
    return SwappingScheduler if vllm_config.cache_config.swapping else Scheduler


def allocate_or_swap_out(
    scheduler: SwappingScheduler, seq: Sequence, num_new_tokens: int, out: SchedulerOutput,
    copies: dict[int, list[tuple[int, int]]],
) -> tuple[list[tuple[int, int]] | None, int]:
    """`allocate_or_preempt` with a host pool: `select_preemption` names the group that leaves and how, so `seq` may
    leave with a victim's group as well as by being the victim."""
    returned = 0
    while (seq_copies := scheduler.kv_cache_manager.allocate_slots(seq, num_new_tokens)) is None:
        group, mode = select_preemption(scheduler)
        if mode is PreemptionMode.SWAP:
            returned += scheduler._preempt_by_swap(group, out, copies)
        else:
            returned += scheduler._preempt_by_recompute(group, out, copies)
        if seq.status is not SequenceStatus.RUNNING:
            return None, returned
    return seq_copies, returned


def select_preemption(scheduler: SwappingScheduler) -> tuple[list[Sequence], PreemptionMode]:
    """Which group leaves, and how: the victim's whole group (the running samples of its request, which share blocks),
    swapped out if the host pool has a block for each of its distinct blocks and the group could come back (its blocks
    and one more per sequence fit the device pool), else recomputed (the paper's §4.5). The victim is the one
    `select_victim` names, as for preemption by recompute."""
    group = scheduler.group_of(select_victim(scheduler))
    num_blocks = num_group_blocks(group)
    fits_host = num_blocks <= scheduler.kv_cache_manager.swap_pool.num_free_blocks
    can_return = num_blocks + len(group) <= scheduler.kv_cache_manager.num_blocks
    return group, PreemptionMode.SWAP if fits_host and can_return else PreemptionMode.RECOMPUTE


def schedule_swapped(
    scheduler: SwappingScheduler, out: SchedulerOutput, budget: int, copies: dict[int, list[tuple[int, int]]]
) -> int:
    """After the running sequences: bring swapped-out groups back (`_swap_in_group`), oldest first and none past one
    that does not fit, while the device has a block for each of a group's blocks and for each sequence's next token,
    the running set has seats and the step has budget; none in a step that preempted (the memory just freed is the
    running sequences'). Returns the budget new admissions may use: none while a group is still out (vLLM v0
    schedules prefills only while nothing is swapped)."""
    manager = scheduler.kv_cache_manager
    while scheduler.swapped and budget > 0 and not out.preempted_seq_ids:
        group = scheduler.swapped[0]
        seats = sum(1 + len(s.fork_seq_ids) for s in group)
        if num_group_blocks(group) + len(group) > manager.num_free_blocks:
            break
        if scheduler._num_seats() + seats > scheduler.max_num_seqs:
            break
        budget = scheduler._swap_in_group(group, out, budget, copies)
    return 0 if scheduler.swapped else budget

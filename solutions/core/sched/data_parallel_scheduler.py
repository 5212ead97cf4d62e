"""Data parallelism: one scheduler over N model replicas, one KV block pool each.

Each replica is a whole engine's worth of capacity (its own `max_num_seqs`, token budget and pool), so its step is
decided by chapter 5's rule, a `Scheduler` over its own `KVCacheManager` (`replicas[r]`). This scheduler adds what
only a view of every pool can decide:

- placement: a new sequence waits here until some replica can take it now (a seat for it and its forks, free
  blocks for its first chunk); the policy (`placement.py`) picks one, and the sequence stays there for life;
- a dead replica (`drop_replica`): every sequence it had comes back here, at the front, to be recomputed elsewhere;
- replicas step on their own: one is scheduled again as soon as its last step is back (`in_flight`), so a long
  prefill never holds up another's decodes; each engine step merges the steps it starts
  (`DataParallelSchedulerOutput`) and takes back whichever came back (`DataParallelModelRunnerOutput`).

Where this lives in vLLM (read 2026-12-03, stored copy at commit 00080ee): `vllm/v1/engine/core_client.py`
(`DPLBAsyncMPClient`: N engine cores, each with its own `Scheduler`, one picked per request at arrival by a load
score, `placement.ReplicaState.load`). Only a MoE model's ranks step together (`DPEngineCoreProc`). SGLang's router
(`sgl-model-gateway`) does the same in front of N servers, by an approximate prefix match. Here the choice is made
at admission, one scheduler seeing every pool's hashes.
"""

import logging
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Self

from solutions.config import VllmConfig
from solutions.core.data_parallel_kv_cache_manager import DataParallelKVCacheManager
from solutions.core.sched.output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from solutions.core.sched.placement import PlacementPolicy, ReplicaState, create_placement_policy
from solutions.core.sched.request_queue import SchedulingPolicy, create_request_queue
from solutions.core.sched.scheduler import Scheduler
from solutions.core.sched.swapping_scheduler import scheduler_cls
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.engine import EngineCoreOutputs
from solutions.metrics.stats import SchedulerStats
from solutions.utils.math_utils import cdiv

if TYPE_CHECKING:
    from solutions.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DataParallelSchedulerOutput(SchedulerOutput):
    """The step of the replicas scheduled now: each replica's own output in `replica_outputs` (what its worker runs),
    and their sequences, tokens and ids concatenated in replica order, so the step reads as one batch (sampling rows
    and grammar masks in that order). Block ids mean nothing outside their pool, so the fields of block copies
    (`PER_POOL`) stay in the replicas' outputs."""

    replica_outputs: dict[int, SchedulerOutput] = field(default_factory=dict)

    @classmethod
    def merge(cls, replica_outputs: dict[int, SchedulerOutput]) -> Self:
        """Every field of `SchedulerOutput` but the per-pool ones, joined over the replicas: lists concatenated,
        maps united, counts summed."""
        out = cls(num_computed_tokens=[], replica_outputs=replica_outputs)
        for part in replica_outputs.values():
            for f in fields(SchedulerOutput):
                if f.metadata.get("per_pool"):
                    continue
                mine, theirs = getattr(out, f.name), getattr(part, f.name)
                if isinstance(mine, list):
                    mine.extend(theirs)
                elif isinstance(mine, dict):
                    mine.update(theirs)
                else:
                    setattr(out, f.name, mine + theirs)
        return out


@dataclass(slots=True)
class DataParallelModelRunnerOutput:
    """The replicas' steps that came back in one engine step: replica -> its runner's output (replicas not here are
    still running theirs, or died)."""

    replica_outputs: dict[int, ModelRunnerOutput] = field(default_factory=dict)


class DataParallelScheduler:
    """Places sequences on replicas and runs each replica's `Scheduler`; the engine core's verbs, as `Scheduler`'s.
    Invariants: an unplaced sequence (`replica` None) is in `waiting` and holds no block; a placed one is in its
    replica's queues and holds blocks of its pool only; `requests` is shared with every replica."""

    def __init__(self, replicas: list[Scheduler], placement: PlacementPolicy, policy: SchedulingPolicy) -> None:
        self.replicas = replicas
        self.kv_cache_manager = DataParallelKVCacheManager([replica.kv_cache_manager for replica in replicas])
        self.placement = placement
        self.waiting = create_request_queue(policy)  # not placed yet
        self.requests: dict[str, list[Sequence]] = {}
        for replica in replicas:
            replica.requests = self.requests
        self.in_flight: dict[int, SchedulerOutput] = {}  # replica -> its step whose tokens are not back yet
        self.num_requeued = 0  # sequences sent back here by a dead replica, over the scheduler's life

    @classmethod
    def from_config(cls, vllm_config: VllmConfig, structured_output_manager: "StructuredOutputManager") -> Self:
        """`data_parallel_size` replicas, each the scheduler (and pool) one engine of this config would have."""
        parallel = vllm_config.parallel_config
        replicas = [
            scheduler_cls(vllm_config).from_config(vllm_config, structured_output_manager)
            for _ in range(parallel.data_parallel_size)
        ]
        placement = create_placement_policy(parallel.data_parallel_placement, parallel.data_parallel_size)
        return cls(replicas, placement, SchedulingPolicy(vllm_config.scheduler_config.policy))

    @property
    def live_replicas(self) -> list[int]:
        return self.kv_cache_manager.live_replicas

    @property
    def num_preemptions(self) -> int:
        return sum(replica.num_preemptions for replica in self.replicas)

    def add_request(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = [seq]
        self.waiting.add(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def finish_requests(self, request_ids: list[str], status: SequenceStatus) -> None:
        """Finish every unfinished sample of these requests, placed or not, and forget them."""
        for request_id in request_ids:
            for seq in self.requests.pop(request_id, []):
                if seq.is_finished:
                    continue
                if seq.replica is None:
                    self.waiting.remove(seq)
                    seq.status = status
                else:
                    self.replicas[seq.replica].finish(seq, status)

    # --- a step ----------------------------------------------------------------------------------------------------

    def schedule(self) -> DataParallelSchedulerOutput:
        """Place what can be placed, then one step of every live replica that has work and no step in flight (the
        others are still running theirs: replicas do not wait for each other), merged."""
        self.place_waiting()
        parts = {
            r: self.replicas[r].schedule() for r in self.live_replicas
            if r not in self.in_flight and self.replicas[r].has_work()
        }
        self.in_flight.update(parts)
        return DataParallelSchedulerOutput.merge(parts)

    def place_waiting(self) -> None:
        """Hand sequences from the front of `waiting` to replicas, in queue order, while one can take the next."""
        while self.waiting:
            seq = self.waiting.peek()
            cached = self.kv_cache_manager.num_cached_blocks(seq)
            states = [state for state in self.replica_states(cached) if self._can_take(seq, state)]
            if not states:
                return  # it waits here; nobody behind it jumps the line
            replica = self.placement.place(seq, states)
            self.waiting.pop()
            seq.replica = replica
            self.replicas[replica].add_seq(seq)

    def replica_states(self, cached: list[int]) -> list[ReplicaState]:
        """What placement sees of each live replica; `cached[r]`: the sequence's blocks in replica r's pool."""
        return [
            ReplicaState(r, sum(1 + len(s.fork_seq_ids) for s in self.replicas[r].running),
                         sum(1 + len(s.fork_seq_ids) for s in self.replicas[r].waiting),
                         self.replicas[r].kv_cache_manager.num_free_blocks, cached[r],
                         self.replicas[r].kv_cache_manager.num_blocks)
            for r in self.live_replicas
        ]

    def _can_take(self, seq: Sequence, state: ReplicaState) -> bool:
        """`can_take(self, seq, state)`, looked up in this module when called (chapter 12's decision)."""
        return can_take(self, seq, state)

    def get_grammar_bitmask(self, scheduler_output: DataParallelSchedulerOutput) -> GrammarOutput | None:
        """The masks of the merged batch's sampling rows (the executor cuts them per replica)."""
        return self.replicas[0].get_grammar_bitmask(scheduler_output)

    def update_from_output(
        self, scheduler_output: DataParallelSchedulerOutput, model_output: DataParallelModelRunnerOutput,
        schedule_seconds: float = 0.0,
    ) -> EngineCoreOutputs:
        """Each replica whose step came back takes its tokens (against that step, scheduled this engine step or an
        earlier one); the outputs in replica order, the stats summed with the others' state now."""
        outputs, stats = [], {}
        for r, part_output in sorted(model_output.replica_outputs.items()):
            result = self.replicas[r].update_from_output(self.in_flight.pop(r), part_output, schedule_seconds)
            outputs += result.outputs
            stats[r] = result.scheduler_stats
        others = [self.replicas[r].make_stats() for r in self.live_replicas if r not in stats]
        return EngineCoreOutputs(outputs, self._merge_stats([*stats.values(), *others]))

    def make_stats(self) -> SchedulerStats:
        """The state between steps, every live replica's summed."""
        return self._merge_stats([self.replicas[r].make_stats() for r in self.live_replicas])

    def _merge_stats(self, stats: list[SchedulerStats]) -> SchedulerStats:
        """Counts summed (the unplaced sequences count as waiting), KV usage over the live pools, each stage's time
        the longest replica's (they run side by side)."""
        manager = self.kv_cache_manager
        merged = SchedulerStats(0, len(self.waiting), 0, 0.0, 0, 0)
        for replica_stats in stats:
            for f in fields(SchedulerStats):
                value = getattr(replica_stats, f.name)
                if isinstance(value, int):
                    setattr(merged, f.name, getattr(merged, f.name) + value)
            for stage, seconds in replica_stats.seconds.items():
                merged.seconds[stage] = max(merged.seconds.get(stage, 0.0), seconds)
        merged.kv_cache_usage = manager.num_used_blocks / manager.num_blocks if manager.num_blocks else 0.0
        merged.num_dead_replicas = len(self.replicas) - len(self.live_replicas)
        return merged

    # --- faults ----------------------------------------------------------------------------------------------------

    def drop_replica(self, replica: int) -> None:
        """`drop_replica(self, replica)`, looked up in this module when called (chapter 12's decision), once the
        dead replica's step in flight is forgotten."""
        self.in_flight.pop(replica, None)
        drop_replica(self, replica)


def can_take(scheduler: DataParallelScheduler, seq: Sequence, state: ReplicaState) -> bool:
    """Whether replica `state.replica` can take waiting `seq` now: a seat for it and its samples beside those running
    and queued there, and free blocks for the first chunk of every sequence queued there and of `seq` (past what its
    pool holds of it). An idle replica takes anything: its scheduler chunks the prompt or waits for nothing."""
    replica = scheduler.replicas[state.replica]
    if not replica.has_work():
        return True
    if state.num_running + state.num_waiting + 1 + len(seq.fork_seq_ids) > replica.max_num_seqs:
        return False
    block_size = replica.kv_cache_manager.block_size
    chunk = min(replica.long_prefill_token_threshold, replica.max_num_batched_tokens)
    needed = cdiv(min(seq.num_tokens - state.num_cached_blocks * block_size, chunk), block_size)
    needed += sum(cdiv(min(queued.num_tokens, chunk), block_size) for queued in replica.waiting)
    return needed <= state.num_free_blocks


def drop_replica(scheduler: DataParallelScheduler, replica: int) -> None:
    """Replica `replica`'s process died: mark its pool gone and requeue every sequence it had, at the front, with
    nothing computed and no replica (its tokens kept: it resumes by recompute wherever it is placed next).
    RuntimeError once no replica is left."""
    scheduler.kv_cache_manager.mark_gone(replica)
    dead = scheduler.replicas[replica]
    seqs = [*dead.running, *dead.waiting, *(seq for group in dead.swapped for seq in group)]
    for seq in seqs:
        # never admitted: still new; else it resumes, as after a preemption
        status = SequenceStatus.WAITING if seq.status is SequenceStatus.WAITING else SequenceStatus.PREEMPTED
        dead.finish(seq, SequenceStatus.FINISHED_ABORTED)  # frees its blocks: the gone pool's books balance
        seq.status, seq.num_computed_tokens, seq.spec_token_ids, seq.replica = status, 0, [], None
    for seq in sorted(seqs, key=lambda s: (s.arrival, s.seq_id), reverse=True):
        scheduler.waiting.prepend(seq)
    scheduler.num_requeued += len(seqs)
    logger.error("data-parallel replica %d died; %d sequences requeued on replicas %s",
                 replica, len(seqs), scheduler.live_replicas)
    if not scheduler.live_replicas:
        raise RuntimeError(f"every data-parallel replica has died (the last: replica {replica}); nothing can run")

"""The scheduler: which sequences compute how many tokens this step, under one token budget.

There is no prefill phase and decode phase. Every sequence has `num_tokens` tokens, of which
`num_computed_tokens` already have K/V in the cache; a step lets some of them catch up (a decoding sequence is one
token behind, a new one its whole prompt, a preempted one everything). So one rule serves all: give each sequence
`min(tokens behind, budget left, long_prefill_token_threshold)` tokens, running sequences first (in the order they
started), then waiting ones in the queue's order. A long prompt is thus prefilled in chunks while the running
sequences keep decoding beside it (chunked prefill).

When the KV cache manager has no block for a running sequence, the scheduler preempts by recompute
(`allocate_or_preempt`, the victim named by `select_victim`) until the allocation succeeds or the victim is the
sequence itself; no waiting sequence is admitted in a step that preempted. Chapter 11's `SwappingScheduler` may swap
a victim's group out instead; with the prefix cache's host tier (`kv_offloading_size`), blocks an admitted sequence
finds on the host are loaded instead of computed.

The scheduler is the one writer of a sequence's progress (`_update_after_schedule`), so the batch never changes
after `schedule()` returns; after the forward pass, `update_from_output` takes the sampled tokens back.

Speculative decoding: a decoding sequence with drafts schedules its newest token and as many drafts as
`num_scheduled_spec_tokens` admits; `update_from_output` hands back the rejected ones (`hand_back_rejected_drafts`).

The module is split so that each idea can be read (and, in chapter 5, written) on its own: `SchedulerBase` holds
the queues and the bookkeeping, `select_victim` is who gives memory up, `allocate_or_preempt` when, and `Scheduler`
adds the one method that decides a step, `schedule`.

Where this lives in vLLM: `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`, whose loop around
`allocate_slots` is our `allocate_or_preempt` and the victim it picks there our `select_victim`; `_preempt_request`,
`update_from_output`, `get_grammar_bitmask`; `spec_token_ids` trimmed to the budget and `max_model_len` in
`schedule`, the rollback of `num_computed_tokens` for rejected drafts in `update_from_output`).
"""

import importlib
import time
from typing import TYPE_CHECKING, Self

import torch

from solutions.config import VllmConfig
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sched.output import DraftTokenIds, GrammarOutput, ModelRunnerOutput, SchedulerOutput
from solutions.core.sched.request_queue import SchedulingPolicy, create_request_queue
from solutions.core.sched.stop import check_stop
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.engine import EngineCoreOutput, EngineCoreOutputs
from solutions.kv_offload.manager import get_num_new_matched_tokens, update_state_after_alloc
from solutions.metrics.stats import SchedulerStats
from solutions.outputs import FinishReason

if TYPE_CHECKING:  # the engine core hands it in; the scheduler sits below it
    from solutions.structured_output import StructuredOutputManager

FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class SchedulerBase:
    """Owns the waiting queue and the running list, and the helpers `schedule()` is written with.

    Invariants: a sequence is in exactly one of `waiting`, `running` or neither (finished, or a sample not yet
    forked); every running sequence holds blocks for at least its computed tokens; the running sequences and the
    samples they will fork never number more than `max_num_seqs`.
    """

    def __init__(
        self, kv_cache_manager: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
        long_prefill_token_threshold: int, policy: SchedulingPolicy = SchedulingPolicy.FCFS,
        max_model_len: int | None = None, eos_token_id: int | None = None,
        structured_output_manager: "StructuredOutputManager | None" = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs  # at most this many sequences running at once
        self.max_num_batched_tokens = max_num_batched_tokens  # the token budget of one step
        # at most this many tokens per sequence per step
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.policy = policy
        self.max_model_len, self.eos_token_id = max_model_len, eos_token_id  # for the stop checks
        self.structured_output_manager = structured_output_manager
        self.waiting = create_request_queue(policy)
        self.running: list[Sequence] = []  # in the order they started running
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its samples' sequences, until all finish
        self.num_preemptions = 0  # over the scheduler's life
        # swapped-out groups, in the order they went out: only chapter 11's `SwappingScheduler` fills it
        self.swapped: list[list[Sequence]] = []
        self._reported_queries = self._reported_hits = 0  # prefix-cache lookups already in a SchedulerStats
        self._reported_external = (0, 0)  # the host tier's (queries, hits) already in a SchedulerStats

    @classmethod
    def from_config(cls, vllm_config: VllmConfig, structured_output_manager: "StructuredOutputManager") -> Self:
        """The scheduler of an engine, with the KV cache manager its config names."""
        sched = vllm_config.scheduler_config
        return cls(
            cls._make_kv_cache_manager(vllm_config), max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            long_prefill_token_threshold=sched.long_prefill_token_threshold, policy=SchedulingPolicy(sched.policy),
            max_model_len=sched.max_model_len, eos_token_id=vllm_config.model_config.eos_token_id,
            structured_output_manager=structured_output_manager,
        )

    @classmethod
    def _make_kv_cache_manager(cls, vllm_config: VllmConfig) -> KVCacheManager:
        """The KV cache manager the config names, with the prefix cache's host tier if it asks for one."""
        cache = vllm_config.cache_config
        module_name, _, class_name = cache.kv_cache_manager_cls.rpartition(".")
        manager_cls = getattr(importlib.import_module(module_name), class_name)
        manager = manager_cls(cache.num_kv_blocks, cache.block_size, cache.enable_prefix_caching,
                              **cache.kv_cache_manager_kwargs)
        if cache.num_offload_blocks:
            manager.enable_offloading(cache.num_offload_blocks)
        return manager

    def add_seq(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    def add_request(self, seq: Sequence) -> None:
        """Queue the first sequence of an engine request (its other samples are forked from it later)."""
        self.requests[seq.request_id] = [seq]
        self.add_seq(seq)

    def finish_requests(self, request_ids: list[str], status: SequenceStatus) -> None:
        """Finish every unfinished sample of these requests (unknown or finished ids are ignored: an abort may
        cross the request's last output) and forget them."""
        for request_id in request_ids:
            for seq in self.requests.pop(request_id, []):
                if not seq.is_finished:
                    self.finish(seq, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether a step could schedule anything: a sequence running, waiting or swapped out here."""
        return bool(self.running or self.waiting or self.swapped)

    def add_running(self, seq: Sequence) -> None:
        """Start `seq` running as it is (its blocks and computed tokens already set up): a forked sample, or a
        test's or a chapter's hand-made running sequence."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def can_admit(self, seq: Sequence) -> bool:
        """Is there room in the running set for waiting `seq` and the samples it will fork? (Whether swapped-out
        groups leave any budget to new admissions is `schedule_swapped`'s answer, chapter 11.)"""
        return self._num_seats() + 1 + len(seq.fork_seq_ids) <= self.max_num_seqs

    def _num_seats(self) -> int:
        """Seats taken in the running set: the running sequences and the samples they will fork."""
        return sum(1 + len(s.fork_seq_ids) for s in self.running)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks, whatever its state."""
        assert status.is_finished, f"{status} is not a finished state"
        if seq in self.running:
            self.running.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self.waiting.remove(seq)
        self.kv_cache_manager.free(seq)
        seq.status = status

    # --- helpers for schedule() ----------------------------------------------------------------------------------

    def _allocate_or_preempt(
        self, seq: Sequence, num_new_tokens: int, out: SchedulerOutput, copies: dict[int, list[tuple[int, int]]]
    ) -> tuple[list[tuple[int, int]] | None, int]:
        """`allocate_or_preempt(self, ...)`, looked up in this module when called: `schedule()` reaches the
        preemption decision through this method, so any `schedule()` runs whichever one the module holds."""
        return allocate_or_preempt(self, seq, num_new_tokens, out, copies)

    def _add_to_batch(
        self, out: SchedulerOutput, seq: Sequence, num_new_tokens: int, seq_copies: list[tuple[int, int]],
        copies: dict[int, list[tuple[int, int]]],
    ) -> None:
        """Put `seq` into the step's batch with `num_new_tokens` tokens, and count them as prefill or decode."""
        if seq.spec_token_ids and num_new_tokens != 1 + len(seq.spec_token_ids):
            raise RuntimeError(
                f"sequence {seq.seq_id} keeps {len(seq.spec_token_ids)} drafts but is given {num_new_tokens} tokens: "
                "its newest token and each draft take one (num_scheduled_spec_tokens kept more than the step can take)"
            )
        out.scheduled_seqs.append(seq)
        out.num_scheduled_tokens.append(num_new_tokens)
        out.num_computed_tokens.append(seq.num_computed_tokens)  # where its new tokens start
        copies[seq.seq_id] = seq_copies
        if seq.spec_token_ids:
            out.scheduled_spec_decode_tokens[seq.seq_id] = list(seq.spec_token_ids)
        if _is_decode(seq, num_new_tokens):
            out.num_decode_tokens += num_new_tokens
        else:
            out.num_prefill_tokens += num_new_tokens

    def _remove_from_batch(self, out: SchedulerOutput, seq: Sequence, copies: dict[int, list[tuple[int, int]]]) -> int:
        """Undo `_add_to_batch` for `seq`, which must be in this step's batch; return the tokens it had taken."""
        if seq not in out.scheduled_seqs:
            raise RuntimeError(f"sequence {seq.seq_id} is not in this step's batch")
        position = out.scheduled_seqs.index(seq)
        num_tokens = out.num_scheduled_tokens.pop(position)
        out.scheduled_seqs.pop(position)
        out.num_computed_tokens.pop(position)
        copies.pop(seq.seq_id, None)  # its copies' destinations are freed with the rest of its blocks
        out.scheduled_spec_decode_tokens.pop(seq.seq_id, None)
        if _is_decode(seq, num_tokens):
            out.num_decode_tokens -= num_tokens
        else:
            out.num_prefill_tokens -= num_tokens
        return num_tokens

    def _preempt_request(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preemption by recompute, the bookkeeping: free every block, forget the computed tokens, wait at the
        front of the queue (vLLM: `Scheduler._preempt_request`). `seq` must be running and out of the batch.

        The tokens themselves are kept, so the sequence later resumes where it was, recomputing its K/V (prefix
        caching usually finds most of its blocks still cached). Free before resetting `num_computed_tokens`: the
        KV cache manager reads it to tell computed blocks from blocks whose K/V were never written.
        """
        if seq in out.scheduled_seqs:
            raise RuntimeError(f"sequence {seq.seq_id} is preempted but still in this step's batch")
        self.running.remove(seq)
        self.kv_cache_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []  # proposed again once it samples
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.prepend(seq)
        out.preempted_seq_ids.append(seq.seq_id)
        self.num_preemptions += 1

    def _schedule_swapped(self, out: SchedulerOutput, budget: int, copies: dict[int, list[tuple[int, int]]]) -> int:
        """The budget left to admissions once swapped-out groups have come back: here nothing is ever swapped out,
        so all of it (chapter 11's `SwappingScheduler` brings its groups back here)."""
        return budget

    def _get_num_offloaded_tokens(self, seq: Sequence, num_cached_tokens: int) -> int:
        """Tokens past the device's prefix hits that the host tier holds (0 without one, or for a sequence that must
        compute its whole prompt)."""
        offloading = self.kv_cache_manager.offloading
        if offloading is None or seq.skip_reading_prefix_cache:
            return 0
        return get_num_new_matched_tokens(offloading, seq.block_hashes, seq.num_tokens, num_cached_tokens,
                                          self.kv_cache_manager.block_size)

    def _load_offloaded(self, seq: Sequence, num_cached_tokens: int, num_external: int) -> None:
        """Load the host tier's hits into the device blocks just allocated for them."""
        if num_external:
            update_state_after_alloc(self.kv_cache_manager.offloading, seq.block_hashes, seq.block_table,
                                     num_cached_tokens, num_external, self.kv_cache_manager.block_size)

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """The batch is decided: advance each scheduled sequence past its scheduled tokens — the one place a
        step's progress is written — and fork the samples of each `n > 1` prompt this step completes. A
        forked sample shares its parent's blocks, joins `out.forked_seqs[parent id]` and runs from the next step.
        (vLLM: `Scheduler._update_after_schedule`; it forks `n > 1` at admission instead, `ParentRequest`.)"""
        advance_computed_tokens(out)
        if (offloading := self.kv_cache_manager.offloading) is not None:
            out.blocks_to_store, out.blocks_to_load = offloading.take_transfers()
        for seq in out.scheduled_seqs:
            if seq.fork_seq_ids and seq.num_computed_tokens == seq.num_tokens:
                out.forked_seqs[seq.seq_id] = [self._fork(seq, child_id) for child_id in seq.fork_seq_ids]
                seq.fork_seq_ids = []

    def _fork(self, parent: Sequence, child_id: int) -> Sequence:
        """Sample `len(samples)` of the parent's request: its blocks shared, its own generator and grammar."""
        child = parent.fork(child_id)
        if parent.request_id in self.requests:  # an engine request (not a hand-made sequence of a chapter)
            samples = self.requests[parent.request_id]
            child.sample_index = len(samples)
            child.seed = parent.seed + child.sample_index
            child.generator = torch.Generator().manual_seed(child.seed)
            constraint = parent.sampling_params.structured_outputs
            if constraint is not None:
                (child.grammar,) = self.structured_output_manager.grammar_init(constraint, 1)
            samples.append(child)
        self.kv_cache_manager.fork(parent, child)
        self.add_running(child)
        return child

    # --- after the forward pass ----------------------------------------------------------------------------------

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """Start filling the token masks of the step's sampling rows (None when none has a grammar): on the
        structured output manager's thread, so the fill overlaps the forward pass."""
        if self.structured_output_manager is None:
            return None
        future = self.structured_output_manager.grammar_bitmask(scheduler_output)
        return None if future is None else GrammarOutput(future)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput, schedule_seconds: float = 0.0
    ) -> EngineCoreOutputs:
        """Append each sequence's new tokens, advance its grammar, check its stops, free the finished; hand back
        rejected drafts and keep the next ones; the step's outputs, one per sampling sequence, and its stats."""
        start = time.perf_counter()
        if (offloading := self.kv_cache_manager.offloading) is not None:
            offloading.complete_transfers()  # the step has run: its host blocks are read and written
        seqs = {seq.seq_id: seq for seq in scheduler_output.scheduled_seqs}
        seqs.update((child.seq_id, child) for samples in scheduler_output.forked_seqs.values() for child in samples)
        num_cached = {
            seqs[seq_id].request_id: scheduler_output.num_cached_tokens.get(seq_id, 0)
            for seq_id in scheduler_output.new_seq_ids if seq_id in seqs
        }
        prompt_logprobs = dict(model_output.prompt_logprobs)  # seq_id -> this step's chunk of its prompt logprobs
        # seq_id -> where its tokens of this step started
        starts = dict(zip([s.seq_id for s in scheduler_output.scheduled_seqs], scheduler_output.num_computed_tokens))
        num_drafts = num_draft_tokens = num_accepted_tokens = 0
        num_accepted_tokens_per_pos: list[int] = []  # position j: drafts accepted at j (so all before it too)
        outputs = []
        for b, seq_id in enumerate(model_output.seq_ids):
            seq, sampled = seqs[seq_id], model_output.sampled_token_ids[b]
            if seq.is_finished:  # aborted while its step ran (a data-parallel replica's step outlives engine steps)
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(seq_id, [])
            seq.spec_token_ids = []  # verified now; the next ones come from `update_draft_token_ids`
            num_draft_tokens += len(drafts)
            num_accepted_tokens += len(sampled) - 1 if drafts else 0
            if drafts:  # vLLM's SpecDecodingStats.observe_draft: one draft, and its accepted run
                num_drafts += 1
                num_accepted_tokens_per_pos += [0] * (len(drafts) - len(num_accepted_tokens_per_pos))
                for pos in range(len(sampled) - 1):
                    num_accepted_tokens_per_pos[pos] += 1
            new_token_ids, stopped = [], None
            for token_id in sampled:  # a stop inside the run ends it there
                seq.append_token(token_id)
                new_token_ids.append(token_id)
                if seq.grammar is not None and not seq.grammar.accept_tokens([token_id]):
                    raise RuntimeError(f"sequence {seq.seq_id} sampled token {token_id}, "
                                       "which its grammar's mask forbids")
                if (stopped := check_stop(seq, self.eos_token_id, self.max_model_len)) is not None:
                    break
            finish_reason, stop_reason = None, None
            if drafts:  # positions scheduled but not kept (rejected drafts, a tail cut by a stop): chapter 10
                hand_back_rejected_drafts(self.kv_cache_manager, seq, starts[seq_id], len(sampled))
            if stopped is not None:
                status, stop_reason = stopped
                self.finish(seq, status)
                finish_reason = FINISH_REASONS[status]
                samples = self.requests[seq.request_id]
                if len(samples) == seq.sampling_params.n and all(s.is_finished for s in samples):
                    del self.requests[seq.request_id]  # every sample is done
            logprobs = model_output.logprobs[b]
            outputs.append(EngineCoreOutput(
                seq.request_id, seq.sample_index, new_token_ids,
                None if logprobs is None else logprobs[: len(new_token_ids)], finish_reason, stop_reason,
                num_cached.pop(seq.request_id, None) if seq.sample_index == 0 else None,
                prompt_logprobs.pop(seq_id, None),
            ))
        outputs += [EngineCoreOutput(request_id, 0, [], num_cached_tokens=n) for request_id, n in num_cached.items()]
        outputs += [  # prompt chunks that sampled nothing yet
            EngineCoreOutput(seqs[seq_id].request_id, 0, [], new_prompt_logprobs=chunk)
            for seq_id, chunk in prompt_logprobs.items()
        ]
        seconds = {"schedule": schedule_seconds, **model_output.seconds, "postprocess": time.perf_counter() - start}
        stats = self.make_stats(scheduler_output, seconds)
        stats.num_draft_tokens, stats.num_accepted_tokens = num_draft_tokens, num_accepted_tokens
        stats.num_drafts, stats.num_accepted_tokens_per_pos = num_drafts, num_accepted_tokens_per_pos
        return EngineCoreOutputs(outputs, stats)

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Keep the proposer's drafts (made after this step's sampling) for each sequence still running, for its
        next step (vLLM: `Scheduler.update_draft_token_ids`, called by `EngineCore.post_step`)."""
        running = {seq.seq_id: seq for seq in self.running}
        for seq_id, drafts in zip(draft_token_ids.seq_ids, draft_token_ids.draft_token_ids, strict=True):
            if (seq := running.get(seq_id)) is not None:  # not finished (nor preempted) since the proposal
                seq.spec_token_ids = list(drafts)  # how many of them the next step takes, `schedule` decides

    def make_stats(
        self, scheduler_output: SchedulerOutput | None = None, seconds: dict | None = None
    ) -> SchedulerStats:
        """The scheduler's state now, what the step did (if one ran), and the prefix-cache lookups since the last
        report."""
        cache_stats, manager = self.kv_cache_manager.prefix_cache_stats, self.kv_cache_manager
        queries, hits = cache_stats.queries - self._reported_queries, cache_stats.hits - self._reported_hits
        self._reported_queries, self._reported_hits = cache_stats.queries, cache_stats.hits
        stats = SchedulerStats(len(self.running), len(self.waiting), manager.num_used_blocks,
                               manager.num_used_blocks / manager.num_blocks, queries, hits, seconds=seconds or {})
        stats.num_swapped = sum(len(group) for group in self.swapped)
        if (offloading := manager.offloading) is not None:
            queries, hits = offloading.stats.queries, offloading.stats.hits
            stats.external_prefix_cache_queries = queries - self._reported_external[0]
            stats.external_prefix_cache_hits = hits - self._reported_external[1]
            self._reported_external = (queries, hits)
        if scheduler_output is not None:
            stats.num_swapped_out = len(scheduler_output.swapped_out_seq_ids)
            stats.num_blocks_swapped_out = len(scheduler_output.blocks_to_swap_out)
            stats.num_blocks_swapped_in = len(scheduler_output.blocks_to_swap_in)
            stats.num_preemptions = len(scheduler_output.preempted_seq_ids)
            stats.num_scheduled_seqs = len(scheduler_output.scheduled_seqs)
            stats.num_prefill_tokens = scheduler_output.num_prefill_tokens
            stats.num_decode_tokens = scheduler_output.num_decode_tokens
            stats.num_cached_tokens = sum(scheduler_output.num_cached_tokens.values())
        return stats


def advance_computed_tokens(out: SchedulerOutput) -> None:
    """Each scheduled sequence's `num_computed_tokens` becomes where its new tokens start plus how many: the
    one writer of a step's progress (the scheduler's, and beam search's, which schedules its beams itself)."""
    for seq, start, num_new in zip(out.scheduled_seqs, out.num_computed_tokens, out.num_scheduled_tokens, strict=True):
        seq.num_computed_tokens = start + num_new


def num_scheduled_spec_tokens(
    seq: Sequence, token_budget: int, long_prefill_token_threshold: int, max_model_len: int
) -> int:
    """How many of decoding `seq`'s drafts (`seq.spec_token_ids`) this step verifies beside its newest token; the
    scheduler drops the rest, last first (vLLM: the cap on `num_new_tokens` in `Scheduler.schedule`).

    The newest token is scheduled whatever the drafts, so the drafts share what is left of the step's `token_budget`
    and of the per-sequence cap after it. Verification then appends the accepted drafts and one token of the
    target's, so a sequence of `num_tokens` tokens may reach `num_tokens + n + 1` after a step with n drafts: that
    must not pass `max_model_len` (vLLM caps the step's last position at `max_model_len - 2`).
    """
    room = min(token_budget, long_prefill_token_threshold) - 1  # the newest token comes first
    room = min(room, max_model_len - seq.num_tokens - 1)  # every draft accepted, then one token more
    return min(len(seq.spec_token_ids), room)


def hand_back_rejected_drafts(kv_cache_manager: KVCacheManager, seq: Sequence, start: int, num_sampled: int) -> None:
    """After verifying `seq`'s drafts: count as computed only the positions whose K/V are the sequence's, and register
    in the prefix cache the blocks they filled (vLLM: `num_computed_tokens -= num_rejected` in
    `Scheduler.update_from_output`; it registers the blocks at the next `allocate_slots`).

    Scheduling wrote K/V at positions `start` (the newest token) to `start + k` and advanced `num_computed_tokens`
    past them all. Of the `num_sampled` tokens verification appended, the K/V that are the sequence's reach position
    `start + num_sampled - 1` (no further than its tokens after a stop); the last sampled token has none yet. The
    blocks only rejected drafts used stay with the sequence, as in vLLM: the next drafts write there, and freeing one
    now would evict a cached block for the next step.
    """
    seq.num_computed_tokens = min(start + num_sampled, seq.num_tokens)
    kv_cache_manager.cache_blocks(seq, start, seq.num_computed_tokens)


def _is_decode(seq: Sequence, num_new_tokens: int) -> bool:
    """The sequence's newest, sampled token (not the last token of a prompt or recompute) and its drafts."""
    return (
        num_new_tokens == 1 + len(seq.spec_token_ids) and seq.num_computed_tokens + 1 == seq.num_tokens
        and seq.num_output_tokens > 0
    )


def select_victim(scheduler: SchedulerBase) -> Sequence:
    """The running sequence that gives its memory up when a running sequence needs a block and none is free: the
    last to start running (FCFS), or the lowest priority (the largest value), latest arrival (PRIORITY). Both ways
    of preempting (recompute here, swap in chapter 11) ask this one rule."""
    if scheduler.policy is SchedulingPolicy.PRIORITY:
        return max(scheduler.running, key=lambda s: (s.priority, s.arrival, s.seq_id))
    return scheduler.running[-1]


def allocate_or_preempt(
    scheduler: SchedulerBase, seq: Sequence, num_new_tokens: int, out: SchedulerOutput,
    copies: dict[int, list[tuple[int, int]]],
) -> tuple[list[tuple[int, int]] | None, int]:
    """Room for running `seq`'s next `num_new_tokens` tokens, preempting victims until there is.

    Returns (`seq`'s copy-on-write copies, or None if `seq` itself had to be preempted; the token budget handed
    back by victims that were already in this step's batch). A victim may sit before `seq` in `running`.
    """
    returned = 0
    while (seq_copies := scheduler.kv_cache_manager.allocate_slots(seq, num_new_tokens)) is None:
        victim = select_victim(scheduler)
        if victim in out.scheduled_seqs:  # already given tokens this step: take them back
            returned += scheduler._remove_from_batch(out, victim, copies)
        scheduler._preempt_request(victim, out)
        if victim is seq:
            return None, returned
    return seq_copies, returned


class Scheduler(SchedulerBase):
    """`schedule()` decides one step: running sequences first, then admissions, under one token budget."""

    def schedule(self) -> SchedulerOutput:
        """The step's batch: each sequence gets min(tokens behind, budget left, long_prefill_token_threshold)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        copies: dict[int, list[tuple[int, int]]] = {}  # seq_id -> its copy-on-write copies this step

        # Running sequences first, in the order they started running.
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.spec_token_ids:  # speculative decoding (chapter 10): keep the drafts this step admits
                num_spec = num_scheduled_spec_tokens(seq, budget, self.long_prefill_token_threshold, self.max_model_len)
                del seq.spec_token_ids[num_spec:]
            num_behind = seq.num_tokens - seq.num_computed_tokens
            num_new_tokens = min(num_behind + len(seq.spec_token_ids), budget, self.long_prefill_token_threshold)
            assert num_new_tokens > 0, f"running sequence {seq.seq_id} has nothing to compute"
            seq_copies, returned = self._allocate_or_preempt(seq, num_new_tokens, out, copies)
            budget += returned
            if seq_copies is None:
                continue  # `seq` itself was the victim; whatever followed it has moved into its place
            self._add_to_batch(out, seq, num_new_tokens, seq_copies, copies)
            budget -= num_new_tokens
            index = self.running.index(seq) + 1  # victims before `seq` shifted it left

        # Then swapped-out groups (chapter 11), then waiting sequences, while there is budget, room in the batch and
        # memory. None in a step that preempted: the memory just freed is for the running sequences.
        budget = self._schedule_swapped(out, budget, copies)
        while not out.preempted_seq_ids and self.waiting and budget > 0 and self.can_admit(self.waiting.peek()):
            seq = self.waiting.peek()
            computed_blocks, num_cached_tokens = self.kv_cache_manager.get_computed_blocks(seq)
            num_external = self._get_num_offloaded_tokens(seq, num_cached_tokens)  # the host tier's hits (chapter 11)
            num_new_tokens = min(seq.num_tokens - num_cached_tokens - num_external, budget,
                                 self.long_prefill_token_threshold)
            seq_copies = self.kv_cache_manager.allocate_slots(seq, num_external + num_new_tokens, computed_blocks)
            if seq_copies is None:
                break  # it waits for memory; nobody behind it jumps the line
            self._load_offloaded(seq, num_cached_tokens, num_external)
            num_cached_tokens += num_external
            self.waiting.pop()
            (out.resumed_seq_ids if seq.status is SequenceStatus.PREEMPTED else out.new_seq_ids).append(seq.seq_id)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached_tokens
            out.num_cached_tokens[seq.seq_id] = num_cached_tokens
            self.running.append(seq)
            self._add_to_batch(out, seq, num_new_tokens, seq_copies, copies)
            budget -= num_new_tokens

        out.blocks_to_copy = [copy for seq in out.scheduled_seqs for copy in copies.get(seq.seq_id, [])]
        self._update_after_schedule(out)
        return out

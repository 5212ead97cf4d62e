"""The scheduler: which sequences compute how many tokens this step, under one token budget.

There is no prefill phase and decode phase. Every sequence has `num_tokens` tokens, of which
`num_computed_tokens` already have K/V in the cache; a step lets some of them catch up. A decoding sequence is
one token behind, a new one is its whole prompt behind, a preempted one everything behind. So one rule serves
all: give each sequence `min(tokens behind, budget left, long_prefill_token_threshold)` tokens, running
sequences first (in the order they started), then waiting ones in the queue's order. A long prompt is thus
prefilled in chunks over several steps while the running sequences keep decoding beside it (chunked prefill).

When the KV cache manager has no block for a running sequence, the scheduler preempts by recompute
(`allocate_or_preempt`): it picks a victim — the last sequence to start running (FCFS), or the lowest priority,
latest arrival (PRIORITY) — takes it back out of the step's batch if it was already in (returning its tokens to
the budget), frees its blocks, resets it to 0 computed tokens and puts it back at the front of the waiting
queue; its tokens are kept, so it resumes exactly where it was (prefix caching usually finds most of its blocks
still there). It repeats until the allocation succeeds or the victim is the sequence itself. No waiting
sequence is admitted in a step that preempted.

With a host pool (chapter 11, `preemption_mode="swap"`), `allocate_or_swap_out` takes the same victims but
`preempt_group` swaps each victim out with its whole sequence group (every running sample of its request), shared
blocks copied once (`solutions/kv_offload/swap.py`), when the host pool has room and the group could come back;
otherwise the victim alone is recomputed. Swapped groups come back (`_swap_in`) oldest first, before anyone new is
admitted, and never in a step that preempted. With the prefix cache's host tier (`kv_offloading_size`), an admitted
sequence's lookup continues on the host after the device's hits, and the blocks found there are loaded instead of
computed. The block copies both need travel in the `SchedulerOutput`, made by the runner before the forward pass.

The scheduler is the one writer of a sequence's progress. When the batch is decided, `_update_after_schedule`
advances every scheduled sequence's `num_computed_tokens` past its scheduled tokens (the step's
`SchedulerOutput` keeps where they start), and forks the samples of an `n > 1` request whose prompt this step
completes: they share its blocks and sample from its logits row. So the batch and the running set never change
after `schedule()` returns, and `max_num_seqs` counts those samples from the moment their request is admitted.

After the forward pass, `update_from_output` takes the runner's sampled tokens back: it appends each to its
sequence, advances its grammar, checks the stop conditions, frees what finished, and answers the front end with
one `EngineCoreOutput` per sample and the step's `SchedulerStats`.

Speculative decoding (`SpeculativeConfig`): a decoding sequence with draft tokens (`seq.spec_token_ids`, proposed
by the runner after the previous step's sampling and handed over by `update_draft_token_ids`) schedules its
newest token and its k drafts, 1 + k tokens of the budget, with slots for all of them; a budget too small for
them all drops the last drafts. The runner verifies
them in the same forward pass and returns the accepted ones plus one more. `update_from_output` then hands the
rejected ones back: `num_computed_tokens` — advanced past all k at scheduling — moves back by the number rejected
(their slots are overwritten by the next step), blocks that held only rejected drafts are freed, and the blocks
the accepted ones filled are registered in the prefix cache (only the sequence's own, verified tokens are ever
hashed). A stop inside an accepted run ends it there. Preemption drops the drafts.

The module is split so that each idea can be read (and, in chapter 5, written) on its own: `SchedulerBase`
holds the queues and the bookkeeping (`_preempt_request` and `update_from_output` among it),
`allocate_or_preempt` is the decision to preempt, and `Scheduler` adds the one method that decides a step,
`schedule`.

Where this lives in vLLM: `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`, whose loop around
`allocate_slots` is our `allocate_or_preempt`, `_preempt_request`, `update_from_output`, `get_grammar_bitmask`;
`spec_token_ids` and the rollback of `num_computed_tokens` for rejected drafts in `update_from_output`).
"""

import importlib
import time
from typing import TYPE_CHECKING, Self

import torch

from solutions.config import VllmConfig
from solutions.core.block_pool import BlockPool
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sched.output import (
    DraftTokenIds,
    EngineCoreOutput,
    EngineCoreOutputs,
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from solutions.core.sched.request_queue import SchedulingPolicy, create_request_queue
from solutions.core.sched.stop import check_stop
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.kv_offload.manager import get_num_new_matched_tokens, update_state_after_alloc
from solutions.kv_offload.swap import num_group_blocks, swap_in, swap_out
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
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        long_prefill_token_threshold: int,
        policy: SchedulingPolicy = SchedulingPolicy.FCFS,
        max_model_len: int | None = None,
        eos_token_id: int | None = None,
        structured_output_manager: "StructuredOutputManager | None" = None,
        swap_pool: BlockPool | None = None,
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
        # chapter 11: with a host pool, preemption swaps a victim's whole group out (`preempt_group`) when it fits
        self.swap_pool = swap_pool
        self.swapped: list[list[Sequence]] = []  # swapped-out groups, in the order they went out
        self._reported_queries = self._reported_hits = 0  # prefix-cache lookups already in a SchedulerStats
        self._reported_external = (0, 0)  # the host tier's (queries, hits) already in a SchedulerStats

    @classmethod
    def from_config(cls, vllm_config: VllmConfig, structured_output_manager: "StructuredOutputManager") -> Self:
        """The scheduler of an engine, with the KV cache manager its config names."""
        cache, sched = vllm_config.cache_config, vllm_config.scheduler_config
        module_name, _, class_name = cache.kv_cache_manager_cls.rpartition(".")
        manager_cls = getattr(importlib.import_module(module_name), class_name)
        manager = manager_cls(
            cache.num_kv_blocks, cache.block_size, cache.enable_prefix_caching, **cache.kv_cache_manager_kwargs
        )
        if cache.num_offload_blocks:
            manager.enable_offloading(cache.num_offload_blocks)
        return cls(
            manager, max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
            long_prefill_token_threshold=sched.long_prefill_token_threshold, policy=sched.policy,
            max_model_len=sched.max_model_len, eos_token_id=vllm_config.model_config.eos_token_id,
            structured_output_manager=structured_output_manager,
            swap_pool=BlockPool(cache.num_swap_blocks) if cache.preemption_mode == "swap" else None,
        )

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

    def add_running(self, seq: Sequence) -> None:
        """Start `seq` running as it is (its blocks and computed tokens already set up): a forked sample, or a
        test's or a chapter's hand-made running sequence."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def can_admit(self, seq: Sequence) -> bool:
        """Is there room in the running set for waiting `seq` and the samples it will fork? Never while a group is
        swapped out: it comes back before anyone new is admitted (the paper's §4.5)."""
        if self.swapped:
            return False
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
        if seq.status is SequenceStatus.SWAPPED:  # its blocks are host blocks
            group = next(group for group in self.swapped if seq in group)
            group.remove(seq)
            if not group:
                self.swapped.remove(group)
            self.swap_pool.free_blocks(self.swap_pool.blocks[block_id] for block_id in reversed(seq.block_table))
            seq.block_table.clear()
        else:
            self.kv_cache_manager.free(seq)
        seq.status = status

    # --- helpers for schedule() ----------------------------------------------------------------------------------

    def _allocate_or_preempt(
        self, seq: Sequence, num_new_tokens: int, out: SchedulerOutput, copies: dict[int, list[tuple[int, int]]]
    ) -> tuple[list[tuple[int, int]] | None, int]:
        """`allocate_or_preempt(self, ...)`, looked up in this module when called: `schedule()` reaches the
        preemption decision through this method, so any `schedule()` runs whichever one the module holds."""
        if self.swap_pool is not None:
            return allocate_or_swap_out(self, seq, num_new_tokens, out, copies)
        return allocate_or_preempt(self, seq, num_new_tokens, out, copies)

    def _victim(self) -> Sequence:
        """Whom to preempt: the lowest priority (largest value), latest arrival (PRIORITY), else the last to start."""
        if self.policy is SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda s: (s.priority, s.arrival, s.seq_id))
        return self.running[-1]

    def group_of(self, seq: Sequence) -> list[Sequence]:
        """`seq`'s sequence group: the running samples of its request, in running order (just `seq` for a sequence
        made by hand, without a request)."""
        if seq.request_id is None:
            return [seq]
        return [s for s in self.running if s.request_id == seq.request_id]

    def _add_to_batch(
        self, out: SchedulerOutput, seq: Sequence, num_new_tokens: int, seq_copies: list[tuple[int, int]],
        copies: dict[int, list[tuple[int, int]]],
    ) -> None:
        """Put `seq` into the step's batch with `num_new_tokens` tokens, and count them as prefill or decode."""
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

    def _swap_out(self, group: list[Sequence], out: SchedulerOutput, read_from: dict[int, int]) -> None:
        """Preemption by swapping, the bookkeeping: the group's blocks go to the host pool (`swap_out`), each sequence
        leaves the running set for `swapped`. `read_from` maps a block this step's copy-on-write gave a sequence of
        the group (its copy was dropped with the sequence's place in the batch) to the shared block it copies, whose
        contents the swap-out reads instead. The group must be out of the batch, with no uncomputed blocks."""
        for seq in group:
            self.running.remove(seq)
            seq.spec_token_ids = []
            seq.status = SequenceStatus.SWAPPED
            out.preempted_seq_ids.append(seq.seq_id)
            out.swapped_out_seq_ids.append(seq.seq_id)
        pairs = swap_out(self.kv_cache_manager.block_pool, self.swap_pool, group)
        out.blocks_to_swap_out += [(read_from.get(device_id, device_id), host_id) for device_id, host_id in pairs]
        self.swapped.append(group)
        self.num_preemptions += len(group)

    def _swap_in(self, out: SchedulerOutput, budget: int, copies: dict[int, list[tuple[int, int]]]) -> int:
        """Swapped-out groups come back, oldest first, before any waiting sequence is admitted, while the device has
        a block for each of a group's blocks and for each sequence's next one, the batch has seats and the step has
        budget; never in a step that preempted (a block swapped out this step is not yet copied). Each sequence is
        scheduled this step if its next tokens fit. Returns the budget left."""
        manager = self.kv_cache_manager
        while not out.preempted_seq_ids and self.swapped and budget > 0:
            group = self.swapped[0]
            seats = sum(1 + len(s.fork_seq_ids) for s in group)
            if (
                num_group_blocks(group) + len(group) > manager.num_free_blocks
                or self._num_seats() + seats > self.max_num_seqs
            ):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in += swap_in(self.swap_pool, manager.block_pool, group)
            for seq in group:
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.swapped_in_seq_ids.append(seq.seq_id)
                manager.cache_blocks(seq, 0, seq.num_computed_tokens)  # its full blocks are prefix hits again
                num_behind = seq.num_tokens - seq.num_computed_tokens
                num_new_tokens = min(num_behind, budget, self.long_prefill_token_threshold)
                seq_copies = manager.allocate_slots(seq, num_new_tokens) if num_new_tokens > 0 else None
                if seq_copies is not None:  # else it runs from the next step
                    self._add_to_batch(out, seq, num_new_tokens, seq_copies, copies)
                    budget -= num_new_tokens
        return budget

    def _get_num_offloaded_tokens(self, seq: Sequence, num_cached_tokens: int) -> int:
        """Tokens past the device's prefix hits that the host tier holds (0 without one, or for a sequence that must
        compute its whole prompt)."""
        offloading = self.kv_cache_manager.offloading
        if offloading is None or seq.skip_reading_prefix_cache:
            return 0
        return get_num_new_matched_tokens(
            offloading, seq.block_hashes, seq.num_tokens, num_cached_tokens, self.kv_cache_manager.block_size
        )

    def _load_offloaded(self, seq: Sequence, num_cached_tokens: int, num_external: int) -> None:
        """Load the host tier's hits into the device blocks just allocated for them."""
        if num_external:
            update_state_after_alloc(
                self.kv_cache_manager.offloading, seq.block_hashes, seq.block_table, num_cached_tokens, num_external,
                self.kv_cache_manager.block_size,
            )

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
                    raise RuntimeError(
                        f"sequence {seq.seq_id} sampled token {token_id}, which its grammar's mask forbids"
                    )
                if (stopped := check_stop(seq, self.eos_token_id, self.max_model_len)) is not None:
                    break
            finish_reason, stop_reason = None, None
            if stopped is not None:
                # the dropped tail's K/V (and any rejected drafts') are not the sequence's: as after a one-token step
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
                status, stop_reason = stopped
                self.finish(seq, status)
                finish_reason = FINISH_REASONS[status]
                samples = self.requests[seq.request_id]
                if len(samples) == seq.sampling_params.n and all(s.is_finished for s in samples):
                    del self.requests[seq.request_id]  # every sample is done
            else:
                if drafts:  # the rejected drafts' positions were scheduled, not kept: computed again next step
                    hand_back_rejected_drafts(self.kv_cache_manager, seq, starts[seq_id], len(drafts), len(sampled))
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
                seq.spec_token_ids = self._fit_drafts(seq, drafts)

    def _fit_drafts(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """The proposed drafts that can still be used: no more than the sequence may still generate, less the one
        token every step adds, and no position past `max_model_len`."""
        room = seq.sampling_params.max_tokens - seq.num_output_tokens - 1
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - seq.num_tokens - 1)
        return drafts[: max(room, 0)]

    def make_stats(
        self, scheduler_output: SchedulerOutput | None = None, seconds: dict | None = None
    ) -> SchedulerStats:
        """The scheduler's state now, what the step did (if one ran), and the prefix-cache lookups since the last
        report."""
        cache_stats, manager = self.kv_cache_manager.prefix_cache_stats, self.kv_cache_manager
        queries, hits = cache_stats.queries - self._reported_queries, cache_stats.hits - self._reported_hits
        self._reported_queries, self._reported_hits = cache_stats.queries, cache_stats.hits
        stats = SchedulerStats(
            len(self.running), len(self.waiting), manager.num_used_blocks, manager.num_used_blocks / manager.num_blocks,
            queries, hits, seconds=seconds or {},
        )
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


def hand_back_rejected_drafts(
    kv_cache_manager: KVCacheManager, seq: Sequence, start: int, num_drafts: int, num_sampled: int
) -> None:
    """After verifying `seq`'s drafts: give back what the rejected ones took (vLLM: `num_computed_tokens -=
    num_rejected` in `Scheduler.update_from_output`).

    The step was scheduled from position `start` with the newest token and `num_drafts` drafts, so scheduling
    advanced `num_computed_tokens` to `start + 1 + num_drafts`; verification kept `num_sampled` tokens (the
    accepted drafts and one more), already appended, none of them a stop. Only the accepted drafts' K/V are the
    sequence's: roll `num_computed_tokens` back by the rejected ones, to `start + num_sampled` (the last sampled
    token has no K/V yet), free the blocks past the sequence's tokens (they held only rejected drafts), and
    register in the prefix cache the blocks the verified tokens filled — never one holding a rejected draft.
    """
    seq.num_computed_tokens -= num_drafts + 1 - num_sampled
    kv_cache_manager.free_unverified_blocks(seq)
    kv_cache_manager.cache_blocks(seq, start, seq.num_computed_tokens)


def _is_decode(seq: Sequence, num_new_tokens: int) -> bool:
    """The sequence's newest, sampled token (not the last token of a prompt or recompute) and its drafts."""
    return (
        num_new_tokens == 1 + len(seq.spec_token_ids) and seq.num_computed_tokens + 1 == seq.num_tokens
        and seq.num_output_tokens > 0
    )


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
        if scheduler.policy is SchedulingPolicy.PRIORITY:  # the lowest priority (largest value), latest arrival
            victim = max(scheduler.running, key=lambda s: (s.priority, s.arrival, s.seq_id))
        else:  # the last to start running
            victim = scheduler.running[-1]
        if victim in out.scheduled_seqs:  # already given tokens this step: take them back
            returned += scheduler._remove_from_batch(out, victim, copies)
        scheduler._preempt_request(victim, out)
        if victim is seq:
            return None, returned
    return seq_copies, returned


def allocate_or_swap_out(
    scheduler: SchedulerBase, seq: Sequence, num_new_tokens: int, out: SchedulerOutput,
    copies: dict[int, list[tuple[int, int]]],
) -> tuple[list[tuple[int, int]] | None, int]:
    """`allocate_or_preempt` with a host pool (chapter 11): each victim goes with its whole group (`preempt_group`),
    so `seq` may leave with a victim's group as well as by being the victim."""
    returned = 0
    while (seq_copies := scheduler.kv_cache_manager.allocate_slots(seq, num_new_tokens)) is None:
        returned += preempt_group(scheduler, scheduler._victim(), out, copies)
        if seq.status is not SequenceStatus.RUNNING:
            return None, returned
    return seq_copies, returned


def preempt_group(
    scheduler: SchedulerBase, victim: Sequence, out: SchedulerOutput, copies: dict[int, list[tuple[int, int]]]
) -> int:
    """Preempt `victim`: swap it out with the rest of its sequence group if the host pool has a block for each of the
    group's blocks and the group could come back (its blocks and one more per sequence fit the device pool), else
    recompute the victim alone, as without a host pool (the paper's §4.5). Returns the token budget handed back by
    those that were already in this step's batch.

    A sequence already in the batch leaves it first, with the blocks allocated for this step's tokens; a copy-on-write
    this step gave it is dropped with its place, so its swap-out reads the block it would have copied.
    """
    group = scheduler.group_of(victim)
    num_blocks = num_group_blocks(group)
    device_blocks = scheduler.kv_cache_manager.num_blocks
    if num_blocks > scheduler.swap_pool.num_free_blocks or num_blocks + len(group) > device_blocks:
        returned = scheduler._remove_from_batch(out, victim, copies) if victim in out.scheduled_seqs else 0
        scheduler._preempt_request(victim, out)
        return returned
    returned, read_from = 0, {}
    for seq in group:
        if seq in out.scheduled_seqs:
            read_from.update((dst, src) for src, dst in copies.get(seq.seq_id, []))
            returned += scheduler._remove_from_batch(out, seq, copies)
        scheduler.kv_cache_manager.free_uncomputed_blocks(seq)
    scheduler._swap_out(group, out, read_from)
    return returned


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
            num_behind = seq.num_tokens - seq.num_computed_tokens
            num_new_tokens = min(num_behind + len(seq.spec_token_ids), budget, self.long_prefill_token_threshold)
            assert num_new_tokens > 0, f"running sequence {seq.seq_id} has nothing to compute"
            del seq.spec_token_ids[max(num_new_tokens - num_behind, 0) :]  # the drafts the budget leaves room for
            seq_copies, returned = self._allocate_or_preempt(seq, num_new_tokens, out, copies)
            budget += returned
            if seq_copies is None:
                continue  # `seq` itself was the victim; whatever followed it has moved into its place
            self._add_to_batch(out, seq, num_new_tokens, seq_copies, copies)
            budget -= num_new_tokens
            index = self.running.index(seq) + 1  # victims before `seq` shifted it left

        # Then swapped-out groups (chapter 11), then waiting sequences, while there is budget, room in the batch and
        # memory. None in a step that preempted: the memory just freed is for the running sequences.
        budget = self._swap_in(out, budget, copies)
        while not out.preempted_seq_ids and self.waiting and budget > 0 and self.can_admit(self.waiting.peek()):
            seq = self.waiting.peek()
            computed_blocks, num_cached_tokens = self.kv_cache_manager.get_computed_blocks(seq)
            num_external = self._get_num_offloaded_tokens(seq, num_cached_tokens)  # the host tier's hits (chapter 11)
            num_new_tokens = min(
                seq.num_tokens - num_cached_tokens - num_external, budget, self.long_prefill_token_threshold
            )
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

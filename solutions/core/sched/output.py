"""`SchedulerOutput`: what one engine step does, decided by the scheduler and consumed by the model runner.

Where this lives in vLLM: `vllm/v1/core/sched/output.py` (`SchedulerOutput`, `NewRequestData`,
`CachedRequestData`). vLLM sends ids and deltas to a worker process; ours shares memory with the engine, so it
carries the sequences themselves.
"""

from dataclasses import dataclass, field

from solutions.core.sequence import Sequence


@dataclass(slots=True)
class SchedulerOutput:
    """The step's batch, in batch order, and the bookkeeping around it.

    Sequence `scheduled_seqs[i]` computes `num_scheduled_tokens[i]` tokens this step, starting at position
    `num_computed_tokens[i]`: its whole prompt, a chunk of it, or one decode token. The scheduler has already
    advanced the sequence itself past these tokens when `schedule()` returns (vLLM's `_update_after_schedule`),
    so where the step's tokens start is read here, never from the sequence. Left out, `num_computed_tokens` is
    taken from the sequences as they are when the output is made (a loop without a scheduler, as chapter 3's).
    The model runner applies `blocks_to_copy` (copy-on-write, source → destination block) to every layer before
    the forward pass. A sequence whose tokens are all computed after this step samples from its logits row, and
    so do the samples forked from it this step (`forked_seqs`, an `n > 1` request whose prompt just completed).
    """

    scheduled_seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] | None = None  # a list once made: left out, read from the sequences
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    new_seq_ids: list[int] = field(default_factory=list)  # admitted from the waiting queue for the first time
    resumed_seq_ids: list[int] = field(default_factory=list)  # admitted again after a preemption
    preempted_seq_ids: list[int] = field(default_factory=list)  # sent back to the waiting queue this step
    num_cached_tokens: dict[int, int] = field(default_factory=dict)  # admitted seq_id -> tokens found in the prefix cache
    num_prefill_tokens: int = 0  # scheduled tokens of sequences catching up with a prompt (or a recompute)
    num_decode_tokens: int = 0  # scheduled tokens that are one sequence's single newest token
    forked_seqs: dict[int, list[Sequence]] = field(default_factory=dict)  # seq_id -> samples forked from it this step

    def __post_init__(self) -> None:
        if self.num_computed_tokens is None:
            self.num_computed_tokens = [seq.num_computed_tokens for seq in self.scheduled_seqs]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

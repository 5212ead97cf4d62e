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

    Sequence `scheduled_seqs[i]` computes `num_scheduled_tokens[i]` tokens this step, starting at its
    `num_computed_tokens`: its whole prompt, a chunk of it, or one decode token. The model runner applies
    `blocks_to_copy` (copy-on-write, source → destination block) to every layer before the forward pass.
    """

    scheduled_seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    new_seq_ids: list[int] = field(default_factory=list)  # admitted from the waiting queue for the first time
    resumed_seq_ids: list[int] = field(default_factory=list)  # admitted again after a preemption
    preempted_seq_ids: list[int] = field(default_factory=list)  # sent back to the waiting queue this step
    num_cached_tokens: dict[int, int] = field(default_factory=dict)  # admitted seq_id -> tokens found in the prefix cache
    num_prefill_tokens: int = 0  # scheduled tokens of sequences catching up with a prompt (or a recompute)
    num_decode_tokens: int = 0  # scheduled tokens that are one sequence's single newest token

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

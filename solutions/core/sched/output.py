"""What one engine step sends down and what comes back up.

    SchedulerOutput    the scheduler's decision: which sequences compute which tokens (to the model runner)
    GrammarOutput      the token masks of the step's constrained samples, filled while the forward pass runs
    ModelRunnerOutput  the runner's answer: per sampling sequence its new tokens (one, or with speculative decoding
                       its accepted drafts then one) and their logprobs, and its next drafts

The scheduler's answer to the front end, `EngineCoreOutputs`, is a message of the engine's, beside the requests
(`solutions/engine/__init__.py`).

Where this lives in vLLM: `vllm/v1/core/sched/output.py` (`SchedulerOutput`, `GrammarOutput`) and
`vllm/v1/outputs.py` (`ModelRunnerOutput`). In one process it carries the sequences themselves; to a worker process it
travels as vLLM's does, new requests whole once and then only their changes (`solutions/worker/cached_requests.py`).
"""

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from solutions.core.sequence import Sequence
from solutions.outputs import PromptLogprobsChunk


PER_POOL = {"per_pool": True}  # a field of block ids: they mean something in their own KV pool only


@dataclass(slots=True)
class SchedulerOutput:
    """The step's batch, in batch order, and the bookkeeping around it.

    Sequence `scheduled_seqs[i]` computes `num_scheduled_tokens[i]` tokens this step from position
    `num_computed_tokens[i]` (a prompt, a chunk of it, or one decode token), followed, with speculative decoding, by
    its drafts `scheduled_spec_decode_tokens[seq_id]`. The scheduler has already advanced the sequence itself when
    `schedule()` returns, so where the step's tokens start is read here, never from the sequence (left out, it is
    taken from the sequences as they are, for a loop without a scheduler, as chapter 3's). The runner applies
    `blocks_to_copy` (copy-on-write) before the forward pass. A sequence whose tokens are all computed after this step
    samples from its logits row, as do the samples forked from it this step (`forked_seqs`).
    """

    scheduled_seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] | None = None  # a list once made: left out, read from the sequences
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list, metadata=PER_POOL)
    new_seq_ids: list[int] = field(default_factory=list)  # admitted from the waiting queue for the first time
    resumed_seq_ids: list[int] = field(default_factory=list)  # admitted again after a preemption
    preempted_seq_ids: list[int] = field(default_factory=list)  # sent back to the waiting queue this step
    # admitted seq_id -> tokens found in the prefix cache
    num_cached_tokens: dict[int, int] = field(default_factory=dict)
    num_prefill_tokens: int = 0  # scheduled tokens of sequences catching up with a prompt (or a recompute)
    num_decode_tokens: int = 0  # scheduled tokens that are a sequence's newest token (and its drafts)
    forked_seqs: dict[int, list[Sequence]] = field(default_factory=dict)  # seq_id -> samples forked from it this step
    scheduled_spec_decode_tokens: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> drafts to verify
    # chapter 11, block copies between the device pool and host memory, (source, destination), made before the forward
    # pass in this order: stores (evicted device block -> host tier), swap-outs (device block -> swap pool), swap-ins
    # (swap pool -> device block), loads (host tier -> device block: a prefix hit), then `blocks_to_copy`
    blocks_to_store: list[tuple[int, int]] = field(default_factory=list, metadata=PER_POOL)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list, metadata=PER_POOL)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list, metadata=PER_POOL)
    blocks_to_load: list[tuple[int, int]] = field(default_factory=list, metadata=PER_POOL)
    swapped_out_seq_ids: list[int] = field(default_factory=list)  # preempted by swapping (also in preempted_seq_ids)
    swapped_in_seq_ids: list[int] = field(default_factory=list)  # back from the swap pool, running again

    def __post_init__(self) -> None:
        if self.num_computed_tokens is None:
            self.num_computed_tokens = [seq.num_computed_tokens for seq in self.scheduled_seqs]


def sampling_rows(scheduler_output: SchedulerOutput) -> tuple[list[int], list[Sequence]]:
    """Which logits rows sample, and for whom: (row per sampling sequence, those sequences).

    The model returns one row of logits per scheduled sequence, at its last scheduled token. Only a sequence whose
    tokens are all computed once this step has run samples from it (the scheduler has already advanced
    `num_computed_tokens`): a prompt chunk that is not the last predicts nothing anyone asked for, and must not
    draw from its generator. So the rows are not simply the first ones: each sequence keeps its own row. The
    samples the scheduler forked from a sequence this step (`n > 1`) sample from its row too.
    """
    rows: list[int] = []
    seqs: list[Sequence] = []
    for row, seq in enumerate(scheduler_output.scheduled_seqs):
        if seq.num_computed_tokens < seq.num_tokens:
            continue  # a prompt chunk that is not the last: nothing to sample yet
        for sample_seq in [*scheduler_output.forked_seqs.get(seq.seq_id, []), seq]:  # n > 1: they share the row
            rows.append(row)
            seqs.append(sample_seq)
    return rows, seqs


@dataclass(slots=True)
class GrammarOutput:
    """The (N, W) token bitmask of the step's N sampling rows (`sampling_rows`' order; all ones for a sample
    without a grammar), being filled on the structured output manager's thread while the forward pass runs."""

    future: "Future[torch.Tensor]"

    @classmethod
    def of(cls, bitmask: torch.Tensor | None) -> "GrammarOutput | None":
        """A grammar output already filled with `bitmask` (None for none): what a worker gets its masks as."""
        if bitmask is None:
            return None
        future: Future[torch.Tensor] = Future()
        future.set_result(bitmask)
        return cls(future)

    def bitmask(self) -> torch.Tensor:
        return self.future.result()


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per sampling sequence, in `sampling_rows`' order: its new tokens — one sampled token, or with drafts the
    accepted ones then one more (recovered or bonus) — their logprobs, and where the runner's time went."""

    seq_ids: list[int]
    sampled_token_ids: list[list[int]]
    # per sequence, None unless it asked for logprobs: per new token (the top `logprobs` (token, logprob), the
    # token's own (logprob, rank among all tokens))
    logprobs: list[list[tuple[list[tuple[int, float]], tuple[float, int]]] | None]
    seconds: dict[str, float] = field(default_factory=dict)  # "prepare", "forward", "sample"
    # seq_id -> (first prompt position j, per prompt token j, j + 1, ...: its (top, (logprob, rank))), for this
    # step's chunk of each prompt whose logprobs are wanted
    prompt_logprobs: dict[int, PromptLogprobsChunk] = field(default_factory=dict)


@dataclass(slots=True)
class DraftTokenIds:
    """Speculative decoding: the drafts the proposer made after a step's sampling, per sampling sequence, for its
    next step (vLLM: `DraftTokenIds` in `vllm/v1/outputs.py`, taken by `EngineCore.post_step`)."""

    seq_ids: list[int]
    draft_token_ids: list[list[int]]

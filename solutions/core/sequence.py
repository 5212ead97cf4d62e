"""One token stream and its place in the KV cache: the unit the scheduler schedules.

A `Sequence` is the prompt followed by every token generated so far, its lifecycle status, how many of its
tokens already have K/V in the cache, and the block table saying where those K/V live. A request with
`n > 1` samples (or a beam search) owns several sequences that share their prompt's blocks.

Where this lives in vLLM: `vllm/v1/request.py` (`Request`, `RequestStatus`): our `Sequence` is vLLM's `Request`,
one sample of the caller's request, carrying what the engine core needs to run it — its sampling parameters, its
random generator and its grammar — so no side table is needed to find them. vLLM keeps the block ids in the KV
cache manager (`req_to_blocks`); we keep the block table on the sequence, so a learner can print one object and
see everything about it.
"""

from enum import Enum, auto
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from solutions.sampling_params import SamplingParams


class SequenceStatus(Enum):
    """vLLM's request states. WAITING → RUNNING → FINISHED_*; preemption by recompute sends RUNNING to PREEMPTED,
    which waits (at the front of the queue) to be scheduled again from scratch; preemption by swapping (chapter 11,
    vLLM v0's state) sends it to SWAPPED, its blocks in host memory, until it is swapped in and RUNNING again."""

    WAITING = auto()
    RUNNING = auto()
    PREEMPTED = auto()
    SWAPPED = auto()
    FINISHED_STOPPED = auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH_CAPPED = auto()  # max_tokens reached, or the context reached max_model_len
    FINISHED_ABORTED = auto()  # the caller aborted the request

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED_")


class Sequence:
    """A prompt plus its generated tokens, and the physical blocks holding their keys and values.

    Invariants:
    - `token_ids[:num_prompt_tokens]` is the prompt; every later entry was generated (`append_token`).
    - `block_table[i]` is the physical block holding logical block `i`, i.e. token positions
      `[i * block_size, (i + 1) * block_size)`; the block manager is the only writer.
    - `0 <= num_computed_tokens <= num_tokens`: the first `num_computed_tokens` tokens already have their K/V
      in the cache, or will have once this step's forward pass has run (computed, or found there by prefix
      caching). The scheduler is its one writer: it advances it when it schedules the tokens, and preemption
      by recompute resets it to 0. With speculative decoding it is advanced past the step's draft tokens too
      (so it exceeds `num_tokens` during the step) and moved back by the rejected ones after it.
    - `block_hashes[i]` is the prefix-cache hash of full block `i` (chapter 4); it only ever grows.
    - `spec_token_ids` are draft tokens proposed for the positions after `token_ids` (speculative decoding): not
      part of the sequence until the target model has verified them; cleared when it is preempted.

    `priority` (lower runs first) and `arrival` (the order requests came in; forks inherit their parent's) are
    what the scheduler's policies sort by. `fork_seq_ids` are the ids of the samples an `n > 1` request forks
    from this sequence once its prompt is computed (the scheduler forks them; empty afterwards).

    In the engine, a sequence is sample `sample_index` of request `request_id`: it samples with
    `sampling_params`, draws from its own `generator` (seeded by `seed`, so a seeded sample is reproducible in any
    batch) and, with structured outputs, is constrained by its own `grammar`. A plain class with `__slots__` rather
    than a dataclass: the constructor takes the prompt, not the fields.
    """

    __slots__ = (
        "seq_id", "token_ids", "num_prompt_tokens", "status", "block_table", "num_computed_tokens", "block_hashes",
        "priority", "arrival", "fork_seq_ids", "request_id", "sample_index", "sampling_params", "seed", "generator",
        "grammar", "spec_token_ids", "replica",
    )

    def __init__(
        self, seq_id: int, prompt_token_ids: list[int], *, priority: int = 0, arrival: int | None = None
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"prompt_token_ids of sequence {seq_id} must hold at least one token, got []")
        self.seq_id: int = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)  # a copy: the caller's list must not grow with us
        self.num_prompt_tokens: int = len(prompt_token_ids)
        self.status: SequenceStatus = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens: int = 0
        self.block_hashes: list[bytes] = []
        self.priority: int = priority
        self.arrival: int = seq_id if arrival is None else arrival
        self.fork_seq_ids: list[int] = []
        self.request_id: str | None = None
        self.sample_index: int = 0
        self.sampling_params: SamplingParams | None = None
        self.seed: int = 0
        self.generator: torch.Generator | None = None
        self.grammar: Any = None  # a StructuredOutputGrammar
        self.spec_token_ids: list[int] = []  # draft tokens to verify at the next step
        self.replica: int | None = None  # data parallelism: the replica it runs on for life, None until placed

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def last_token_id(self) -> int:
        """The token fed to the model at the next decode step."""
        return self.token_ids[-1]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Whether the prefix cache must not be read for it (a request that wants its prompt's logprobs)."""
        return self.sampling_params is not None and self.sampling_params.skip_reading_prefix_cache

    def append_token(self, token_id: int) -> None:
        """Record a sampled token. Its K/V are not in the cache yet: the next step computes them, after the
        block manager has made room."""
        self.token_ids.append(token_id)

    def fork(self, seq_id: int) -> "Sequence":
        """A copy with a new id: same tokens, status, progress, priority and arrival, and *no* blocks yet —
        the block manager's `fork` makes the child's table share the parent's blocks."""
        child = Sequence(seq_id, self.prompt_token_ids, priority=self.priority, arrival=self.arrival)
        child.token_ids = list(self.token_ids)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.request_id, child.sampling_params = self.request_id, self.sampling_params
        child.replica = self.replica  # a fork shares its parent's blocks, so it runs on its parent's replica
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.name}, num_tokens={self.num_tokens}, "
            f"num_prompt_tokens={self.num_prompt_tokens}, num_computed_tokens={self.num_computed_tokens}, "
            f"block_table={self.block_table})"
        )

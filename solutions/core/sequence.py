"""One request's token stream and its place in the KV cache.

A `Sequence` is what the scheduler and the block manager pass around: the prompt followed by every token
generated so far, the lifecycle status, and the block table that says where its keys and values live.

Where this lives in vLLM: `vllm/v1/request.py` (`Request`, `RequestStatus`). vLLM keeps the block ids in the
KV cache manager (`req_to_blocks`); we keep them on the sequence so a learner can print one object and see
everything about a request.
"""

from enum import Enum, auto


class SequenceStatus(Enum):
    """Lifecycle of a sequence: WAITING → RUNNING → FINISHED (preemption sends RUNNING back to WAITING)."""

    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """A prompt plus its generated tokens, and the physical blocks holding their keys and values.

    Invariants:
    - `token_ids[:num_prompt_tokens]` is the prompt; every later entry was generated (`append_token`).
    - `block_table[i]` is the physical block holding logical block `i`, i.e. token positions
      `[i * block_size, (i + 1) * block_size)`; the block manager is the only writer.
    - `0 <= num_computed_tokens <= num_tokens`: the first `num_computed_tokens` tokens already have their K/V
      written to the cache; the model runner advances it, and preemption by recompute resets it to 0.

    A plain class with `__slots__` rather than a dataclass: the constructor takes the prompt, not the fields.
    """

    __slots__ = ("seq_id", "token_ids", "num_prompt_tokens", "status", "block_table", "num_computed_tokens")

    def __init__(self, seq_id: int, prompt_token_ids: list[int]) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"prompt_token_ids of sequence {seq_id} must hold at least one token, got []")
        self.seq_id: int = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)  # a copy: the caller's list must not grow with us
        self.num_prompt_tokens: int = len(prompt_token_ids)
        self.status: SequenceStatus = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens: int = 0

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

    def append_token(self, token_id: int) -> None:
        """Record a sampled token. Its K/V are not in the cache yet: the next step writes them, after the
        block manager's `append_slot` has made room."""
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.name}, num_tokens={self.num_tokens}, "
            f"num_prompt_tokens={self.num_prompt_tokens}, num_computed_tokens={self.num_computed_tokens}, "
            f"block_table={self.block_table})"
        )

"""Speculative decoding: proposers that guess the next tokens cheaply, for the target model to verify in one pass.

Every method answers the model runner's one call, `Proposer.propose_draft_token_ids`, once per step after
sampling: the n-gram proposer (`ngram_proposer.py`) reads each sequence's tokens and keeps nothing between steps,
so `PerSequenceProposer` loops it over the batch; the draft-model proposer (`draft_model.py`) keeps a K/V cache
per sequence and runs the batch together.

Where this lives in vLLM: `vllm/v1/spec_decode/` (the rejection sampler that verifies is in `solutions/sample/`).
"""

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    """Drafts the next tokens of a batch of sequences (vLLM's runner: `propose_draft_token_ids`)."""

    def propose_draft_token_ids(self, seq_ids: list[int], token_ids: list[list[int]]) -> list[list[int]]:
        """Each sequence's draft tokens ([] for none), given its tokens so far (prompt, then output). A proposer
        with per-sequence state keeps it for `seq_ids` only: a sequence missing from the batch is forgotten."""
        ...


class OneSequenceProposer(Protocol):
    """Drafts from one sequence's tokens alone (`NgramProposer`)."""

    def propose(self, token_ids: Sequence[int]) -> list[int]: ...


class PerSequenceProposer:
    """A `Proposer` made of a stateless one-sequence proposer: one `propose` call per sequence."""

    def __init__(self, proposer: OneSequenceProposer) -> None:
        self.proposer = proposer

    def propose_draft_token_ids(self, seq_ids: list[int], token_ids: list[list[int]]) -> list[list[int]]:
        return [self.proposer.propose(tokens) for tokens in token_ids]

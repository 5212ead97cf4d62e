"""What the engine needs from a grammar, whichever library (or hand-written matcher) provides it.

One object per sample: it knows how much of the output it has seen, fills its row of the step's token mask,
advances by the tokens the sampler picked, and says when the output is complete.

Where this lives in vLLM: `vllm/v1/structured_output/backend_types.py` (`StructuredOutputGrammar`).
"""

from typing import Protocol

import torch


class StructuredOutputGrammar(Protocol):
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance past `token_ids`; False (and the grammar unusable) if the grammar does not allow them."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32 words, one bit per token)."""
        ...

    def is_terminated(self) -> bool:
        """Is the output complete, with nothing more it could take (an end-of-sequence token included)?"""
        ...

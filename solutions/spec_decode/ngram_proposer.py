"""The n-gram proposer (prompt lookup decoding): guess the next tokens by copying what followed the last few tokens
the last time they occurred in the context.

Take the longest suffix of the context whose length n lies in [prompt_lookup_min, prompt_lookup_max] and which
also occurs earlier (ending before the last token; overlap allowed), and propose up to `num_speculative_tokens`
tokens that followed its first occurrence, as vLLM does. It costs no model call, and pays off where the output
copies its input: code edits, quoting summaries, retrieval answers. The search is O(L * prompt_lookup_max) numpy
work, one vectorised comparison per suffix length; vLLM uses KMP over the reversed context (O(L), numba).

Where this lives in vLLM: `vllm/v1/spec_decode/ngram_proposer.py` (`NgramProposer`,
`_find_longest_matched_ngram_and_propose_tokens`).
"""

from collections.abc import Sequence

import numpy as np



class NgramProposer:
    """Proposes up to `num_speculative_tokens` draft tokens from the context alone (vLLM's `method="ngram"`)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int) -> None:
        """The values as `SpeculativeConfig` checked them: 1 <= prompt_lookup_min <= prompt_lookup_max, k >= 1."""
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = num_speculative_tokens

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """The draft tokens for a sequence whose tokens so far (prompt then output) are `token_ids`; [] if none."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        num_tokens = len(tokens)
        # match_len[e]: how many tokens ending at position e equal the context's last ones (at most max_n), for
        # every e before the last token; computed one suffix length j at a time while some run is still alive.
        match_len = np.zeros(max(num_tokens - 1, 0), dtype=np.int64)
        alive = np.ones_like(match_len, dtype=bool)
        for j in range(min(self.max_n, num_tokens - 1)):
            alive[:j] = False  # an occurrence ending at e < j would start before the context
            alive[j:] &= tokens[: num_tokens - 1 - j] == tokens[num_tokens - 1 - j]
            if not alive.any():
                break
            match_len += alive
        longest = int(match_len.max(initial=0))
        if longest < self.min_n:
            return []
        start = int(np.argmax(match_len == longest)) + 1  # after the first (leftmost) longest occurrence
        return tokens[start : start + self.k].tolist()

"""Plausible wrong answers to chapter 10's exercises; each must fail at least one test of its exercise.

The class exercise is mutated by subclassing the reference and overriding the method that goes wrong.
"""

from collections.abc import Sequence as TokenIds

import torch

from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sequence import Sequence
from solutions.sample import rejection_sampler
from solutions.spec_decode.ngram_proposer import NgramProposer

# The reference functions, taken when this module is loaded: inside a capstone's `swap_in` the module attribute is
# the mutant itself, and a mutant that deferred to it would only recurse.
reference_random_sample = rejection_sampler.rejection_random_sample
inverse_cdf = rejection_sampler.inverse_cdf

# --- NgramProposer --------------------------------------------------------------------------------------------------


def _search(tokens: list[int], lengths: range, starts_from_the_right: bool) -> tuple[int, int] | None:
    """(n, start) of the first earlier occurrence of the context's n-token suffix, trying n in `lengths` order."""
    for n in lengths:
        starts = range(len(tokens) - n)
        for start in reversed(starts) if starts_from_the_right else starts:
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                return n, start
    return None


class NgramRightmostOccurrence(NgramProposer):
    """Copies after the most recent occurrence of the longest suffix, not the first (vLLM takes the first)."""

    def propose(self, token_ids: TokenIds[int]) -> list[int]:
        tokens = list(token_ids)
        found = _search(tokens, range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1), True)
        return [] if found is None else tokens[found[1] + found[0] : found[1] + found[0] + self.k]


class NgramSuffixWithoutTheLastToken(NgramProposer):
    """Off by one: matches the suffix that ends one token before the last, so it proposes the token that followed
    that one — usually the context's own last token again."""

    def propose(self, token_ids: TokenIds[int]) -> list[int]:
        tokens = list(token_ids)[:-1]
        found = _search(tokens, range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1), False)
        return [] if found is None else list(token_ids)[found[1] + found[0] : found[1] + found[0] + self.k]


class NgramShortestSuffixFirst(NgramProposer):
    """Tries suffix lengths from prompt_lookup_min upwards and takes the first that occurs: the shortest match."""

    def propose(self, token_ids: TokenIds[int]) -> list[int]:
        tokens = list(token_ids)
        found = _search(tokens, range(self.min_n, min(self.max_n, len(tokens) - 1) + 1), False)
        return [] if found is None else tokens[found[1] + found[0] : found[1] + found[0] + self.k]


class NgramIgnoresPromptLookupMin(NgramProposer):
    """Accepts a suffix of any length from 1, whatever prompt_lookup_min says."""

    def propose(self, token_ids: TokenIds[int]) -> list[int]:
        tokens = list(token_ids)
        found = _search(tokens, range(min(self.max_n, len(tokens) - 1), 0, -1), False)
        return [] if found is None else tokens[found[1] + found[0] : found[1] + found[0] + self.k]


class NgramProposesTheMatchItself(NgramProposer):
    """Proposes from the start of the occurrence instead of after it: the suffix again, then what followed."""

    def propose(self, token_ids: TokenIds[int]) -> list[int]:
        tokens = list(token_ids)
        found = _search(tokens, range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1), False)
        return [] if found is None else tokens[found[1] : found[1] + self.k]


# --- rejection_random_sample ----------------------------------------------------------------------------------------


def _verdicts(target_probs: torch.Tensor, draft_token_ids: list[int], draft_probs: torch.Tensor | None,
              uniform: torch.Tensor) -> int:
    """How many drafts the reference's accept test takes, for these uniforms."""
    for j, token in enumerate(draft_token_ids):
        q = 1.0 if draft_probs is None else float(draft_probs[j, token])
        if not float(uniform[j]) * q < float(target_probs[j, token]):
            return j
    return len(draft_token_ids)


def random_resamples_from_p(target_probs: torch.Tensor, draft_token_ids: list[int], draft_probs: torch.Tensor | None,
                            generator: torch.Generator | None) -> list[int]:
    """On rejection draws the replacement from p itself instead of normalise(max(0, p - q)): the rejected token
    can come back, so it is drawn more often than p says."""
    uniform = torch.rand(len(draft_token_ids) + 1, generator=generator)
    accepted = _verdicts(target_probs, draft_token_ids, draft_probs, uniform)
    final = int(inverse_cdf(target_probs[accepted][None], uniform[-1:])[0])
    return draft_token_ids[:accepted] + [final]


def random_forgets_the_bonus_token(target_probs: torch.Tensor, draft_token_ids: list[int],
                                   draft_probs: torch.Tensor | None, generator: torch.Generator | None) -> list[int]:
    """When every draft is accepted, returns the drafts alone."""
    out = reference_random_sample(target_probs, draft_token_ids, draft_probs, generator)
    return out[:-1] if draft_token_ids and out[:-1] == draft_token_ids else out


def random_uses_the_global_generator(target_probs: torch.Tensor, draft_token_ids: list[int],
                                     draft_probs: torch.Tensor | None, generator: torch.Generator | None) -> list[int]:
    """Draws from torch's global generator, ignoring the sequence's own: a seed reproduces nothing, and what a
    sequence draws depends on everything else that drew before it."""
    return reference_random_sample(target_probs, draft_token_ids, draft_probs, None)


def random_keeps_the_rejected_draft(target_probs: torch.Tensor, draft_token_ids: list[int],
                                    draft_probs: torch.Tensor | None, generator: torch.Generator | None) -> list[int]:
    """Accepts the first rejected draft anyway, and ends there: its token is the draft, not the target's."""
    uniform = torch.rand(len(draft_token_ids) + 1, generator=generator)
    accepted = _verdicts(target_probs, draft_token_ids, draft_probs, uniform)
    if accepted < len(draft_token_ids):
        return draft_token_ids[: accepted + 1]
    return draft_token_ids + [int(inverse_cdf(target_probs[accepted][None], uniform[-1:])[0])]


def random_draws_only_what_it_needs(target_probs: torch.Tensor, draft_token_ids: list[int],
                                    draft_probs: torch.Tensor | None, generator: torch.Generator | None) -> list[int]:
    """Draws a uniform per accept test only until the first rejection: correct in distribution, but how far the
    generator moves depends on the verdicts, so a seeded sequence's later steps change with them."""
    accepted = len(draft_token_ids)
    for j, token in enumerate(draft_token_ids):
        q = 1.0 if draft_probs is None else float(draft_probs[j, token])
        if not float(torch.rand(1, generator=generator)) * q < float(target_probs[j, token]):
            accepted = j
            break
    p = target_probs[accepted]
    weights = p
    if accepted < len(draft_token_ids):
        q_row = torch.zeros_like(p) if draft_probs is None else draft_probs[accepted]
        if draft_probs is None:
            q_row[draft_token_ids[accepted]] = 1.0
        residual = (p - q_row).clamp(min=0.0)
        weights = residual if residual.sum() > 0 else p
    final = int(inverse_cdf(weights[None], torch.rand(1, generator=generator))[0])
    return draft_token_ids[:accepted] + [final]


def random_residual_not_renormalised(target_probs: torch.Tensor, draft_token_ids: list[int],
                                     draft_probs: torch.Tensor | None, generator: torch.Generator | None) -> list[int]:
    """Draws the replacement by an inverse CDF of max(0, p - q) written by hand, the uniform compared with the
    residual's cumulative mass unscaled: the residual sums to less than 1, so a uniform past its total lands on the
    last token with mass, which comes out too often."""
    uniform = torch.rand(len(draft_token_ids) + 1, generator=generator)
    accepted = _verdicts(target_probs, draft_token_ids, draft_probs, uniform)
    weights = target_probs[accepted]
    if accepted < len(draft_token_ids):
        q_row = torch.zeros_like(weights) if draft_probs is None else draft_probs[accepted]
        if draft_probs is None:
            q_row[draft_token_ids[accepted]] = 1.0
        weights = (weights - q_row).clamp(min=0.0)
    last_with_mass = int(weights.nonzero().max())
    final = min(int(torch.searchsorted(weights.cumsum(dim=-1), uniform[-1:], right=True)[0]), last_with_mass)
    return draft_token_ids[:accepted] + [final]


def random_draws_the_final_uniform_first(target_probs: torch.Tensor, draft_token_ids: list[int],
                                         draft_probs: torch.Tensor | None,
                                         generator: torch.Generator | None) -> list[int]:
    """Takes the final token's uniform first and the accept tests' after it: the same k + 1 numbers and the same
    distribution, but a seeded request draws other tokens than the rule says, and than the same request did before."""
    drawn = torch.rand(len(draft_token_ids) + 1, generator=generator)
    uniform = torch.cat([drawn[1:], drawn[:1]])  # the accept tests read drawn[1:], the final token drawn[0]
    accepted = _verdicts(target_probs, draft_token_ids, draft_probs, uniform)
    weights = target_probs[accepted]
    if accepted < len(draft_token_ids):
        q_row = torch.zeros_like(weights) if draft_probs is None else draft_probs[accepted]
        if draft_probs is None:
            q_row[draft_token_ids[accepted]] = 1.0
        residual = (weights - q_row).clamp(min=0.0)
        weights = residual if residual.sum() > 0 else weights
    return draft_token_ids[:accepted] + [int(inverse_cdf(weights[None], uniform[-1:])[0])]


# --- num_scheduled_spec_tokens --------------------------------------------------------------------------------------


def admission_forgets_the_newest_token(seq: Sequence, token_budget: int, long_prefill_token_threshold: int,
                                       max_model_len: int) -> int:
    """Gives the drafts the whole budget left: with the newest token the step takes one token more than it has."""
    room = min(token_budget, long_prefill_token_threshold, max_model_len - seq.num_tokens - 1)
    return min(len(seq.spec_token_ids), room)


def admission_ignores_max_model_len(seq: Sequence, token_budget: int, long_prefill_token_threshold: int,
                                    max_model_len: int) -> int:
    """Checks the budget only: drafts near the end of the context run past max_model_len."""
    return min(len(seq.spec_token_ids), min(token_budget, long_prefill_token_threshold) - 1)


def admission_forgets_the_token_verification_adds(seq: Sequence, token_budget: int,
                                                  long_prefill_token_threshold: int, max_model_len: int) -> int:
    """Lets the drafts fill the context up to max_model_len: with every draft accepted, the target's token after
    them is one past it."""
    room = min(min(token_budget, long_prefill_token_threshold) - 1, max_model_len - seq.num_tokens)
    return min(len(seq.spec_token_ids), room)


def admission_ignores_the_per_sequence_cap(seq: Sequence, token_budget: int, long_prefill_token_threshold: int,
                                           max_model_len: int) -> int:
    """Checks the step's budget but not long_prefill_token_threshold, the most tokens one sequence takes in a step."""
    room = min(token_budget - 1, max_model_len - seq.num_tokens - 1)
    return min(len(seq.spec_token_ids), room)


def admission_counts_room_not_drafts(seq: Sequence, token_budget: int, long_prefill_token_threshold: int,
                                     max_model_len: int) -> int:
    """Returns the room the step has, not how many of the sequence's drafts fill it."""
    return min(min(token_budget, long_prefill_token_threshold) - 1, max_model_len - seq.num_tokens - 1)


# --- hand_back_rejected_drafts --------------------------------------------------------------------------------------


def hand_back_never_rolls_back(kv_cache_manager: KVCacheManager, seq: Sequence, start: int, num_sampled: int) -> None:
    """Leaves num_computed_tokens where scheduling put it: the rejected drafts' K/V count as the sequence's."""
    kv_cache_manager.cache_blocks(seq, start, min(seq.num_computed_tokens, start + num_sampled, seq.num_tokens))


def hand_back_rolls_back_twice(kv_cache_manager: KVCacheManager, seq: Sequence, start: int, num_sampled: int) -> None:
    """Subtracts the rejected drafts from start + num_sampled, a count that already leaves them out: verified
    tokens are recomputed for nothing."""
    num_rejected = seq.num_computed_tokens - start - num_sampled
    seq.num_computed_tokens = min(start + num_sampled, seq.num_tokens) - num_rejected
    kv_cache_manager.cache_blocks(seq, start, seq.num_computed_tokens)


def hand_back_rolls_back_only_the_rejected(kv_cache_manager: KVCacheManager, seq: Sequence, start: int,
                                           num_sampled: int) -> None:
    """Subtracts the rejected drafts and nothing else: after a stop inside the accepted run it counts as computed
    accepted drafts the sequence dropped, past its own tokens."""
    seq.num_computed_tokens -= seq.num_computed_tokens - (start + num_sampled)
    kv_cache_manager.cache_blocks(seq, start, min(seq.num_computed_tokens, seq.num_tokens))


def hand_back_always_one_behind(kv_cache_manager: KVCacheManager, seq: Sequence, start: int, num_sampled: int) -> None:
    """Leaves the newest token uncomputed whatever happened: right without a stop, but a stop that was an accepted
    draft has its K/V, and the block it completed is never registered."""
    seq.num_computed_tokens = seq.num_tokens - 1
    kv_cache_manager.cache_blocks(seq, start, seq.num_computed_tokens)


def hand_back_frees_the_draft_blocks(kv_cache_manager: KVCacheManager, seq: Sequence, start: int,
                                     num_sampled: int) -> None:
    """Frees the blocks past the sequence's tokens (they held only rejected drafts): they go to the free queue's
    tail, and the next step's drafts take a block from its head, evicting a cached one."""
    seq.num_computed_tokens = min(start + num_sampled, seq.num_tokens)
    num_needed = -(-seq.num_tokens // kv_cache_manager.block_size)
    pool = kv_cache_manager.block_pool
    pool.free_blocks(pool.blocks[b] for b in reversed(seq.block_table[num_needed:]))
    del seq.block_table[num_needed:]
    kv_cache_manager.cache_blocks(seq, start, seq.num_computed_tokens)


def hand_back_hashes_the_drafted_range(kv_cache_manager: KVCacheManager, seq: Sequence, start: int,
                                       num_sampled: int) -> None:
    """Registers the blocks full within everything the step computed (or all the sequence's tokens, if fewer): a
    block whose slots hold a rejected draft's K/V becomes a prefix-cache hit for the sequence's real tokens."""
    scheduled = seq.num_computed_tokens
    seq.num_computed_tokens = min(start + num_sampled, seq.num_tokens)
    kv_cache_manager.cache_blocks(seq, start, min(scheduled, seq.num_tokens))


def hand_back_hashes_the_newest_token(kv_cache_manager: KVCacheManager, seq: Sequence, start: int,
                                      num_sampled: int) -> None:
    """Registers the blocks full within all of the sequence's tokens, the newest included, whose K/V is computed
    only next step (its slot still holds a rejected draft's)."""
    seq.num_computed_tokens = min(start + num_sampled, seq.num_tokens)
    kv_cache_manager.cache_blocks(seq, start, seq.num_tokens)


def hand_back_never_caches(kv_cache_manager: KVCacheManager, seq: Sequence, start: int, num_sampled: int) -> None:
    """Rolls back but registers nothing: the blocks accepted drafts filled never serve a prefix hit."""
    seq.num_computed_tokens = min(start + num_sampled, seq.num_tokens)


MUTANTS = {
    "ngram_rightmost_occurrence": {"NgramProposer": NgramRightmostOccurrence},
    "ngram_suffix_without_the_last_token": {"NgramProposer": NgramSuffixWithoutTheLastToken},
    "ngram_shortest_suffix_first": {"NgramProposer": NgramShortestSuffixFirst},
    "ngram_ignores_prompt_lookup_min": {"NgramProposer": NgramIgnoresPromptLookupMin},
    "ngram_proposes_the_match_itself": {"NgramProposer": NgramProposesTheMatchItself},
    "random_resamples_from_p": {"rejection_random_sample": random_resamples_from_p},
    "random_forgets_the_bonus_token": {"rejection_random_sample": random_forgets_the_bonus_token},
    "random_uses_the_global_generator": {"rejection_random_sample": random_uses_the_global_generator},
    "random_keeps_the_rejected_draft": {"rejection_random_sample": random_keeps_the_rejected_draft},
    "random_draws_only_what_it_needs": {"rejection_random_sample": random_draws_only_what_it_needs},
    "random_residual_not_renormalised": {"rejection_random_sample": random_residual_not_renormalised},
    "random_draws_the_final_uniform_first": {"rejection_random_sample": random_draws_the_final_uniform_first},
    "admission_forgets_the_newest_token": {"num_scheduled_spec_tokens": admission_forgets_the_newest_token},
    "admission_ignores_max_model_len": {"num_scheduled_spec_tokens": admission_ignores_max_model_len},
    "admission_forgets_the_token_verification_adds": {
        "num_scheduled_spec_tokens": admission_forgets_the_token_verification_adds
    },
    "admission_ignores_the_per_sequence_cap": {"num_scheduled_spec_tokens": admission_ignores_the_per_sequence_cap},
    "admission_counts_room_not_drafts": {"num_scheduled_spec_tokens": admission_counts_room_not_drafts},
    "hand_back_never_rolls_back": {"hand_back_rejected_drafts": hand_back_never_rolls_back},
    "hand_back_rolls_back_twice": {"hand_back_rejected_drafts": hand_back_rolls_back_twice},
    "hand_back_rolls_back_only_the_rejected": {"hand_back_rejected_drafts": hand_back_rolls_back_only_the_rejected},
    "hand_back_always_one_behind": {"hand_back_rejected_drafts": hand_back_always_one_behind},
    "hand_back_frees_the_draft_blocks": {"hand_back_rejected_drafts": hand_back_frees_the_draft_blocks},
    "hand_back_hashes_the_drafted_range": {"hand_back_rejected_drafts": hand_back_hashes_the_drafted_range},
    "hand_back_hashes_the_newest_token": {"hand_back_rejected_drafts": hand_back_hashes_the_newest_token},
    "hand_back_never_caches": {"hand_back_rejected_drafts": hand_back_never_caches},
}

# One mutant per exercise that must also break the capstone (the capstone runs every piece).
CAPSTONE_MUTANTS = {
    "NgramProposer": "ngram_proposes_the_match_itself",
    "rejection_random_sample": "random_keeps_the_rejected_draft",
    "num_scheduled_spec_tokens": "admission_forgets_the_newest_token",
    "hand_back_rejected_drafts": "hand_back_never_rolls_back",
}

# The statements each exercise's question is about, as `ast.unparse` writes them (a compound statement by its
# header). Hint 2 may show none of them, and nothing under chapters/ may state them (tests/test_hints.py): they
# live here, beside the wrong answers, because a learner reads the chapter's test file.
DECISIVE = {
    "NgramProposer": [
        "if longest < self.min_n:",
        "start = int(np.argmax(match_len == longest)) + 1",
        "return tokens[start:start + self.k].tolist()",
    ],
    "rejection_random_sample": [
        "uniform = torch.rand(num_drafts + 1, generator=generator).to(device)",
        "accept = (uniform[:num_drafts] * q_of_draft < target_probs[positions, drafts]).tolist()",
        "num_accepted = accept.index(False) if False in accept else num_drafts",
        "residual = (p - q).clamp(min=0.0)",
        "final = int(inverse_cdf(weights[None], uniform[num_drafts:])[0])",
    ],
    "num_scheduled_spec_tokens": [
        "room = min(token_budget, long_prefill_token_threshold) - 1",
        "room = min(room, max_model_len - seq.num_tokens - 1)",
    ],
    "hand_back_rejected_drafts": [
        "seq.num_computed_tokens = min(start + num_sampled, seq.num_tokens)",
        "kv_cache_manager.cache_blocks(seq, start, seq.num_computed_tokens)",
    ],
}

"""The n-gram proposer against vLLM's semantics: the longest suffix of the context with a length in
[prompt_lookup_min, prompt_lookup_max] that occurs earlier, its first (leftmost) earlier occurrence, and up to
num_speculative_tokens tokens that followed it. Hand-made cases, then a brute-force oracle on random sequences."""

import random

from solutions.spec_decode.ngram_proposer import NgramProposer


def oracle(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Try every suffix length from the longest down, every earlier start from the left: the first hit wins."""
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n):  # the occurrence ends before the last token
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_vllm_docstring_example():
    """vLLM's example: [4, 2, 3] has no earlier occurrence, [2, 3] has one, followed by only three tokens."""
    assert NgramProposer(2, 3, 4).propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]


def test_longest_suffix_wins_up_to_prompt_lookup_max():
    """[1, 2, 3] occurs earlier (followed by 6, 1, 2); its shorter suffix [2, 3] occurs even earlier (followed by
    5, 1, 2). The longest allowed length wins; capping the length at 2 finds the shorter one's first occurrence."""
    tokens = [2, 3, 5, 1, 2, 3, 6, 1, 2, 3]
    assert NgramProposer(1, 3, 3).propose(tokens) == [6, 1, 2]
    assert NgramProposer(1, 2, 3).propose(tokens) == [5, 1, 2]
    assert NgramProposer(3, 3, 3).propose(tokens) == [6, 1, 2]


def test_prompt_lookup_min_refuses_shorter_matches():
    """Only the last token (7) occurs earlier: a 1-gram match, refused when at least 2 tokens must match."""
    tokens = [7, 4, 9, 1, 7]
    assert NgramProposer(1, 3, 2).propose(tokens) == [4, 9]
    assert NgramProposer(2, 3, 2).propose(tokens) == []


def test_no_match_and_short_contexts_propose_nothing():
    assert NgramProposer(1, 3, 4).propose([1, 2, 3, 4]) == []
    assert NgramProposer(1, 3, 4).propose([]) == []
    assert NgramProposer(1, 3, 4).propose([5]) == []
    assert NgramProposer(3, 4, 4).propose([5, 5]) == []  # shorter than prompt_lookup_min


def test_match_at_the_very_end_overlapping_the_suffix():
    """The earlier occurrence may end right before the last token, overlapping the suffix it matches."""
    assert NgramProposer(1, 1, 3).propose([5, 1, 1]) == [1]
    assert NgramProposer(2, 2, 3).propose([7, 7, 7]) == [7]
    assert NgramProposer(2, 4, 5).propose([1, 1, 1, 1, 1]) == [1]  # the 4-gram at 0..3 is followed by one token


def test_several_occurrences_take_the_first_as_vllm():
    """[1, 2] occurs at 0 and at 3: vLLM drafts from the earliest occurrence, not the most recent one."""
    assert NgramProposer(2, 2, 2).propose([1, 2, 5, 1, 2, 6, 1, 2]) == [5, 1]


def test_proposal_is_truncated_at_the_context_end():
    assert NgramProposer(2, 2, 5).propose([1, 2, 3, 1, 2]) == [3, 1, 2]
    assert NgramProposer(2, 2, 2).propose([1, 2, 3, 1, 2]) == [3, 1]


def test_against_a_brute_force_oracle_on_random_sequences():
    """Small vocabularies make many repeats, overlaps and ties; every bound combination is drawn."""
    rng = random.Random(0)
    for _ in range(3000):
        min_n = rng.randint(1, 4)
        max_n, k = rng.randint(min_n, 6), rng.randint(1, 6)
        tokens = [rng.randrange(rng.randint(1, 5)) for _ in range(rng.randint(0, 40))]
        assert NgramProposer(min_n, max_n, k).propose(tokens) == oracle(tokens, min_n, max_n, k), (tokens, min_n, max_n)


def test_long_context_finds_a_planted_copy():
    """A few thousand random tokens from a large vocabulary, with a span copied from the start at the end."""
    rng = random.Random(1)
    tokens = [rng.randrange(50_000) for _ in range(4000)]
    tokens += tokens[100:103]  # the last 3 tokens repeat positions 100..102, followed by 103.. in the context
    assert NgramProposer(1, 4, 5).propose(tokens) == tokens[103:108] == oracle(tokens, 1, 4, 5)

"""The throughput benchmark's pure-Python parts: how two engines' greedy streams are compared."""

from benchmarks.throughput import token_agreement


def test_token_agreement_counts_positions_prefixes_and_identical_requests():
    ours = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    theirs = [[1, 2, 3, 4], [5, 0, 7, 8], [0, 9]]  # request 1 parts at token 1 and meets again; request 2 at 0
    agreement = token_agreement(ours, theirs)
    assert agreement["identical_requests"] == 1
    assert agreement["equal_tokens"] == 8 / 10  # 4 + 3 + 1 equal positions of 10
    assert agreement["before_first_divergence"] == 5 / 10  # 4 + 1 + 0: a request counts only up to where it parts

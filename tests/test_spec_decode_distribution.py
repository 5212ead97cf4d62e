"""Random sampling with n-gram speculation, through the whole engine: the tokens are distributed as without it,
a seeded request reproduces its tokens, alone or beside others.

The prompt is a permutation of the tiny model's 256 tokens, so whatever the first output token, it occurred in the
prompt and the n-gram proposer drafts the token that followed it there: every request's second output token is
verified against drafts, and its third too when the second step accepted none (the test checks the count of
sequences whose drafts were verified, `num_drafts`: between one and two per request).
"""

from collections import Counter

import pytest
import torch

from grading.tiny_models import tiny_checkpoint
from solutions import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
ENGINE = dict(max_num_seqs=512, max_num_batched_tokens=4096, block_size=16)
PROMPT = torch.randperm(256, generator=torch.Generator().manual_seed(0)).tolist()
N = 1500  # seeded requests per engine
ALPHA = 1e-3
# Power: the two-sample statistic below is about noncentral chi-square with noncentrality
# N * sum((p - q)^2 / (p + q)) >= 2 N TV(p, q)^2 (Cauchy-Schwarz) when the two engines sample from p and q. At
# most 16 cells (top_k = 4 for each of two tokens; 15 degrees of freedom, critical value 37.7 at alpha = 1e-3), a
# noncentrality of 40 is detected with probability 0.90 (simulated): with N = 1500, any shift of total variation
# >= 0.115 in the joint law of the first two tokens, whatever its direction. The seeds are fixed: a run is
# deterministic.


def params(seed: int, max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=4, max_tokens=max_tokens, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module")
def folder():
    return tiny_checkpoint("llama-gqa")


@pytest.fixture(scope="module")
def speculative(folder):
    return LLM(model=str(folder), speculative_config=NGRAM, **ENGINE)


def two_sample_p_value(first: Counter, second: Counter) -> float:
    """Pearson's chi-square test that two equal-sized samples come from one distribution; cells with fewer than
    10 draws in the two samples together are merged into one."""
    cells = sorted(set(first) | set(second), key=str)
    small = [c for c in cells if first[c] + second[c] < 10]
    large = [c for c in cells if c not in small]
    a = torch.tensor([first[c] for c in large] + [sum(first[c] for c in small)], dtype=torch.float64)
    b = torch.tensor([second[c] for c in large] + [sum(second[c] for c in small)], dtype=torch.float64)
    keep = (a + b) > 0
    statistic = ((a - b)[keep] ** 2 / (a + b)[keep]).sum()
    dof = torch.tensor((int(keep.sum()) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))


def test_sampled_tokens_are_distributed_as_without_speculation(folder, speculative):
    plain = LLM(model=str(folder), **ENGINE)
    seeds, drafts_before = range(N), speculative.llm_engine.stats.num_drafts
    ours = [o.outputs[0].token_ids for o in speculative.generate([PROMPT] * N, [params(s) for s in seeds])]
    # other seeds: two independent samples (with one seed, the first token is drawn identically by both engines)
    theirs = [o.outputs[0].token_ids for o in plain.generate([PROMPT] * N, [params(N + s) for s in seeds])]
    verified = speculative.llm_engine.stats.num_drafts - drafts_before
    assert N <= verified <= 2 * N, "every request's second token was verified against drafts (its third, at most)"
    assert all(len(tokens) == 3 for tokens in ours + theirs)
    first_two = Counter(tuple(t[:2]) for t in ours), Counter(tuple(t[:2]) for t in theirs)
    p_value = two_sample_p_value(*first_two)
    assert p_value > ALPHA, f"p-value {p_value:.2e}: with speculation {first_two[0]}, without {first_two[1]}"
    third = Counter(t[2] for t in ours), Counter(t[2] for t in theirs)
    assert two_sample_p_value(*third) > ALPHA, f"the token after the verified one: {third[0]} vs {third[1]}"


def test_a_seeded_request_gives_the_same_tokens_again_and_beside_others(speculative):
    """Longer outputs (drafts accepted and rejected over several steps): one seed, the same tokens, whether the
    request runs again alone or among others that draft, accept and reject differently."""
    alone = [speculative.generate([PROMPT], params(seed, max_tokens=24))[0].outputs[0].token_ids for seed in (7, 8)]
    assert alone[0] != alone[1], "different seeds draw differently"
    again = speculative.generate([PROMPT], params(7, max_tokens=24))[0].outputs[0].token_ids
    assert again == alone[0]
    g = torch.Generator().manual_seed(1)
    others = [torch.randperm(256, generator=g)[: 20 + 10 * i].tolist() for i in range(5)]
    before = speculative.llm_engine.stats.num_draft_tokens
    batch = speculative.generate(
        others[:2] + [PROMPT] + others[2:] + [PROMPT],
        [params(100 + i, max_tokens=24) for i in range(2)] + [params(7, max_tokens=24)]
        + [params(200 + i, max_tokens=24) for i in range(3)] + [params(8, max_tokens=24)],
    )
    assert [batch[2].outputs[0].token_ids, batch[6].outputs[0].token_ids] == alone
    assert speculative.llm_engine.stats.num_draft_tokens > before, "drafts were verified in the batch"

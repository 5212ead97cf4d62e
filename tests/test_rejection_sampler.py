"""The rejection sampler: greedy verification by hand, then the one property that matters for random sampling —
the output tokens are distributed exactly as the target's processed distribution p — checked by chi-square tests
over many seeded draws, for an n-gram draft (one-hot q) and for a draft model's q. Then seeds: reproducible,
batch-invariant, and with no drafts the same token as the ordinary sampler."""

from collections import Counter

import pytest
import torch

from solutions.sample.rejection_sampler import rejection_sample
from solutions.sample.sampler import sample
from solutions.sampling_params import SamplingParams

V = 8  # vocabulary of every test here
GREEDY = SamplingParams(temperature=0.0)


def peaked(argmaxes: list[int]) -> torch.Tensor:
    """Logits (len, V) whose row j has its maximum at argmaxes[j], over noise that differs per row."""
    logits = torch.randn(len(argmaxes), V, generator=torch.Generator().manual_seed(len(argmaxes)))
    logits[torch.arange(len(argmaxes)), argmaxes] = 10.0
    return logits


def seeded(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


# --- greedy ---------------------------------------------------------------------------------------------------------


def test_greedy_accepts_all_and_appends_the_bonus_token():
    assert rejection_sample(peaked([3, 1, 4, 6]), [[3, 1, 4]], [GREEDY], [None]) == [[3, 1, 4, 6]]


def test_greedy_accepts_none_and_gives_the_target_token():
    assert rejection_sample(peaked([3, 1, 4, 6]), [[2, 1, 4]], [GREEDY], [None]) == [[3]]


def test_greedy_stops_at_the_first_mismatch_with_the_target_token():
    """Drafts after a mismatch are dropped even where they equal the target's argmax there."""
    assert rejection_sample(peaked([3, 1, 4, 6]), [[3, 5, 4]], [GREEDY], [None]) == [[3, 1]]
    assert rejection_sample(peaked([3, 1, 4, 6]), [[3, 1, 0]], [GREEDY], [None]) == [[3, 1, 4]]


def test_greedy_batch_with_no_drafts_and_different_lengths():
    logits = torch.cat([peaked([5]), peaked([3, 1, 4, 6]), peaked([2, 7])])
    assert rejection_sample(logits, [[], [3, 1, 4], [2]], [GREEDY] * 3, [None] * 3) == [[5], [3, 1, 4, 6], [2, 7]]


# --- random: the output distribution is the target's -------------------------------------------------------------

N = 20_000  # sequences per chi-square case, each with its own seed
ALPHA = 1e-3
# Power: the statistic is about noncentral chi-square with noncentrality N * sum((p' - p)^2 / p) >= 4 N TV(p', p)^2
# under a wrong distribution p'. With N = 20000 draws at alpha = 1e-3 over V = 8 tokens (7 degrees of freedom,
# critical value 24.3), a total-variation shift of 0.025 gives noncentrality >= 50 and is detected with
# probability >= 0.99 (0.90 for a shift of 0.02). The later positions see fewer draws, those whose earlier drafts
# were all accepted: at least N / 8 = 2500 is required, which detects a shift of 0.071 with probability >= 0.99.
# The seeds are fixed, so a run is deterministic; a correct sampler fails a given seed with probability about
# 3 * alpha.


def chi_square_p_value(tokens: list[int], probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test that `tokens` are draws from `probs` (V,); a draw of a token of
    probability 0 fails outright."""
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    expected = probs.double() * len(tokens)
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew tokens of probability 0: {counts.tolist()} vs {probs.tolist()}"
    statistic = ((counts - expected)[support] ** 2 / expected[support]).sum()
    dof = torch.tensor((int(support.sum()) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))


def target_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """p by hand: temperature, then only the top_k most likely tokens kept, renormalised."""
    scaled = logits / temperature
    kept = torch.full_like(scaled, float("-inf")).scatter(-1, scaled.topk(top_k).indices, scaled.topk(top_k).values)
    return torch.softmax(kept, dim=-1)


def check_target_distribution(outputs: list[list[int]], drafts: list[list[int]], probs: torch.Tensor) -> None:
    """Each output is accepted drafts then one token; the token at position j, among outputs that got there
    (drafts 0..j-1 accepted), is distributed as probs[j]; enough outputs accept every draft and get a bonus."""
    k = probs.shape[0] - 1
    for output, draft in zip(outputs, drafts, strict=True):
        assert 1 <= len(output) <= k + 1 and output[:-1] == draft[: len(output) - 1], (output, draft)
    for j in range(k + 1):
        at_j = [output[j] for output in outputs if len(output) > j]
        assert len(at_j) >= N // 8, f"only {len(at_j)} outputs reached position {j} (bonus at {k})"
        p_value = chi_square_p_value(at_j, probs[j])
        assert p_value > ALPHA, f"position {j}: p-value {p_value:.2e}, counts {Counter(at_j)}, p {probs[j]}"


def test_ngram_draft_keeps_the_target_distribution():
    """One-hot q: accept x with probability p(x), else draw from p without x. The drafts are the second most
    likely token at position 0 (p about 0.35) and the most likely at position 1 (about 0.57); top-k = 6 gives two
    tokens probability 0 in every row."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0)) * 1.5  # k = 2 drafts, then the bonus
    params = SamplingParams(temperature=0.8, top_k=6)
    probs = target_probs(logits, 0.8, 6)
    draft = [int(probs[0].topk(2).indices[1]), int(probs[1].argmax())]
    outputs = rejection_sample(logits.repeat(N, 1), [draft] * N, [params] * N, seeded(*range(N)))
    check_target_distribution(outputs, [draft] * N, probs)


def test_draft_model_keeps_the_target_distribution():
    """A real q, different from p: each sequence's drafts are drawn from q (as a draft model would), accepted with
    probability min(1, p / q), else replaced from normalise(max(0, p - q))."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=gen)
    q = torch.softmax(logits[:2] + torch.randn(2, V, generator=gen), dim=-1)  # (k, V)
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=gen) for j in range(2)], 1).tolist()
    params = SamplingParams(temperature=1.0)
    outputs = rejection_sample(logits.repeat(N, 1), drafts, [params] * N, seeded(*range(N)), [q] * N)
    check_target_distribution(outputs, drafts, torch.softmax(logits, dim=-1))


def test_a_draft_the_target_filtered_out_is_never_accepted():
    """p(x) = 0 outside top-k: the draft is rejected whatever the uniform, and the replacement is inside top-k."""
    logits = torch.arange(V, dtype=torch.float32).repeat(2, 1)  # token V - 1 most likely, token 0 least
    outputs = rejection_sample(
        logits.repeat(50, 1), [[0]] * 50, [SamplingParams(top_k=3)] * 50, seeded(*range(50))
    )
    assert {len(output) for output in outputs} == {1} and {t for (t,) in outputs} <= {V - 3, V - 2, V - 1}


def test_a_draft_more_likely_under_the_target_is_always_accepted():
    """q(x) <= p(x): min(1, p / q) = 1, so every seed accepts both drafts and gets a bonus token."""
    logits = torch.zeros(3, V)
    logits[:, 2] = 2.0  # p(2) = e^2 / (e^2 + 7), about 0.51
    q = torch.full((2, V), 0.5 / (V - 1))
    q[:, 2] = 0.5
    outputs = rejection_sample(logits.repeat(50, 1), [[2, 2]] * 50, [SamplingParams()] * 50, seeded(*range(50)),
                               [q] * 50)
    assert all(output[:2] == [2, 2] and len(output) == 3 for output in outputs)


# --- seeds: reproducible, batch-invariant, the ordinary sampler without drafts --------------------------------------


def mixed_batch() -> tuple[torch.Tensor, list[list[int]], list[SamplingParams], list[torch.Tensor | None]]:
    """Five sequences: greedy accepting all, n-gram random with top-p, draft-model random with min-p, no drafts
    with top-k, and greedy rejecting its second draft."""
    gen = torch.Generator().manual_seed(5)
    drafts = [[1, 2], [3, 3, 0], [4, 6], [], [5, 5, 5]]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), V, generator=gen)
    logits[[0, 1, 11, 12], [1, 2, 5, 3]] = 10.0  # the greedy sequences: accept 1, 2 (then a bonus); accept 5, not 5
    params = [GREEDY, SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(temperature=1.2, min_p=0.05),
              SamplingParams(top_k=4), GREEDY]
    q = torch.softmax(torch.randn(2, V, generator=gen), dim=-1)
    return logits, drafts, params, [None, None, q, None, None]


def rows_of(drafts: list[list[int]], i: int) -> slice:
    start = sum(len(d) + 1 for d in drafts[:i])
    return slice(start, start + len(drafts[i]) + 1)


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed():
    logits, drafts, params, q = mixed_batch()
    first = [rejection_sample(logits, drafts, params, seeded(s, s + 1, s + 2, s + 3, s + 4), q) for s in range(20)]
    again = [rejection_sample(logits, drafts, params, seeded(s, s + 1, s + 2, s + 3, s + 4), q) for s in range(20)]
    assert first == again
    for i in (1, 2, 3):  # every random sequence's output varies with its seed
        assert len({tuple(out[i]) for out in first}) > 1


def test_a_seeded_sequence_draws_the_same_alone_or_in_any_batch():
    """Each random sequence alone (with its seed) equals itself inside the batch, in either order, whatever the
    unseeded sequences beside it draw; greedy sequences follow the greedy rule in the mixed batch."""
    logits, drafts, params, q = mixed_batch()
    for seed in range(10):
        batch = rejection_sample(logits, drafts, params, [None, *seeded(seed, seed + 1, seed + 2), None], q)
        order = [4, 3, 2, 1, 0]
        reversed_batch = rejection_sample(
            torch.cat([logits[rows_of(drafts, i)] for i in order]), [drafts[i] for i in order],
            [params[i] for i in order], [None, *seeded(seed + 2, seed + 1, seed), None], [q[i] for i in order],
        )
        assert reversed_batch[::-1] == batch
        for i, generator in zip((1, 2, 3), seeded(seed, seed + 1, seed + 2), strict=True):
            alone = rejection_sample(logits[rows_of(drafts, i)], [drafts[i]], [params[i]], [generator], [q[i]])
            assert alone == [batch[i]]
        assert batch[0] == [1, 2, int(logits[2].argmax())]  # both drafts accepted, then the bonus
        assert batch[4] == [5, 3]  # the second draft is rejected: the target's token


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.7, top_k=3), SamplingParams(top_p=0.8),
     SamplingParams(temperature=1.5, min_p=0.1), GREEDY],
)
def test_no_drafts_is_ordinary_sampling(params):
    """k = 0 for every sequence: the same token as `sample` with the same seeds (one uniform each, inverse CDF)."""
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(2)) * 2
    ours = rejection_sample(logits, [[]] * 64, [params] * 64, seeded(*range(64)))
    theirs = sample(logits, [params] * 64, seeded(*range(64))).sampled_token_ids
    assert ours == [[t] for t in theirs]


# --- bad input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "drafts", "params", "draft_probs", "field"),
    [(3, [[1, 2]], [GREEDY, GREEDY], None, "params"),
     (4, [[1, 2]], [GREEDY], None, "target_logits"),
     (3, [[1, V]], [GREEDY], None, r"draft_token_ids\[0\]"),
     (3, [[1, 2]], [GREEDY], [torch.full((1, V), 1 / V)], r"draft_probs\[0\]")],
)
def test_bad_input_is_refused_naming_the_argument(rows, drafts, params, draft_probs, field):
    with pytest.raises(ValueError, match=field):
        rejection_sample(torch.zeros(rows, V), drafts, params, [None] * len(params), draft_probs)

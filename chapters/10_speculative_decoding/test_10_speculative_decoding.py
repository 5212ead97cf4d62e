"""Grading tests for chapter 10 — speculative decoding.

Each test grades one exercise (`@pytest.mark.exercise`). The oracles owe nothing to the code under test: proposals
worked out by hand and a brute-force search over every suffix length and every earlier position for the n-gram
proposer; for the random verifier, the one property that matters — every output token is distributed as the
target's p — checked by chi-square tests over seeded draws, verdicts read off the generator's own uniforms, and
the generator's state for how many numbers it drew; for the draft admission, counts worked out by hand and a search
over every draft count that checks each limit as it is stated; block tables, free blocks and prefix-cache hashes
counted by hand for the hand-back. The capstone holds SmolLM2's greedy tokens to Hugging Face's, and a seeded
sampled request and the drafts' counts to the reference engine run on the same batch, with a step budget and a
`max_model_len` small enough that both cut drafts.
"""

import functools

import pytest
import torch

from grading import exercising, expect_equal
from grading.differential import differential_test, drafting_step, scheduler_workloads
from grading.capstone import CAPSTONE_PROMPTS, generate_batch, smollm2_greedy, swap_in
from solutions.core.block_hash import extend_block_hashes
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sched import scheduler as scheduler_module
from solutions.core.sequence import Sequence
from solutions.engine.arg_utils import EngineArgs
from solutions.engine.llm_engine import LLMEngine
from solutions.sample import rejection_sampler
from solutions.sample.sampler import sample
from solutions.sampling_params import SamplingParams
from solutions.spec_decode import ngram_proposer

REFERENCE = {
    "NgramProposer": ngram_proposer.NgramProposer,
    "rejection_random_sample": rejection_sampler.rejection_random_sample,
    "num_scheduled_spec_tokens": scheduler_module.num_scheduled_spec_tokens,
    "hand_back_rejected_drafts": scheduler_module.hand_back_rejected_drafts,
}

pytestmark = pytest.mark.timeout(60)


# --- NgramProposer.propose ----------------------------------------------------------------------------------------


def propose(impl, tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    inputs = f"NgramProposer({min_n}, {max_n}, {k}).propose({tokens})"
    with exercising("NgramProposer", inputs):
        return impl.NgramProposer(min_n, max_n, k).propose(tokens)


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Try every suffix length from the longest, every earlier start from the left: the first hit proposes."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n):  # the occurrence must end before the last token
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.exercise("NgramProposer")
def test_propose_copies_what_followed_the_suffix(impl):
    # The suffix [7, 8] occurred at positions 1-2, followed by 9, 10, 11.
    tokens = [5, 7, 8, 9, 10, 11, 3, 7, 8]
    expect_equal(propose(impl, tokens, 1, 3, 3), [9, 10, 11], inputs=f"{tokens}, n in [1, 3], k = 3")


@pytest.mark.exercise("NgramProposer")
def test_propose_prefers_the_longest_suffix(impl):
    # Suffix [8] alone occurs last at position 5 (followed by 1); the longer [7, 8] only at 1-2 (followed by 9).
    tokens = [5, 7, 8, 9, 4, 8, 1, 7, 8]
    expect_equal(propose(impl, tokens, 1, 3, 2), [9, 4], inputs=f"{tokens}, n in [1, 3], k = 2: [7, 8] beats [8]")
    # Capped at prompt_lookup_max = 1: only [8] counts; its first occurrence is at position 2 (followed by 9, 4).
    expect_equal(propose(impl, tokens, 1, 1, 2), [9, 4], inputs=f"{tokens}, n in [1, 1], k = 2")


@pytest.mark.exercise("NgramProposer")
def test_propose_takes_the_leftmost_occurrence(impl):
    # [1, 2] occurs at 0-1 (followed by 3, 4) and at 4-5 (followed by 5, 6): vLLM takes the first.
    tokens = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2]
    expect_equal(propose(impl, tokens, 2, 2, 2), [3, 4], inputs=f"{tokens}, n in [2, 2], k = 2")


@pytest.mark.exercise("NgramProposer")
def test_propose_refuses_suffixes_shorter_than_prompt_lookup_min(impl):
    tokens = [4, 9, 1, 2, 3, 9]  # only [9] (length 1) occurs earlier
    expect_equal(propose(impl, tokens, 2, 4, 3), [], inputs=f"{tokens}, n in [2, 4]: no suffix of 2 or more repeats")
    expect_equal(propose(impl, tokens, 1, 4, 3), [1, 2, 3], inputs=f"{tokens}, n in [1, 4]")


@pytest.mark.exercise("NgramProposer")
def test_propose_nothing_without_a_match(impl):
    for tokens in ([3], [1, 2, 3, 4], [6, 6]):
        want = [6] if tokens == [6, 6] else []
        expect_equal(propose(impl, tokens, 1, 3, 4), want, inputs=f"{tokens}, n in [1, 3], k = 4")


@pytest.mark.exercise("NgramProposer")
def test_propose_stops_at_the_end_of_the_context(impl):
    # [2, 2] at 0-1 overlaps the suffix at 1-2: it is followed by one token only, the last one.
    tokens = [2, 2, 2]
    expect_equal(propose(impl, tokens, 1, 3, 4), [2], inputs=f"{tokens}, n in [1, 3], k = 4")
    tokens = [1, 2, 3, 1, 2]
    expect_equal(propose(impl, tokens, 1, 3, 5), [3, 1, 2], inputs=f"{tokens}, n in [1, 3], k = 5")


@pytest.mark.exercise("NgramProposer")
@pytest.mark.parametrize("min_n, max_n, k", [(1, 1, 1), (1, 3, 4), (2, 4, 3), (3, 5, 8)])
def test_propose_matches_a_brute_force_search(impl, min_n, max_n, k):
    g = torch.Generator().manual_seed(min_n * 100 + max_n * 10 + k)
    for trial in range(60):
        length = int(torch.randint(1, 40, (1,), generator=g))
        tokens = torch.randint(0, 4, (length,), generator=g).tolist()  # a small vocabulary: many repeats
        expect_equal(propose(impl, tokens, min_n, max_n, k), brute_force(tokens, min_n, max_n, k),
                     inputs=f"trial {trial}: {tokens}, n in [{min_n}, {max_n}], k = {k} (oracle: brute force)")



# --- rejection_random_sample --------------------------------------------------------------------------------------

V = 6
NUM_DRAWS = 3000  # seeded calls per distribution test
ALPHA = 1e-4
# Power: the chi-square statistic under a wrong distribution p' is about noncentral with noncentrality
# N * sum((p' - p)^2 / p) >= 4 N TV(p', p)^2. With N = 3000 draws at alpha = 1e-4 over V = 6 tokens (5 degrees of
# freedom, critical value 25.7), a total-variation shift of 0.06 gives noncentrality >= 43, detected with
# probability >= 0.99. The wrong answers the chapter warns of shift the first token by 0.1 or more.


def target(seed: int, k: int, favoured: list[int] | None = None) -> torch.Tensor:
    """p (k + 1, V): a softmax of random logits, row j favouring token favoured[j] (so drafts of it are often
    accepted), every token likely enough to be counted."""
    logits = torch.randn(k + 1, V, generator=torch.Generator().manual_seed(seed)) * 0.5
    for j, token in enumerate(favoured or []):
        logits[j, token] += 2.0
    return torch.softmax(logits, dim=-1)


def random_sample(impl, p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, generator,
                  inputs: str) -> list[int]:
    with exercising("rejection_random_sample", inputs):
        return impl.rejection_random_sample(p, drafts, q, generator)


def chi_square_p_value(tokens: list[int], probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test that `tokens` are draws from `probs` (V,), every entry > 0."""
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    expected = probs.double() * len(tokens)
    statistic = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((V - 1) / 2, dtype=torch.float64), statistic / 2))


def expect_distribution(tokens: list[int], probs: torch.Tensor, inputs: str) -> None:
    p_value = chi_square_p_value(tokens, probs)
    drawn = (torch.bincount(torch.tensor(tokens), minlength=V).double() / len(tokens)).tolist()
    assert p_value > ALPHA, (
        f"on input {inputs}: not distributed as the target's p (chi-square p-value {p_value:.2g} over "
        f"{len(tokens)} draws)\n  p         {[round(x, 3) for x in probs.tolist()]}\n"
        f"  you drew  {[round(x, 3) for x in drawn]}"
    )


def expect_target_distribution(outputs: list[list[int]], p: torch.Tensor, drafts: list[int], inputs: str) -> None:
    """Token j of the outputs (where there is one) follows p[j] given the drafts before it were accepted."""
    for j in range(len(drafts) + 1):
        at_j = [out[j] for out in outputs if len(out) > j]
        assert len(at_j) >= 300, f"{inputs}: only {len(at_j)} of {len(outputs)} outputs reach position {j}"
        expect_distribution(at_j, p[j], f"{inputs}; output token {j}")


@pytest.mark.exercise("rejection_random_sample")
@pytest.mark.timeout(120)
def test_random_with_ngram_drafts_keeps_the_targets_distribution(impl):
    drafts = [2, 4]
    p = target(1, 2, drafts)
    inputs = f"p (3, {V}) a softmax of random logits, n-gram drafts {drafts} (q one-hot), {NUM_DRAWS} seeds"
    outputs = [random_sample(impl, p, drafts, None, torch.Generator().manual_seed(s), inputs) for s in range(NUM_DRAWS)]
    expect_target_distribution(outputs, p, drafts, inputs)


@pytest.mark.exercise("rejection_random_sample")
@pytest.mark.timeout(120)
def test_random_with_a_draft_models_q_keeps_the_targets_distribution(impl):
    p, q = target(2, 2, [1, 3]), target(3, 1, [1, 3])
    inputs = f"p (3, {V}) and q (2, {V}) softmaxes of random logits, each draft drawn from q, {NUM_DRAWS} seeds"
    draws = torch.Generator().manual_seed(99)
    outputs = []
    for s in range(NUM_DRAWS):
        drafts = torch.multinomial(q, 1, generator=draws).squeeze(1).tolist()  # the draft model's proposals
        outputs.append(random_sample(impl, p, drafts, q, torch.Generator().manual_seed(s), inputs))
    for j in range(3):  # token j given the drafts before it were accepted: p[j] again, whatever the drafts were
        at_j = [out[j] for out in outputs if len(out) > j]
        assert len(at_j) >= 300, f"{inputs}: only {len(at_j)} of {len(outputs)} outputs reach position {j}"
        expect_distribution(at_j, p[j], f"{inputs}; output token {j}")


@pytest.mark.exercise("rejection_random_sample")
def test_random_accepts_drafts_the_target_is_sure_of_and_adds_a_bonus_token(impl):
    p = torch.zeros(4, V)
    p[0, 2], p[1, 5], p[2, 0] = 1.0, 1.0, 1.0  # the target is certain of each draft
    p[3] = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0, 0.0])  # the bonus row
    for seed in range(20):
        inputs = f"p one-hot on each of the drafts [2, 5, 0], bonus row {p[3].tolist()}, seed {seed}"
        out = random_sample(impl, p, [2, 5, 0], None, torch.Generator().manual_seed(seed), inputs)
        assert len(out) == 4 and out[:3] == [2, 5, 0] and out[3] in (1, 3), (
            f"on input {inputs}: expected the 3 drafts then a bonus token 1 or 3 from the bonus row, got {out}"
        )


@pytest.mark.exercise("rejection_random_sample")
def test_random_never_accepts_a_draft_the_target_rules_out(impl):
    p = target(4, 2)
    p[0] = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0, 0.0])  # draft 2 has p = 0
    for seed in range(40):
        inputs = f"p[0] = {p[0].tolist()}, n-gram drafts [2, 1], seed {seed}"
        out = random_sample(impl, p, [2, 1], None, torch.Generator().manual_seed(seed), inputs)
        assert len(out) == 1 and out[0] in (1, 3), (
            f"on input {inputs}: draft 2 has p = 0, so it is rejected and the token is drawn from "
            f"normalise(max(0, p - q)) (1 or 3); got {out}"
        )


@pytest.mark.exercise("rejection_random_sample")
def test_random_draws_k_plus_one_numbers_from_the_sequences_own_generator(impl):
    """Seeded sampling: the same seed gives the same tokens, whatever else draws from the global generator, and
    the generator advances by exactly k + 1 uniforms (so a sequence's later steps do not depend on its verdicts)."""
    p, drafts = target(5, 3), [0, 1, 2]
    with torch.random.fork_rng():
        for seed in range(30):
            inputs = f"p (4, {V}) a softmax of random logits, drafts {drafts}, generator seeded {seed}"
            torch.manual_seed(1000 + seed)
            first = random_sample(impl, p, drafts, None, torch.Generator().manual_seed(seed), inputs)
            torch.manual_seed(2000 + seed)  # the global generator is somewhere else
            generator = torch.Generator().manual_seed(seed)
            second = random_sample(impl, p, drafts, None, generator, inputs)
            expect_equal(second, first, inputs=f"{inputs}: the same seed twice, the global generator moved between")
            expect_equal(generator.get_state().tolist(),
                         _advanced(seed, len(drafts) + 1), inputs=f"{inputs}: the generator's state afterwards")


def _advanced(seed: int, count: int) -> list[int]:
    """The state of a generator seeded `seed` after `count` uniforms on the host."""
    g = torch.Generator().manual_seed(seed)
    torch.rand(count, generator=g)
    return g.get_state().tolist()


@pytest.mark.exercise("rejection_random_sample")
def test_random_without_drafts_samples_as_the_ordinary_sampler(impl):
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(7))
    params = SamplingParams(temperature=1.0, seed=0)
    for seed in range(20):
        inputs = f"no drafts, p = softmax of random logits, generator seeded {seed}"
        want = sample(logits, [params], [torch.Generator().manual_seed(seed)]).sampled_token_ids[0]
        got = random_sample(impl, torch.softmax(logits, dim=-1), [], None, torch.Generator().manual_seed(seed), inputs)
        expect_equal(got, [want], inputs=f"{inputs} (oracle: `sample` with the same seed)")


@pytest.mark.exercise("rejection_random_sample")
def test_random_reads_its_verdicts_and_its_final_token_off_the_uniforms_in_order(impl):
    """Uniform j decides draft j, the last one the final token. Every draft row puts 1/2 on its draft, so draft j is
    accepted exactly when u[j] < 1/2; its residual puts 1/2 on each of tokens 4 and 5, and the bonus row on each of
    tokens 0 and 1, so the final token is the first of its pair exactly when u[k] < 1/2."""
    drafts = [0, 1, 2]
    p = torch.zeros(4, V)
    for j, token in enumerate(drafts):
        p[j, token], p[j, 4], p[j, 5] = 0.5, 0.25, 0.25
    p[3, 0] = p[3, 1] = 0.5
    for seed in range(64):
        u = torch.rand(len(drafts) + 1, generator=torch.Generator().manual_seed(seed)).tolist()
        accepted = next((j for j in range(len(drafts)) if u[j] >= 0.5), len(drafts))
        pair = (4, 5) if accepted < len(drafts) else (0, 1)
        want = drafts[:accepted] + [pair[0] if u[-1] < 0.5 else pair[1]]
        inputs = (f"p rows {[row.tolist() for row in p]}, n-gram drafts {drafts}, generator seeded {seed}, whose "
                  f"uniforms are {[round(x, 3) for x in u]}")
        expect_equal(random_sample(impl, p, drafts, None, torch.Generator().manual_seed(seed), inputs), want,
                     inputs=f"{inputs} (draft j accepted while u[j] < 1/2; the final token from u[{len(drafts)}])")


# --- num_scheduled_spec_tokens ------------------------------------------------------------------------------------


def decoding_seq(num_tokens: int, drafts: list[int], seq_id: int = 0) -> Sequence:
    """A sequence as `schedule()` finds it when it decodes: `num_tokens` tokens (a 6-token prompt, then its outputs),
    all but the newest computed, and the proposer's `drafts`."""
    seq = Sequence(seq_id, list(range(100, 106)))
    for i in range(num_tokens - 6):
        seq.append_token(200 + i)
    seq.num_computed_tokens = num_tokens - 1
    seq.spec_token_ids = list(drafts)
    return seq


def admitted(impl, num_tokens: int, drafts: list[int], budget: int, threshold: int, max_model_len: int) -> tuple:
    """(the learner's count, the inputs it was asked on), called as `Scheduler.schedule` calls it."""
    seq = decoding_seq(num_tokens, drafts)
    inputs = (f"num_scheduled_spec_tokens(seq, token_budget={budget}, long_prefill_token_threshold={threshold}, "
              f"max_model_len={max_model_len}), seq with {num_tokens} tokens ({num_tokens - 1} computed) and "
              f"{len(drafts)} drafts {drafts}")
    with exercising("num_scheduled_spec_tokens", inputs):
        return impl.num_scheduled_spec_tokens(seq, budget, threshold, max_model_len), inputs


def most_drafts(num_tokens: int, num_drafts: int, budget: int, threshold: int, max_model_len: int) -> int:
    """The oracle: try every count from all the drafts down, and take the first whose step fits every limit."""
    for n in range(num_drafts, -1, -1):
        step_tokens = 1 + n  # the newest token, then n drafts
        longest = num_tokens + n + 1  # every draft accepted, then the target's own token
        if step_tokens <= budget and step_tokens <= threshold and longest <= max_model_len:
            return n
    raise AssertionError("the newest token alone always fits a running sequence's step")


@pytest.mark.exercise("num_scheduled_spec_tokens")
def test_admission_takes_every_draft_when_there_is_room(impl):
    got, inputs = admitted(impl, 10, [1, 2, 3, 4], 64, 64, 128)
    expect_equal(got, 4, inputs=f"{inputs}: room for all")
    got, inputs = admitted(impl, 10, [1, 2], 64, 64, 128)
    expect_equal(got, 2, inputs=f"{inputs}: never more than the sequence has")


@pytest.mark.exercise("num_scheduled_spec_tokens")
def test_admission_leaves_the_newest_token_its_place_in_the_budget(impl):
    for budget, want in ((5, 4), (4, 3), (2, 1), (1, 0)):
        got, inputs = admitted(impl, 10, [1, 2, 3, 4], budget, 64, 128)
        expect_equal(got, want, inputs=f"{inputs}: the step computes the newest token and {want} drafts")


@pytest.mark.exercise("num_scheduled_spec_tokens")
def test_admission_keeps_to_the_per_sequence_cap(impl):
    got, inputs = admitted(impl, 10, [1, 2, 3, 4], 64, 3, 128)
    expect_equal(got, 2, inputs=f"{inputs}: at most 3 tokens of one sequence in a step")


@pytest.mark.exercise("num_scheduled_spec_tokens")
def test_admission_leaves_room_for_the_token_verification_adds(impl):
    for max_model_len, want in ((15, 4), (14, 3), (12, 1), (11, 0)):
        got, inputs = admitted(impl, 10, [1, 2, 3, 4], 64, 64, max_model_len)
        expect_equal(got, want, inputs=f"{inputs}: with {want} drafts all accepted and the target's token after "
                     f"them the sequence has {10 + want + 1} tokens")


@pytest.mark.exercise("num_scheduled_spec_tokens")
def test_admission_matches_a_search_over_every_draft_count(impl):
    g = torch.Generator().manual_seed(10)
    for trial in range(300):
        num_tokens = int(torch.randint(7, 40, (1,), generator=g))
        num_drafts = int(torch.randint(0, 7, (1,), generator=g))
        budget, threshold = (int(x) for x in torch.randint(1, 10, (2,), generator=g))
        max_model_len = num_tokens + int(torch.randint(1, 9, (1,), generator=g))
        got, inputs = admitted(impl, num_tokens, list(range(1, num_drafts + 1)), budget, threshold, max_model_len)
        expect_equal(got, most_drafts(num_tokens, num_drafts, budget, threshold, max_model_len),
                     inputs=f"trial {trial}: {inputs} (oracle: every count from {num_drafts} down, each limit checked)")


@pytest.mark.exercise("num_scheduled_spec_tokens")
def test_admission_in_the_scheduler_keeps_each_step_within_its_budget(impl):
    """Two decoding sequences with 4 drafts each, a budget of 7: the first takes 1 + 4 tokens, the second what is
    left, 1 + 1. Your function inside `Scheduler.schedule`, as the engine runs it."""
    manager = KVCacheManager(32, 4, enable_prefix_caching=True)
    scheduler = scheduler_module.Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=7,
                                           long_prefill_token_threshold=7, max_model_len=64)
    for seq_id in (0, 1):
        seq = decoding_seq(10, [1, 2, 3, 4], seq_id)
        seq.num_computed_tokens = 0
        assert manager.allocate_slots(seq, 9) is not None
        seq.num_computed_tokens = 9
        scheduler.add_running(seq)
    inputs = "Scheduler.schedule(), budget 7, two decoding sequences of 10 tokens with drafts [1, 2, 3, 4] each"
    with swap_in(impl, {"num_scheduled_spec_tokens": REFERENCE["num_scheduled_spec_tokens"]}), \
            exercising("num_scheduled_spec_tokens", inputs):
        out = scheduler.schedule()
    expect_equal(out.num_scheduled_tokens, [5, 2], inputs=f"{inputs}; tokens scheduled per sequence")
    expect_equal(out.scheduled_spec_decode_tokens, {0: [1, 2, 3, 4], 1: [1]}, inputs=f"{inputs}; drafts verified")


# --- hand_back_rejected_drafts ------------------------------------------------------------------------------------

BLOCK_SIZE = 4
NUM_BLOCKS = 16
PROMPT = [11, 12, 13, 14, 15]  # positions 0-4: block 0 full (cached at prefill), block 1 begun


def speculative_step(impl, drafts: list[int], num_accepted: int, prefix_caching: bool = True,
                     stop_after: int | None = None, manager: KVCacheManager | None = None):
    """A 5-token prompt computed, its first output token 20 sampled (position 5, `start`); a step verifies `drafts`
    at positions 6.. and returns `num_accepted` of them plus the target's 90; the sequence keeps them all, or the
    first `stop_after` (a stop token among them); then your hand-back runs. Returns (manager, seq, inputs)."""
    manager = manager or KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    seq = Sequence(0, PROMPT)
    assert manager.allocate_slots(seq, len(PROMPT)) is not None
    seq.num_computed_tokens = len(PROMPT)
    seq.append_token(20)
    start = seq.num_computed_tokens  # 5: the newest token, then the drafts
    seq.spec_token_ids = list(drafts)
    assert manager.allocate_slots(seq, 1 + len(drafts)) is not None
    seq.num_computed_tokens = start + 1 + len(drafts)  # what scheduling did
    sampled = drafts[:num_accepted] + [90]  # the accepted drafts, then the target's token
    kept = sampled if stop_after is None else sampled[:stop_after]
    for token in kept:
        seq.append_token(token)
    stop = "" if stop_after is None else f", the sequence kept {kept} (token {kept[-1]} is a stop)"
    inputs = (f"block_size {BLOCK_SIZE}, prompt {PROMPT} + sampled 20 (start = {start}), drafts {drafts} at "
              f"positions {start + 1}..{start + len(drafts)}, {num_accepted} accepted, then 90 (num_sampled = "
              f"{len(sampled)}){stop}; tokens now {seq.token_ids}; prefix caching {'on' if prefix_caching else 'off'}")
    with exercising("hand_back_rejected_drafts", inputs):
        impl.hand_back_rejected_drafts(manager, seq, start, len(sampled))
    return manager, seq, inputs


def cached_blocks(manager: KVCacheManager, seq: Sequence) -> list[bool]:
    """Per block of `seq`'s table: is it registered in the prefix cache under the hash of its own tokens?"""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, seq.token_ids, len(seq.token_ids), BLOCK_SIZE)
    blocks = [manager.block_pool.blocks[b] for b in seq.block_table]
    return [b.block_hash is not None and i < len(hashes) and b.block_hash == hashes[i] for i, b in enumerate(blocks)]


@pytest.mark.exercise("hand_back_rejected_drafts")
def test_hand_back_rolls_back_the_rejected_drafts_once(impl):
    _, seq, inputs = speculative_step(impl, [30, 31, 32, 33], num_accepted=1)
    expect_equal(seq.num_computed_tokens, 7, inputs=f"{inputs}; num_computed_tokens: 5 + the newest + 1 accepted "
                 "(scheduling set 10; the 3 rejected drafts and the last token, 90, have no K/V of their own)")


@pytest.mark.exercise("hand_back_rejected_drafts")
def test_hand_back_keeps_everything_when_every_draft_is_accepted(impl):
    manager, seq, inputs = speculative_step(impl, [30, 31], num_accepted=2)
    expect_equal(seq.num_computed_tokens, 8, inputs=f"{inputs}; num_computed_tokens (nothing rejected)")
    expect_equal(len(seq.block_table), 2,
                 inputs=f"{inputs}; blocks held (the bonus token 90 gets its block next step)")
    expect_equal(cached_blocks(manager, seq), [True, True],
                 inputs=f"{inputs}; blocks registered in the prefix cache (block 1 = positions 4-7, all verified)")


@pytest.mark.exercise("hand_back_rejected_drafts")
def test_hand_back_keeps_the_blocks_only_rejected_drafts_used(impl):
    manager, seq, inputs = speculative_step(impl, [30, 31, 32, 33, 34, 35], num_accepted=0)
    expect_equal(seq.num_computed_tokens, 6, inputs=f"{inputs}; num_computed_tokens")
    expect_equal(len(seq.block_table), 3, inputs=f"{inputs}; blocks held (block 2, positions 8-11, held only "
                 "drafts: it stays with the sequence, whose next drafts write there, as in vLLM)")
    expect_equal(manager.block_pool.num_free_blocks, NUM_BLOCKS - 3, inputs=f"{inputs}; free blocks in the pool")
    expect_equal(cached_blocks(manager, seq), [True, False, False], inputs=f"{inputs}; blocks in the prefix cache")


@pytest.mark.exercise("hand_back_rejected_drafts")
def test_hand_back_keeping_the_draft_blocks_spares_a_cached_block(impl):
    """A pool of 4 blocks. Another request's prompt [1, 2, 3, 4] finished: its block is free but cached, the only
    free block once the sequence holds 3. The next step drafts 5 tokens over the same slots: with the draft block
    kept it needs no block; a block freed now would join the free queue's tail, and the next step would take the
    head, the cached one, evicting it."""
    manager = KVCacheManager(4, BLOCK_SIZE, enable_prefix_caching=True)
    other = Sequence(1, [1, 2, 3, 4])
    assert manager.allocate_slots(other, 4) is not None
    other.num_computed_tokens = 4
    manager.free(other)
    _, seq, inputs = speculative_step(impl, [30, 31, 32, 33, 34, 35], num_accepted=0, manager=manager)
    seq.spec_token_ids = [40, 41, 42, 43, 44]  # the next step's drafts, positions 7-11
    inputs = f"{inputs}; a 4-block pool whose one free block caches the finished prompt [1, 2, 3, 4]"
    expect_equal(manager.allocate_slots(seq, 1 + 5) is not None, True,
                 inputs=f"{inputs}; the next step's newest token and 5 drafts get their slots")
    _, num_cached = manager.get_computed_blocks(Sequence(2, [1, 2, 3, 4, 5]))
    expect_equal(num_cached, 4, inputs=f"{inputs}; tokens a new prompt [1, 2, 3, 4, 5] then finds in the prefix "
                 "cache (a draft block freed by the hand-back sends the next step to the cached block)")


@pytest.mark.exercise("hand_back_rejected_drafts")
def test_hand_back_never_registers_a_block_holding_a_rejected_draft(impl):
    # Block 1 (positions 4-7) is full of the sequence's tokens, but position 7's slot holds the K/V of draft 31,
    # rejected: the token there now is 90, whose K/V is computed next step. A prefix hit on it would be wrong.
    manager, seq, inputs = speculative_step(impl, [30, 31, 32, 33], num_accepted=1)
    expect_equal(cached_blocks(manager, seq), [True, False, False],
                 inputs=f"{inputs}; blocks registered in the prefix cache (block 1 holds a rejected draft's K/V)")
    expect_equal(len(manager.block_pool.cached_block_hash_to_block), 1, inputs=f"{inputs}; hashes in the prefix cache")


@pytest.mark.exercise("hand_back_rejected_drafts")
def test_hand_back_after_a_stop_inside_the_accepted_run(impl):
    # All 4 drafts accepted, but 31 (position 7) is a stop: the sequence kept 30, 31, whose K/V the step computed.
    manager, seq, inputs = speculative_step(impl, [30, 31, 32, 33], num_accepted=4, stop_after=2)
    expect_equal(seq.num_computed_tokens, 8, inputs=f"{inputs}; num_computed_tokens (every kept token was computed "
                 "this step; 32, 33 and 90 are not the sequence's)")
    expect_equal(cached_blocks(manager, seq)[:2], [True, True],
                 inputs=f"{inputs}; blocks 0-1 registered (block 1 = 15, 20, 30, 31, all computed and kept)")
    # The stop is the target's own token this time: its K/V is not computed.
    manager, seq, inputs = speculative_step(impl, [30, 31, 32, 33], num_accepted=2, stop_after=3)
    expect_equal(seq.num_computed_tokens, 8, inputs=f"{inputs}; num_computed_tokens (90 has no K/V yet)")
    expect_equal(cached_blocks(manager, seq)[:3], [True, True, False], inputs=f"{inputs}; blocks registered")


@pytest.mark.exercise("hand_back_rejected_drafts")
def test_hand_back_without_prefix_caching_registers_nothing(impl):
    manager, seq, inputs = speculative_step(impl, [30, 31, 32], num_accepted=2, prefix_caching=False)
    expect_equal(seq.num_computed_tokens, 8, inputs=f"{inputs}; num_computed_tokens")
    expect_equal(len(manager.block_pool.cached_block_hash_to_block), 0, inputs=f"{inputs}; hashes in the prefix cache")
    expect_equal(len(seq.block_table), 3, inputs=f"{inputs}; blocks held (9 tokens)")


# --- the scheduler's two exercises, against the reference on generated workloads with drafts -------------------------

SCHEDULED = ("num_scheduled_spec_tokens", "hand_back_rejected_drafts")


test_each_exercise_the_scheduler_runs_leaves_the_references_state_on_generated_workloads = differential_test(
    REFERENCE, SCHEDULED, lambda _: scheduler_workloads(), drafting_step,
    "; every sampler drafts 1 to 4 tokens after each step, some right, then a wrong one",
)


# --- capstone: your proposer, verifier, admission and hand-back in the engine, on SmolLM2 ---------------------------

CAPSTONE_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
CAPSTONE_BUDGET = 16  # 4 sequences x (1 + 4) tokens do not fit: the budget cuts drafts
CAPSTONE_MAX_MODEL_LEN = 57  # prompts 0 and 6 (37 and 35 tokens) reach it before 24 tokens: it cuts drafts too
CAPSTONE_ENGINE = dict(model="smollm2-135m", block_size=8, max_num_seqs=8, max_model_len=CAPSTONE_MAX_MODEL_LEN,
                       max_num_batched_tokens=CAPSTONE_BUDGET, speculative_config=CAPSTONE_SPEC)
CAPSTONE_IDS = [0, 3, 6]  # prompts whose greedy continuations repeat some of their own text
CAPSTONE_TOKENS = 24
CAPSTONE_SAMPLED = 3  # also sampled: temperature 0.8, seed 5
SAMPLED = SamplingParams(temperature=0.8, seed=5, max_tokens=CAPSTONE_TOKENS, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=CAPSTONE_TOKENS, ignore_eos=True)


def capstone_run() -> tuple[list[list[int]], tuple[int, int], int, int]:
    """The CAPSTONE_IDS prompts greedy, and one sampled, in one batch on a fresh engine: (tokens per request,
    (draft tokens, accepted tokens) over the run, the most tokens one step scheduled, blocks still in use at the
    end)."""
    engine = LLMEngine.from_engine_args(EngineArgs(**CAPSTONE_ENGINE))
    requests = [(CAPSTONE_PROMPTS[i], GREEDY) for i in CAPSTONE_IDS] + [(CAPSTONE_PROMPTS[CAPSTONE_SAMPLED], SAMPLED)]
    outputs = generate_batch(engine, requests)
    manager = engine.engine_core.scheduler.kv_cache_manager
    stats = (engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens)
    largest_step = max(s.num_prefill_tokens + s.num_decode_tokens for s in engine.stats.steps)
    return [o.outputs[0].token_ids for o in outputs], stats, largest_step, manager.num_used_blocks


@functools.cache
def reference_capstone_run() -> tuple[list[list[int]], tuple[int, int], int, int]:
    """`capstone_run` on the reference pieces, once per process (it is deterministic): called before any of your
    code is swapped in."""
    return capstone_run()


@pytest.mark.exercise("capstone")
@pytest.mark.timeout(300)  # a real model, twice: about ten seconds on an idle 2-core machine
def test_capstone_speculation_on_smollm2_gives_hugging_faces_tokens(impl):
    reference_tokens, reference_stats, _, _ = reference_capstone_run()  # nothing is swapped in yet
    inputs = (f"SmolLM2-135M, n-gram speculation {CAPSTONE_SPEC}, block_size 8, a step budget of {CAPSTONE_BUDGET} "
              f"tokens, max_model_len {CAPSTONE_MAX_MODEL_LEN}; CAPSTONE_PROMPTS{CAPSTONE_IDS} greedy and prompt "
              f"{CAPSTONE_SAMPLED} sampled (temperature 0.8, seed 5), up to {CAPSTONE_TOKENS} tokens each, one batch")
    with swap_in(impl, REFERENCE):  # your proposer, verifier and admission, your hand-back in the scheduler
        tokens, stats, largest_step, used = capstone_run()
    for b, i in enumerate(CAPSTONE_IDS):
        num_tokens = min(CAPSTONE_TOKENS, CAPSTONE_MAX_MODEL_LEN - len(CAPSTONE_PROMPTS[i]))
        expect_equal(tokens[b], smollm2_greedy(i, num_tokens),
                     inputs=f"{inputs}; greedy tokens of prompt {i} (oracle: Hugging Face greedy, no speculation)")
    expect_equal(tokens[-1], reference_tokens[-1],
                 inputs=f"{inputs}; the sampled request's tokens (oracle: the reference engine, same batch and seed)")
    assert largest_step <= CAPSTONE_BUDGET, f"{inputs}: a step scheduled {largest_step} tokens"
    expect_equal(stats, reference_stats,
                 inputs=f"{inputs}; (draft tokens, accepted tokens) over the run (oracle: the reference engine)")
    assert stats[1] > 0, f"{inputs}: no draft was accepted; n-gram drafts should pay on these prompts"
    expect_equal(used, 0, inputs=f"{inputs}; blocks in use after every request finished")

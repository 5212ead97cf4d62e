"""Grading tests for chapter 10 — speculative decoding.

Each test grades one exercise (`@pytest.mark.exercise`). The oracles owe nothing to the code under test: proposals
worked out by hand and a brute-force search over every suffix length and every earlier position for the n-gram
proposer; verdicts worked out by hand for the greedy verifier; for the random verifier, the one property that
matters — every output token is distributed as the target's p — checked by chi-square tests over seeded draws,
and the generator's own state for how many numbers it drew; block tables, free blocks and prefix-cache hashes
counted by hand for the hand-back. The capstone holds SmolLM2's greedy tokens to Hugging Face's, and a seeded
sampled request and the drafts' counts to the reference engine run on the same batch.
"""

import functools

import pytest
import torch

from grading import exercising, expect_equal
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
    "rejection_greedy_sample": rejection_sampler.rejection_greedy_sample,
    "rejection_random_sample": rejection_sampler.rejection_random_sample,
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


# --- rejection_greedy_sample --------------------------------------------------------------------------------------


def greedy(impl, argmax: list[int], drafts: list[int]) -> list[int]:
    inputs = f"rejection_greedy_sample(target_argmax={argmax}, draft_token_ids={drafts})"
    with exercising("rejection_greedy_sample", inputs):
        return impl.rejection_greedy_sample(argmax, drafts)


@pytest.mark.exercise("rejection_greedy_sample")
def test_greedy_accepts_every_matching_draft_and_adds_the_bonus_token(impl):
    expect_equal(greedy(impl, [3, 1, 4, 6], [3, 1, 4]), [3, 1, 4, 6],
                 inputs="target argmax [3, 1, 4, 6], drafts [3, 1, 4]: all accepted, then the bonus row's 6")


@pytest.mark.exercise("rejection_greedy_sample")
def test_greedy_replaces_the_first_mismatch_with_the_targets_token(impl):
    expect_equal(greedy(impl, [3, 1, 4, 6], [3, 5, 4]), [3, 1],
                 inputs="target argmax [3, 1, 4, 6], drafts [3, 5, 4]: 5 is rejected, and the 4 after it dropped")
    expect_equal(greedy(impl, [3, 1, 4, 6], [2, 1, 4]), [3],
                 inputs="target argmax [3, 1, 4, 6], drafts [2, 1, 4]: the first draft is rejected")
    expect_equal(greedy(impl, [3, 1, 4, 6], [3, 1, 0]), [3, 1, 4],
                 inputs="target argmax [3, 1, 4, 6], drafts [3, 1, 0]: the last draft is rejected")


@pytest.mark.exercise("rejection_greedy_sample")
def test_greedy_without_drafts_is_the_argmax(impl):
    expect_equal(greedy(impl, [7], []), [7], inputs="no drafts: one row, its argmax")


@pytest.mark.exercise("rejection_greedy_sample")
def test_greedy_every_output_is_what_decoding_one_token_at_a_time_gives(impl):
    """Drafts copied from a 'true' continuation with some positions corrupted: the output is always a prefix of
    the true continuation, one token longer than the accepted run."""
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        k = int(torch.randint(0, 6, (1,), generator=g))
        truth = torch.randint(0, 9, (k + 1,), generator=g).tolist()
        drafts = [t if torch.rand(1, generator=g) < 0.7 else (t + 1) % 9 for t in truth[:k]]
        accepted = next((j for j in range(k) if drafts[j] != truth[j]), k)
        expect_equal(greedy(impl, truth, drafts), truth[: accepted + 1],
                     inputs=f"trial {trial}: target argmax {truth}, drafts {drafts}")


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


# --- hand_back_rejected_drafts ------------------------------------------------------------------------------------

BLOCK_SIZE = 4
NUM_BLOCKS = 16
PROMPT = [11, 12, 13, 14, 15]  # positions 0-4: block 0 full (cached at prefill), block 1 begun


def speculative_step(impl, drafts: list[int], num_accepted: int, prefix_caching: bool = True):
    """A 5-token prompt computed, its first output token 20 sampled (position 5, `start`); a step verifies `drafts`
    at positions 6.. and keeps `num_accepted` of them plus one more token; then your hand-back runs.
    Returns (manager, seq, inputs)."""
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    seq = Sequence(0, PROMPT)
    assert manager.allocate_slots(seq, len(PROMPT)) is not None
    seq.num_computed_tokens = len(PROMPT)
    seq.append_token(20)
    start = seq.num_computed_tokens  # 5: the newest token, then the drafts
    seq.spec_token_ids = list(drafts)
    assert manager.allocate_slots(seq, 1 + len(drafts)) is not None
    seq.num_computed_tokens = start + 1 + len(drafts)  # what scheduling did
    sampled = drafts[:num_accepted] + [90]  # the accepted drafts, then the target's token
    for token in sampled:
        seq.append_token(token)
    inputs = (f"block_size {BLOCK_SIZE}, prompt {PROMPT} + sampled 20 (start = {start}), drafts {drafts} at "
              f"positions {start + 1}..{start + len(drafts)}, {num_accepted} accepted, then 90; tokens now "
              f"{seq.token_ids}; prefix caching {'on' if prefix_caching else 'off'}")
    with exercising("hand_back_rejected_drafts", inputs):
        impl.hand_back_rejected_drafts(manager, seq, start, len(drafts), len(sampled))
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
def test_hand_back_frees_the_blocks_only_rejected_drafts_used(impl):
    manager, seq, inputs = speculative_step(impl, [30, 31, 32, 33, 34, 35], num_accepted=0)
    expect_equal(seq.num_computed_tokens, 6, inputs=f"{inputs}; num_computed_tokens")
    expect_equal(len(seq.block_table), 2, inputs=f"{inputs}; blocks held (7 tokens need 2; block 2 held only drafts)")
    expect_equal(manager.block_pool.num_free_blocks, NUM_BLOCKS - 2, inputs=f"{inputs}; free blocks in the pool")


@pytest.mark.exercise("hand_back_rejected_drafts")
def test_hand_back_never_registers_a_block_holding_a_rejected_draft(impl):
    # Block 1 (positions 4-7) is full of the sequence's tokens, but position 7's slot holds the K/V of draft 31,
    # rejected: the token there now is 90, whose K/V is computed next step. A prefix hit on it would be wrong.
    manager, seq, inputs = speculative_step(impl, [30, 31, 32, 33], num_accepted=1)
    expect_equal(cached_blocks(manager, seq), [True, False],
                 inputs=f"{inputs}; blocks registered in the prefix cache (block 1 holds a rejected draft's K/V)")
    expect_equal(len(seq.block_table), 2, inputs=f"{inputs}; blocks held (8 tokens)")
    expect_equal(manager.block_pool.num_free_blocks, NUM_BLOCKS - 2, inputs=f"{inputs}; free blocks in the pool")
    expect_equal(len(manager.block_pool.cached_block_hash_to_block), 1, inputs=f"{inputs}; hashes in the prefix cache")


@pytest.mark.exercise("hand_back_rejected_drafts")
def test_hand_back_without_prefix_caching_registers_nothing(impl):
    manager, seq, inputs = speculative_step(impl, [30, 31, 32], num_accepted=2, prefix_caching=False)
    expect_equal(seq.num_computed_tokens, 8, inputs=f"{inputs}; num_computed_tokens")
    expect_equal(len(manager.block_pool.cached_block_hash_to_block), 0, inputs=f"{inputs}; hashes in the prefix cache")
    expect_equal(len(seq.block_table), 3, inputs=f"{inputs}; blocks held (9 tokens)")


# --- capstone: your proposer, verifiers and hand-back in the engine, on SmolLM2 ---------------------------------------

CAPSTONE_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
CAPSTONE_ENGINE = dict(model="smollm2-135m", block_size=8, max_num_seqs=8, max_model_len=256,
                       speculative_config=CAPSTONE_SPEC)
CAPSTONE_IDS = [0, 3, 6]  # prompts whose greedy continuations repeat some of their own text
CAPSTONE_TOKENS = 24
CAPSTONE_SAMPLED = 3  # also sampled: temperature 0.8, seed 5
SAMPLED = SamplingParams(temperature=0.8, seed=5, max_tokens=CAPSTONE_TOKENS, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=CAPSTONE_TOKENS, ignore_eos=True)


def capstone_run() -> tuple[list[list[int]], tuple[int, int], int]:
    """The CAPSTONE_IDS prompts greedy, and one sampled, in one batch on a fresh engine: (tokens per request,
    (draft tokens, accepted tokens) over the run, blocks still in use at the end)."""
    engine = LLMEngine.from_engine_args(EngineArgs(**CAPSTONE_ENGINE))
    requests = [(CAPSTONE_PROMPTS[i], GREEDY) for i in CAPSTONE_IDS] + [(CAPSTONE_PROMPTS[CAPSTONE_SAMPLED], SAMPLED)]
    outputs = generate_batch(engine, requests)
    manager = engine.engine_core.engine_core.scheduler.kv_cache_manager
    stats = (engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens)
    return [o.outputs[0].token_ids for o in outputs], stats, manager.num_used_blocks


@functools.cache
def reference_capstone_run() -> tuple[list[list[int]], tuple[int, int], int]:
    """`capstone_run` on the reference pieces, once per process (it is deterministic): called before any of your
    code is swapped in."""
    return capstone_run()


@pytest.mark.exercise("capstone")
@pytest.mark.timeout(300)  # a real model, twice: a few seconds on an idle 2-core machine
def test_capstone_speculation_on_smollm2_gives_hugging_faces_tokens(impl):
    reference_tokens, reference_stats, _ = reference_capstone_run()  # nothing is swapped in yet
    inputs = (f"SmolLM2-135M, n-gram speculation {CAPSTONE_SPEC}, block_size 8; CAPSTONE_PROMPTS{CAPSTONE_IDS} "
              f"greedy and prompt {CAPSTONE_SAMPLED} sampled (temperature 0.8, seed 5), "
              f"{CAPSTONE_TOKENS} tokens each, one batch")
    with swap_in(impl, REFERENCE):  # your proposer in the runner, your verifiers, your hand-back in the scheduler
        tokens, stats, used = capstone_run()
    for b, i in enumerate(CAPSTONE_IDS):
        expect_equal(tokens[b], smollm2_greedy(i, CAPSTONE_TOKENS),
                     inputs=f"{inputs}; greedy tokens of prompt {i} (oracle: Hugging Face greedy, no speculation)")
    expect_equal(tokens[-1], reference_tokens[-1],
                 inputs=f"{inputs}; the sampled request's tokens (oracle: the reference engine, same batch and seed)")
    expect_equal(stats, reference_stats,
                 inputs=f"{inputs}; (draft tokens, accepted tokens) over the run (oracle: the reference engine)")
    assert stats[1] > 0, f"{inputs}: no draft was accepted; n-gram drafts should pay on these prompts"
    expect_equal(used, 0, inputs=f"{inputs}; blocks in use after every request finished")

"""Penalties and the other logit processors of `SamplingParams`, with vLLM's semantics: the repetition penalty
against Hugging Face's `RepetitionPenaltyLogitsProcessor` (on the logits and in greedy generation), presence and
frequency penalties against OpenAI's formula, min_tokens, logit_bias, allowed_token_ids, neutral values, batch
invariance of seeded sampling, and validation; and the sampler's filters, run only on the rows that use them."""

import re
from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from grading.tiny_models import hf_model, tiny_checkpoint
from solutions import LLM, SamplingParams
from solutions.model.loader import resolve_model
from solutions.sample.ops.penalties import apply_penalties
from solutions.sample.sampler import apply_min_p, apply_top_k, apply_top_k_top_p_min_p, apply_top_p, sample

V = 64  # vocabulary of the logits-level tests


def padded(rows: list[list[int]], vocab_size: int = V) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([row + [vocab_size] * (width - len(row)) for row in rows], dtype=torch.long)


def random_case(seed: int, batch: int = 4) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    """Logits (B, V) of both signs, and per row a prompt and an output with repeated tokens."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, V, generator=g) * 3
    prompt_lens, output_lens = torch.randint(1, 20, (batch,), generator=g), torch.randint(0, 30, (batch,), generator=g)
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in prompt_lens]
    outputs = [torch.randint(0, V // 4, (int(n),), generator=g).tolist() for n in output_lens]  # with repeats
    return logits, prompts, outputs


def penalties(batch: int, presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0) -> list:
    return [torch.full((batch,), value) for value in (presence, frequency, repetition)]


# --- the op against its references -----------------------------------------------------------------------------


@pytest.mark.parametrize("repetition", [1.3, 0.7, 2.0])
def test_repetition_penalty_equals_hugging_face_processor(repetition):
    logits, prompts, outputs = random_case(seed=int(repetition * 10))
    ours = apply_penalties(logits, padded(prompts), padded(outputs), *penalties(len(prompts), repetition=repetition))
    processor = RepetitionPenaltyLogitsProcessor(penalty=repetition)
    for b, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        theirs = processor(torch.tensor([prompt + output]), logits[b : b + 1].clone())[0]
        torch.testing.assert_close(ours[b], theirs, rtol=1e-6, atol=0)


def test_repetition_penalty_makes_a_seen_negative_logit_less_likely():
    """The classic mistake divides every logit by the penalty: a negative logit divided by 1.5 *rises*."""
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    ours = apply_penalties(logits, padded([[0, 1]], 4), padded([[]], 4), *penalties(1, repetition=1.5))
    torch.testing.assert_close(ours, torch.tensor([[2.0 / 1.5, -2.0 * 1.5, 1.0, -1.0]]))


def test_presence_and_frequency_follow_openai_formula_over_output_tokens_only():
    logits, prompts, outputs = random_case(seed=3)
    presence = torch.tensor([0.5, -1.0, 2.0, 0.0])
    frequency = torch.tensor([0.3, 1.5, -2.0, 0.7])
    ours = apply_penalties(logits, padded(prompts), padded(outputs), presence, frequency, torch.ones(4))
    want = logits.clone()
    for b, output in enumerate(outputs):  # logit - count * frequency - (count > 0) * presence
        for token_id, count in Counter(output).items():
            want[b, token_id] -= count * frequency[b] + presence[b]
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-6)


def test_neutral_penalties_change_no_bit():
    logits, prompts, outputs = random_case(seed=5)
    ours = apply_penalties(logits, padded(prompts), padded(outputs), *penalties(len(prompts)))
    assert torch.equal(ours, logits)


def test_each_row_gets_its_own_penalty_and_greedy_rows_are_penalised():
    """One batched call: row 0 repeats its only seen token no more, row 1 (neutral) is untouched."""
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0), SamplingParams(temperature=0.0)]
    out = sample(logits, params, [torch.Generator(), torch.Generator()], [[0], [0]], [1, 1])
    assert out.sampled_token_ids == [1, 0]


# --- end to end: greedy generation against Hugging Face ---------------------------------------------------------


def hf_generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, repetition_penalty: float) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
            repetition_penalty=repetition_penalty,
        )
    return out[0, len(prompt) :].tolist()


def assert_penalised_greedy_close(ours: list[int], theirs: list[int], prompt: list[int], model, penalty: float):
    """Equal tokens, or a first divergence that is a near-tie of Hugging Face's penalised logits (both top-2)."""
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            ids = torch.tensor([prompt + theirs[:i]])
            with torch.inference_mode():
                logits = RepetitionPenaltyLogitsProcessor(penalty)(ids, model(ids).logits[:, -1])[0]
            top2 = logits.topk(2).indices.tolist()
            assert a in top2 and b in top2, f"token {i}: ours {a}, Hugging Face {b}, its penalised top-2 {top2}"
            return


@pytest.mark.parametrize("engine_args", [dict(block_size=16), dict(block_size=4, max_num_batched_tokens=12)])
def test_tiny_greedy_with_repetition_penalty_matches_hugging_face_generate(engine_args):
    """A penalised request beside an unpenalised one: each matches its own Hugging Face generation."""
    folder = tiny_checkpoint("llama-gqa")
    model, llm = hf_model(folder), LLM(model=str(folder), **engine_args)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 23, 4)]
    for penalty in (1.5, 0.8):
        params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=r)
                  for r in (penalty, 1.0, penalty)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, p, output in zip(prompts, params, outputs, strict=True):
            theirs = hf_generate(model, prompt, 40, p.repetition_penalty)
            assert_penalised_greedy_close(output.outputs[0].token_ids, theirs, prompt, model, p.repetition_penalty)
        assert outputs[0].outputs[0].token_ids != llm.generate(
            [prompts[0]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False
        )[0].outputs[0].token_ids, "the penalty changes the greedy stream"


@pytest.fixture(scope="module")
def smollm2():
    return LLM(model="smollm2-135m", max_num_seqs=4, max_model_len=512)


def test_smollm2_greedy_with_repetition_penalty_matches_hugging_face_generate(smollm2):
    model = hf_model(resolve_model("smollm2-135m"))
    texts = ["The list of prime numbers: 2, 3, 5,", "I like cats. I like cats. I like"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, repetition_penalty=1.3)
    for output in smollm2.generate(texts, params, use_tqdm=False):
        prompt = output.prompt_token_ids
        theirs = hf_generate(model, prompt, 32, 1.3)
        assert_penalised_greedy_close(output.outputs[0].token_ids, theirs, prompt, model, 1.3)


# --- min_tokens, logit_bias, allowed_token_ids ------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_strings_until_reached(smollm2):
    prompt = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    eos = smollm2.tokenizer.eos_token_id
    (short,) = smollm2.generate(prompt, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    assert short.outputs[0].token_ids[-1] == eos and len(short.outputs[0].token_ids) < 30
    params = SamplingParams(temperature=0.0, max_tokens=64, min_tokens=30, stop=["Paris"])
    (long,) = smollm2.generate(prompt, params, use_tqdm=False)
    tokens = long.outputs[0].token_ids
    assert len(tokens) >= 30 and eos not in tokens[:30]
    assert "Paris" in long.outputs[0].text, "a stop string within the first min_tokens tokens does not stop"


def test_min_tokens_masks_stop_token_ids():
    llm = LLM(model=str(tiny_checkpoint("llama-gqa")))
    free = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    stop = free[0].outputs[0].token_ids[1]
    stopped = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop])
    assert llm.generate([[5, 6, 7]], stopped, use_tqdm=False)[0].outputs[0].token_ids[-1] == stop
    held = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop], min_tokens=6)
    tokens = llm.generate([[5, 6, 7]], held, use_tqdm=False)[0].outputs[0].token_ids
    assert len(tokens) >= 6 and stop not in tokens[:6]


def test_logit_bias_and_allowed_token_ids():
    llm = LLM(model=str(tiny_checkpoint("llama-gqa")))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    (free,) = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)
    first = free.outputs[0].token_ids[0]
    forced = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={17: 100.0}, logprobs=1)
    (out,) = llm.generate([[5, 6, 7]], forced, use_tqdm=False)
    assert out.outputs[0].token_ids == [17] * 6
    assert out.outputs[0].logprobs[0][17].logprob < 0 and out.outputs[0].logprobs[0][17].rank > 1, "raw logprobs"
    banned = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={first: -100.0})
    assert llm.generate([[5, 6, 7]], banned, use_tqdm=False)[0].outputs[0].token_ids[0] != first
    allowed = SamplingParams(temperature=1.0, seed=0, max_tokens=20, ignore_eos=True, allowed_token_ids=[3, 9, 200])
    assert set(llm.generate([[5, 6, 7]], allowed, use_tqdm=False)[0].outputs[0].token_ids) <= {3, 9, 200}
    for field in ("logit_bias", "allowed_token_ids"):
        value = {300: 1.0} if field == "logit_bias" else [1, 300]
        with pytest.raises(ValueError, match=re.escape(f"SamplingParams.{field} must be token ids in [0, 256)")):
            llm.generate([[5, 6, 7]], SamplingParams(**{field: value}), use_tqdm=False)


def test_bad_words_never_complete(smollm2):
    """vLLM's rule: a word's last token is banned wherever the output ends with the tokens before it (the word as
    written and after a space)."""
    prompt = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    free = SamplingParams(temperature=0.0, max_tokens=24)
    assert "Paris" in smollm2.generate(prompt, free, use_tqdm=False)[0].outputs[0].text
    params = SamplingParams(temperature=0.0, max_tokens=24, bad_words=["Paris", "capital city"])
    (out,) = smollm2.generate(prompt, params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    params.update_from_tokenizer(smollm2.tokenizer)  # what the engine's processor did to its copy
    words = params._bad_words_token_ids
    assert len(words) == 4 and any(len(word) > 1 for word in words)
    for word in words:
        assert not any(tokens[i : i + len(word)] == word for i in range(len(tokens))), (word, out.outputs[0].text)
    assert "Paris" not in out.outputs[0].text


def test_neutral_values_change_nothing_end_to_end():
    llm = LLM(model=str(tiny_checkpoint("llama-gqa")))
    plain = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    neutral = SamplingParams(
        temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, repetition_penalty=1.0, presence_penalty=0.0,
        frequency_penalty=0.0, min_tokens=0, logit_bias={}, bad_words=[],
    )
    assert (llm.generate([[1, 2, 3]], plain, use_tqdm=False)[0].outputs[0].token_ids
            == llm.generate([[1, 2, 3]], neutral, use_tqdm=False)[0].outputs[0].token_ids)


def test_seeded_sampling_with_penalties_is_batch_invariant():
    """A seeded, penalised request draws the same tokens alone and among others with other penalties."""
    llm = LLM(model=str(tiny_checkpoint("llama-gqa")), block_size=4, max_num_batched_tokens=24)
    mine = SamplingParams(
        temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, repetition_penalty=1.2, presence_penalty=0.5,
        frequency_penalty=0.4, logit_bias={7: 2.0},
    )
    alone = llm.generate([[8, 9, 10, 11]], mine, use_tqdm=False)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=0.9),
        SamplingParams(temperature=0.7, max_tokens=10, ignore_eos=True, frequency_penalty=-1.0, min_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    ]
    prompts = [list(range(30, 50)), [8, 9, 10, 11], [1, 2], list(range(60, 90))]
    batch = llm.generate(prompts, [others[0], mine, others[1], others[2]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


# --- validation -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("repetition_penalty", 0.0, "a finite number > 0 (1 disables it)"),
        ("repetition_penalty", float("inf"), "a finite number > 0 (1 disables it)"),
        ("presence_penalty", 2.5, "in [-2, 2] (0 disables it)"),
        ("frequency_penalty", -3, "in [-2, 2] (0 disables it)"),
        ("min_tokens", -1, "an int in [0, max_tokens=16]"),
        ("min_tokens", 17, "an int in [0, max_tokens=16]"),
        ("logit_bias", {"5": 1.0}, "None or a dict of token id (an int >= 0) -> a finite number"),
        ("allowed_token_ids", [], "None or a non-empty list of token ids (ints >= 0)"),
        ("bad_words", ["spam", " "], "None or a list of non-blank strings"),
        ("prompt_logprobs", -1, "None or an int >= 0"),
    ],
)
def test_invalid_penalty_params_name_the_field_and_the_allowed_values(field, value, allowed):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    assert str(error.value) == f"SamplingParams.{field} must be {allowed}, got {value!r}"
    assert error.value.parameter == field


# --- top-k, top-p and min-p only on the rows that use them --------------------------------------------------------


def test_filters_on_a_mix_of_rows_equal_each_filter_on_all_rows_where_it_filters():
    """Rows with every combination of top-k, top-p and min-p, neutral or not, in one batch: each filter changes
    exactly the rows whose value filters, bit for bit as it does when applied to the whole batch."""
    g = torch.Generator().manual_seed(32)
    vocab_size, batch = 1000, 16
    logits = torch.randn(batch, vocab_size, generator=g) * 3
    row = torch.arange(batch)
    top_k = torch.where(row % 2 == 0, torch.tensor(vocab_size), 1 + row * 37)  # (B,) V keeps all
    top_p = torch.where(row % 4 < 2, torch.tensor(1.0), 0.5 + row / 40)  # (B,) 1 keeps all
    min_p = torch.where(row % 8 < 4, torch.tensor(0.0), 0.05 * (row % 3 + 1))  # (B,) 0 keeps all
    expected = logits
    for apply, values, filters in [
        (apply_top_k, top_k, top_k < vocab_size), (apply_top_p, top_p, top_p < 1), (apply_min_p, min_p, min_p > 0)
    ]:
        expected = torch.where(filters[:, None], apply(expected, values), expected)  # the filter on all rows
    got = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    assert torch.equal(got, expected)
    neutral = (top_k == vocab_size) & (top_p == 1) & (min_p == 0)  # (B,) rows 0 and 8
    assert torch.equal(torch.isinf(got).any(dim=1), ~neutral), "the neutral rows keep all, every other row drops some"


def test_neutral_filters_keep_every_token_of_a_large_vocabulary():
    """top_k = V, top_p = 1 and min_p = 0 leave the logits as they are, and so does top-p at 1 applied on its own,
    although a float cumulative sum of 49,152 probabilities rounds up to 1 before its tail."""
    g = torch.Generator().manual_seed(3)
    vocab_size, batch = 49152, 4
    logits = torch.randn(batch, vocab_size, generator=g) * 3
    neutral = torch.full((batch,), vocab_size), torch.ones(batch), torch.zeros(batch)
    assert torch.equal(apply_top_k_top_p_min_p(logits, *neutral), logits)
    probs = torch.softmax(logits.sort(dim=-1, descending=True).values, dim=-1)
    assert (probs.cumsum(dim=-1) - probs >= 1).any(), "the rounding a top-p of 1 must not act on"
    assert torch.equal(apply_top_p(logits, torch.ones(batch)), logits)

"""Grading tests for chapter 02 — the contiguous KV cache.

The oracle is chapter 1's dense forward (`solutions.baselines.naive.forward`), which recomputes everything: prefill
must reproduce its last row, each decode step its last row over the longer sequence, and generation its
tokens (and Hugging Face's). `prefill` and `decode_step` are graded with the reference `ContiguousKVCache`,
so a bug in your cache is reported against the cache alone; `generate_with_cache` uses all of your code.
"""

import functools
from typing import Any

import pytest
import torch

from grading import expect_close, expect_equal
from grading.capstone import CAPSTONE_PROMPTS, smollm2, smollm2_greedy, swap_in
from grading.impl import describe
from grading.tiny_models import hf_model, tiny_checkpoint, tiny_model
from solutions.baselines import contiguous_cache, naive
from solutions.baselines.contiguous_cache import ContiguousKVCache
from solutions.model.llama import LlamaForCausalLM

REFERENCE = {
    "ContiguousKVCache": contiguous_cache.ContiguousKVCache,
    "prefill": contiguous_cache.prefill,
    "decode_step": contiguous_cache.decode_step,
    "generate_with_cache": contiguous_cache.generate_with_cache,
}

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 17, 42, 99, 3, 250, 64]


@functools.cache
def model_named(name: str) -> LlamaForCausalLM:
    return tiny_model(name)  # loaded once per test run: the model holds no per-request state


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def expect_value_error(run: Any, inputs: str) -> None:
    """`run()` must fail with a ValueError: a reservation too small is the caller's mistake, never clamped."""
    try:
        result = run()
    except ValueError:
        return
    raise AssertionError(f"on input {inputs}: expected a ValueError, but it returned {describe(result)}")


def written_cache(cache_class: type, num_layers: int = 2, max_len: int = 16) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A cache (2 kv heads, head dim 4) whose layer 1 got 5 prompt tokens, then 1 decode token at position 5."""
    cache = cache_class(num_layers, max_len, 2, 4)
    k, v = randn(6, 2, 4, seed=1), randn(6, 2, 4, seed=2)
    cache.write(1, torch.arange(5), k[:5], v[:5])
    cache.write(1, torch.tensor([5]), k[5:], v[5:])
    return cache, k, v


# --- ContiguousKVCache ------------------------------------------------------------------------------------


@pytest.mark.exercise("ContiguousKVCache")
def test_cache_read_returns_what_was_written(impl):
    cache = impl.ContiguousKVCache(2, 16, 2, 4)
    k, v = randn(5, 2, 4, seed=3), randn(5, 2, 4, seed=4)
    cache.write(0, torch.arange(5), k, v)
    keys, values = cache.read(0, 5)
    inputs = "cache(layers=2, max_len=16, Hkv=2, D=4); write layer 0 positions 0-4; read(0, 5)"
    expect_close(keys, k, inputs=inputs + ": keys")
    expect_close(values, v, inputs=inputs + ": values")


@pytest.mark.exercise("ContiguousKVCache")
def test_cache_write_puts_a_decode_token_at_its_position(impl):
    cache, k, v = written_cache(impl.ContiguousKVCache)
    keys, values = cache.read(1, 6)
    inputs = "write layer 1 positions 0-4, then position 5 alone; read(1, 6)"
    expect_close(keys, k, inputs=inputs + ": keys")
    expect_close(values, v, inputs=inputs + ": values")


@pytest.mark.exercise("ContiguousKVCache")
def test_cache_read_stops_at_length_not_at_max_len(impl):
    cache, k, _ = written_cache(impl.ContiguousKVCache, max_len=16)
    keys, values = cache.read(1, 3)
    inputs = "max_len=16 reserved, 6 positions written; read(1, 3) must hold only positions 0-2"
    expect_close(keys, k[:3], inputs=inputs + ": keys")
    expect_equal(tuple(values.shape), (3, 2, 4), inputs=inputs + ": values shape")


@pytest.mark.exercise("ContiguousKVCache")
def test_cache_layers_are_independent(impl):
    cache, k, _ = written_cache(impl.ContiguousKVCache, num_layers=3)
    other = randn(6, 2, 4, seed=5)
    cache.write(2, torch.arange(6), other, other)
    inputs = "3 layers; layer 1 and layer 2 written with different keys at positions 0-5"
    expect_close(cache.read(1, 6)[0], k, inputs=inputs + ": read(1, 6) keys")
    expect_close(cache.read(2, 6)[0], other, inputs=inputs + ": read(2, 6) keys")


@pytest.mark.exercise("ContiguousKVCache")
def test_cache_write_past_max_len_raises_value_error(impl):
    cache = impl.ContiguousKVCache(1, 4, 2, 4)
    k = randn(1, 2, 4, seed=6)
    write_past_the_end = functools.partial(cache.write, 0, torch.tensor([4]), k, k)
    expect_value_error(write_past_the_end, inputs="cache(max_len=4), write at position 4")


@pytest.mark.exercise("ContiguousKVCache")
def test_cache_write_that_runs_past_max_len_raises_value_error(impl):
    cache = impl.ContiguousKVCache(1, 4, 2, 4)
    k = randn(3, 2, 4, seed=7)
    write_across_the_end = functools.partial(cache.write, 0, torch.arange(2, 5), k, k)
    expect_value_error(write_across_the_end, inputs="cache(max_len=4), one write of positions 2, 3, 4")


# --- prefill ----------------------------------------------------------------------------------------------


@pytest.mark.exercise("prefill")
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias-mqa"])
def test_prefill_logits_match_dense_forward(impl, name):
    model = model_named(name)
    want = naive.forward(model, torch.tensor(PROMPT))[-1]  # (V,): the prediction after the last prompt token
    got = impl.prefill(model, ContiguousKVCache.for_model(model, 16), PROMPT)
    expect_close(got, want, inputs=f"tiny {name}, prompt {PROMPT} (7 tokens), max_len 16", atol=1e-4)


@pytest.mark.exercise("prefill")
def test_prefill_fills_the_cache_for_every_prompt_position(impl):
    model = model_named("llama-gqa")
    want, got = ContiguousKVCache.for_model(model, 16), ContiguousKVCache.for_model(model, 16)
    contiguous_cache.prefill(model, want, PROMPT)
    impl.prefill(model, got, PROMPT)
    for layer_idx in range(model.config.num_hidden_layers):
        inputs = f"tiny llama-gqa, prompt {PROMPT}, max_len 16: the cache's layer {layer_idx} after prefill"
        expect_close(got.keys[layer_idx], want.keys[layer_idx], inputs=inputs + ", keys (slots 7-15 stay empty)")
        expect_close(got.values[layer_idx], want.values[layer_idx], inputs=inputs + ", values")


# --- decode_step ------------------------------------------------------------------------------------------


@pytest.mark.exercise("decode_step")
@pytest.mark.parametrize("name", ["llama-gqa", "mistral-linear-rope"])
def test_decode_steps_match_dense_forward_over_the_longer_sequence(impl, name):
    model = model_named(name)
    cache = ContiguousKVCache.for_model(model, 16)
    contiguous_cache.prefill(model, cache, PROMPT)
    sequence = list(PROMPT)
    for token_id in (11, 200, 7):  # fed at positions 7, 8, 9
        position = len(sequence)
        sequence.append(token_id)
        want = naive.forward(model, torch.tensor(sequence))[-1]  # (V,)
        got = impl.decode_step(model, cache, token_id, position)
        inputs = f"tiny {name}, prompt {PROMPT} prefilled, then token {token_id} at position {position}"
        expect_close(got, want, inputs=inputs, atol=1e-4)


@pytest.mark.exercise("decode_step")
def test_decode_step_appends_its_token_to_the_cache(impl):
    model = model_named("llama-gqa")
    want, got = ContiguousKVCache.for_model(model, 16), ContiguousKVCache.for_model(model, 16)
    for cache in (want, got):
        contiguous_cache.prefill(model, cache, PROMPT)
    contiguous_cache.decode_step(model, want, 11, len(PROMPT))
    impl.decode_step(model, got, 11, len(PROMPT))
    for layer_idx in range(model.config.num_hidden_layers):
        inputs = f"tiny llama-gqa, prompt {PROMPT} prefilled, token 11 at position 7: cache layer {layer_idx}"
        expect_close(got.keys[layer_idx], want.keys[layer_idx], inputs=inputs + ", keys (slot 7 new, 0-6 unchanged)")
        expect_close(got.values[layer_idx], want.values[layer_idx], inputs=inputs + ", values")


# --- generate_with_cache ----------------------------------------------------------------------------------


@pytest.mark.exercise("generate_with_cache")
def test_generate_with_cache_matches_hugging_face_generate(impl):
    folder = tiny_checkpoint("llama-gqa")
    with torch.inference_mode():
        hf = hf_model(folder).generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, eos_token_id=None)
    want = hf[0, len(PROMPT) :].tolist()
    got = impl.generate_with_cache(model_named("llama-gqa"), PROMPT, 16)
    expect_equal(got, want, inputs=f"tiny llama-gqa, prompt {PROMPT}, 16 new tokens (greedy)")


@pytest.mark.exercise("generate_with_cache")
@pytest.mark.parametrize("max_len", [None, 64])
def test_generate_with_cache_matches_generate_naive(impl, max_len):
    model = model_named("qwen2-bias-mqa")
    want = naive.generate_naive(model, PROMPT, 12)
    got = impl.generate_with_cache(model, PROMPT, 12, max_len)
    expect_equal(got, want, inputs=f"tiny qwen2-bias-mqa, prompt {PROMPT}, 12 new tokens, max_len={max_len}")


@pytest.mark.exercise("generate_with_cache")
@pytest.mark.parametrize("max_new_tokens", [0, 1])
def test_generate_with_cache_few_tokens(impl, max_new_tokens):
    model = model_named("llama-gqa")
    want = naive.generate_naive(model, PROMPT, max_new_tokens)
    got = impl.generate_with_cache(model, PROMPT, max_new_tokens)
    expect_equal(got, want, inputs=f"tiny llama-gqa, prompt {PROMPT}, {max_new_tokens} new tokens")


@pytest.mark.exercise("generate_with_cache")
def test_generate_with_cache_refuses_a_too_small_reservation(impl):
    model = model_named("llama-gqa")
    expect_value_error(
        functools.partial(impl.generate_with_cache, model, PROMPT, 8, 10),
        inputs=f"tiny llama-gqa, prompt {PROMPT}, 8 new tokens, max_len=10 (positions 0-13 need 14 slots)",
    )


# --- capstone: your pieces together, on the real model ----------------------------------------------------

CAPSTONE_TOKENS = 8
CAPSTONE_CASES = {0: "the chat question 'What is the capital of France?'", 3: "'The quick brown fox jumps over the lazy dog. The dog'"}


@pytest.mark.exercise("capstone")
@pytest.mark.parametrize("prompt_index,max_len", [(0, None), (3, 64)])
def test_capstone_your_cache_speaks_like_hugging_face(impl, prompt_index, max_len):
    """Your generate_with_cache, running your prefill and decode_step on your ContiguousKVCache, must produce
    Hugging Face's greedy tokens for SmolLM2-135M-Instruct: with the oracle reservation and with a larger one."""
    model, _ = smollm2()
    prompt = CAPSTONE_PROMPTS[prompt_index]
    with swap_in(impl, REFERENCE) as mine:
        got = mine.generate_with_cache(model, prompt, CAPSTONE_TOKENS, max_len)
    inputs = (f"SmolLM2-135M-Instruct, prompt {CAPSTONE_CASES[prompt_index]} ({len(prompt)} tokens), "
              f"{CAPSTONE_TOKENS} new tokens, max_len={max_len}, all your pieces")
    expect_equal(got, smollm2_greedy(prompt_index, CAPSTONE_TOKENS), inputs=inputs)

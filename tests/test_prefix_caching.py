"""Sharing through the engine: prefix caching changes no token, n > 1 shares the prompt, everything composes.

Oracles: the same engine with prefix caching off, separate seeded n = 1 requests, and Hugging Face `generate`
(greedy, EOS disabled) on the same checkpoint.
"""

import functools
import random
from pathlib import Path

import pytest
import torch

from grading.tiny_models import hf_model, tiny_checkpoint
from solutions import LLM, BeamSearchParams, SamplingParams

SHARED = list(range(30, 70))  # a 40-token "system prompt"
PROMPTS = [SHARED + [5, 6, 7], SHARED + [8], SHARED[:20] + [9, 9], SHARED + [5, 6, 7, 1, 2, 3, 4, 5, 6], [3, 1, 4]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def core(llm: LLM):
    """The engine core behind `llm`, through its in-process client: its scheduler (and KV cache manager), its
    model executor."""
    return llm.llm_engine.engine_core


@functools.cache
def hf_greedy(folder: Path, prompt: tuple[int, ...], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model(folder).generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def make_llm(caching: bool, **kwargs) -> LLM:
    options = dict(block_size=4, num_kv_blocks=160, max_num_seqs=4, max_model_len=256, enable_prefix_caching=caching)
    return LLM(model=str(tiny_checkpoint("llama-gqa")), **{**options, **kwargs})


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def test_greedy_tokens_equal_with_prefix_caching_on_and_off_cold_and_warm():
    off = tokens(make_llm(False).generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = make_llm(True)
    cold = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    warm = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert cold == off and warm == off
    stats = core(llm).scheduler.kv_cache_manager.prefix_cache_stats
    assert stats.hits > 0 and 0 < stats.hit_rate < 1
    folder = tiny_checkpoint("llama-gqa")
    assert off == [[hf_greedy(folder, tuple(p), 12)] for p in PROMPTS]


def test_warm_prompts_compute_only_their_uncached_tokens():
    llm = make_llm(True)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    before = engine.stats.num_prefill_tokens
    (out,) = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    # 43 prompt tokens, block size 4: 10 full blocks are cached and the last 3 tokens are computed
    assert out.num_cached_tokens == 40
    assert engine.stats.num_prefill_tokens - before == 3


@pytest.mark.parametrize("seed", [0, 1])
def test_prefix_caching_in_any_arrival_order(seed):
    order = list(range(len(PROMPTS)))
    random.Random(seed).shuffle(order)
    llm = make_llm(True, max_num_seqs=2)
    got = tokens(llm.generate([PROMPTS[i] for i in order], GREEDY, use_tqdm=False))
    want = tokens(make_llm(False).generate([PROMPTS[i] for i in order], GREEDY, use_tqdm=False))
    assert got == want


def test_prefix_caching_under_memory_pressure_evicts_and_stays_correct():
    llm = make_llm(True, num_kv_blocks=40, max_num_seqs=4)
    got = tokens(llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False))
    folder = tiny_checkpoint("llama-gqa")
    assert got == [[hf_greedy(folder, tuple(p), 12)] for p in PROMPTS * 2]
    assert core(llm).scheduler.kv_cache_manager.num_used_blocks == 0


# parallel sampling -----------------------------------------------------------------------------------------------

SAMPLED = dict(temperature=1.0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("caching", [True, False])
def test_seeded_n4_equals_four_separate_seeded_requests(caching):
    llm = make_llm(caching)
    prompt = PROMPTS[0]
    (together,) = llm.generate([prompt], SamplingParams(n=4, seed=7, **SAMPLED), use_tqdm=False)
    again = llm.generate([prompt], SamplingParams(n=4, seed=7, **SAMPLED), use_tqdm=False)
    separate = [llm.generate([prompt], SamplingParams(n=1, seed=7 + i, **SAMPLED), use_tqdm=False)[0] for i in range(4)]
    assert [c.token_ids for c in together.outputs] == [s.outputs[0].token_ids for s in separate]
    assert tokens(again) == [[c.token_ids for c in together.outputs]]
    assert len({tuple(c.token_ids) for c in together.outputs}) > 1  # four different samples


def test_n4_shares_the_prompt_blocks():
    shared = make_llm(False)
    shared.generate([PROMPTS[3]], SamplingParams(n=4, seed=1, **SAMPLED), use_tqdm=False)
    alone = make_llm(False)
    alone.generate([PROMPTS[3]], SamplingParams(n=1, seed=1, **SAMPLED), use_tqdm=False)
    # 49 prompt tokens + 10 outputs, block size 4: 15 blocks for one sample; four own copies would hold 60
    one = alone.llm_engine.stats.peak_blocks_used
    assert shared.llm_engine.stats.peak_blocks_used < 4 * one
    assert core(shared).scheduler.kv_cache_manager.num_used_blocks == 0


def test_n4_with_a_partial_prompt_block_copies_on_write():
    llm = make_llm(False)
    llm.generate([PROMPTS[0]], SamplingParams(n=4, seed=3, **SAMPLED), use_tqdm=False)  # 43 tokens: 3 in the last block
    assert core(llm).scheduler.kv_cache_manager.num_blocks_copied == 3  # three of the four samples copy it


# beams and caching -----------------------------------------------------------------------------------------------


def test_beam_search_is_the_same_with_prefix_caching_on_and_off_cold_and_warm():
    params = BeamSearchParams(3, 8, ignore_eos=True)
    off = make_llm(False).beam_search(PROMPTS[:3], params)
    llm = make_llm(True)
    cold = llm.beam_search(PROMPTS[:3], params)
    warm = llm.beam_search(PROMPTS[:3], params)
    for outs in (cold, warm):
        assert [[s.tokens for s in o.sequences] for o in outs] == [[s.tokens for s in o.sequences] for o in off]
    assert core(llm).scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    # and the engine still generates the same afterwards
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(make_llm(False).generate(PROMPTS, GREEDY, use_tqdm=False))

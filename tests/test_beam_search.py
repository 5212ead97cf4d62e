"""Beam search over shared blocks: the step, the search loop, and `LLM.beam_search`, against Hugging Face.

The oracle is independent of our code: `transformers`' own beam search (`generate(num_beams=k,
num_return_sequences=k, do_sample=False, early_stopping=True)`) with EOS disabled, on the same checkpoint. With
EOS ignored, every beam has the same length, so the ranking is by cumulative logprob on both sides.
"""

import functools
import itertools
from pathlib import Path

import pytest
import torch

from grading.tiny_models import hf_model, tiny_checkpoint, tiny_model
from solutions import LLM, BeamSearchParams, SamplingParams
from solutions.beam_search import Beam, beam_search_step, get_beam_search_score, run_beam_search
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sequence import Sequence
from solutions.model.loader import resolve_model
from solutions.worker.model_runner import ModelRunner

PROMPTS = [[5, 17, 42, 99, 3], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@functools.cache
def hf_oracle(folder: Path) -> torch.nn.Module:
    return hf_model(folder)


def hf_beams(folder: Path, prompt: list[int], width: int, max_new_tokens: int) -> list[list[int]]:
    with torch.inference_mode():
        out = hf_oracle(folder).generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, num_beams=width, num_return_sequences=width,
            do_sample=False, early_stopping=True, eos_token_id=None, pad_token_id=0,
        )
    return out.tolist()


def search(model, prompts, params, num_blocks=256, block_size=4, caching=True):
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    runner = ModelRunner(model, num_blocks, block_size)
    results = run_beam_search(manager, runner, prompts, params, eos_token_id=None, max_model_len=512)
    return results, manager


# the step --------------------------------------------------------------------------------------------------------


def make_beams(manager, tokens_per_beam, cum_logprobs):
    beams = []
    for i, (tokens, cum) in enumerate(zip(tokens_per_beam, cum_logprobs, strict=True)):
        seq = Sequence(i, tokens)
        manager.allocate_slots(seq, len(tokens))
        seq.num_computed_tokens = len(tokens)
        beams.append(Beam(seq, cum))
    return beams


def test_step_keeps_the_candidates_with_the_highest_cumulative_logprob():
    manager = KVCacheManager(16, 4)
    beams = make_beams(manager, [[1, 2, 3], [1, 2, 4]], [-1.0, -2.0])
    logprobs = torch.log(torch.tensor([[0.1, 0.2, 0.7], [0.9, 0.05, 0.05]]))  # (B=2, V=3)
    live, finished = beam_search_step(manager, beams, logprobs, 2, None, itertools.count(10))
    want = sorted([(-1.0 + logprobs[0, t].item(), 0, t) for t in range(3)] + [(-2.0 + logprobs[1, t].item(), 1, t) for t in range(3)], reverse=True)[:2]
    assert [(b.seq.token_ids[-1], round(b.cum_logprob, 5)) for b in live] == [(t, round(s, 5)) for s, _, t in want]
    assert finished == []
    # -1 + ln 0.7 first, then beam 1's -2 + ln 0.9 = -2.11, which beats beam 0's second, -1 + ln 0.2 = -2.61
    assert [b.seq.token_ids[:-1] for b in live] == [[1, 2, 3], [1, 2, 4]]


def test_step_forks_survivors_and_frees_every_parent():
    manager = KVCacheManager(16, 4)
    beams = make_beams(manager, [[1, 2, 3], [1, 2, 4]], [0.0, -50.0])  # beam 1 has no surviving child
    logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.3, 0.3]]))
    live, _ = beam_search_step(manager, beams, logprobs, 2, None, itertools.count(10))
    assert [b.seq.seq_id for b in live] == [10, 11]
    assert live[0].seq.block_table == live[1].seq.block_table == [0]  # both children share beam 0's block
    assert manager.block_pool.blocks[0].ref_cnt == 2 and beams[1].seq.block_table == [] and beams[0].seq.block_table == []
    assert manager.num_used_blocks == 1
    copies = [manager.allocate_slots(b.seq, 1) for b in live]
    assert copies == [[(0, 2)], []] or copies == [[(0, 1)], []]  # the first writer copies, the last writes in place


def test_step_sets_aside_eos_candidates_among_the_first_beam_width():
    manager = KVCacheManager(16, 4)
    beams = make_beams(manager, [[1, 2, 3]], [0.0])
    logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))  # EOS = token 0, the best
    live, finished = beam_search_step(manager, beams, logprobs, 2, 0, itertools.count(10))
    assert [b.seq.token_ids[-1] for b in finished] == [0] and finished[0].seq.block_table == []
    assert [b.seq.token_ids[-1] for b in live] == [1, 2]  # still two live beams
    live, finished = beam_search_step(manager, live, torch.log(torch.tensor([[0.05, 0.9, 0.03, 0.02]] * 2)), 2, 0, itertools.count(20))
    assert finished == []  # EOS ranks below the first beam_width candidates: not a finished beam


def test_length_penalty_score_counts_the_prompt_and_not_a_final_eos():
    assert get_beam_search_score([1, 2, 3, 4], -2.0, None, 1.0) == -0.5
    assert get_beam_search_score([1, 2, 3, 0], -2.0, 0, 1.0) == pytest.approx(-2 / 3)
    assert get_beam_search_score([1, 2, 3, 4], -2.0, None, 0.0) == -2.0


# the search against Hugging Face ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias-mqa"])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_beam_search_matches_hugging_face_on_tiny_models(name, width):
    results, manager = search(tiny_model(name), PROMPTS, BeamSearchParams(width, 8, ignore_eos=True))
    for prompt, sequences in zip(PROMPTS, results, strict=True):
        assert [s.tokens for s in sequences] == hf_beams(tiny_checkpoint(name), prompt, width, 8), prompt
        assert [s.cum_logprob for s in sequences] == sorted((s.cum_logprob for s in sequences), reverse=True)
        assert all(s.cum_logprob == pytest.approx(sum(s.logprobs), abs=1e-4) for s in sequences)
    assert manager.num_used_blocks == 0  # every beam freed


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias-mqa"])
def test_beam_groups_are_swapped_out_whole_when_the_cache_is_short(name):
    """Chapter 11: with a swap pool, a prompt's beams leave and come back together when the step's beams do not fit;
    the search is the one a large cache runs (HF's beams), and nothing is left on either pool. Without a swap pool,
    the same small cache refuses."""
    folder = tiny_checkpoint(name)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(5, 30, (6,), generator=g)]
    params = BeamSearchParams(beam_width=3, max_tokens=16, ignore_eos=True)
    llm = LLM(model=str(folder), block_size=4, num_kv_blocks=32, preemption_mode="swap", swap_space=0.01)
    swaps = []
    client = llm.llm_engine.engine_core  # the in-process core's client: its scheduler, its model executor
    runner = client.model_executor.model_runner
    execute = runner.execute_model

    def counting(scheduler_output):
        swaps.append(len(scheduler_output.blocks_to_swap_out))
        return execute(scheduler_output)

    runner.execute_model = counting
    outputs = llm.beam_search(prompts, params)
    assert sum(swaps) > 0, "the cache was large enough: nothing was swapped"
    for prompt, output in zip(prompts, outputs, strict=True):
        assert [beam.tokens for beam in output.sequences] == hf_beams(folder, prompt, 3, 16)
    assert client.scheduler.kv_cache_manager.num_used_blocks == 0
    swap_pool = client.scheduler.kv_cache_manager.swap_pool
    assert swap_pool.num_free_blocks == swap_pool.num_blocks
    with pytest.raises(ValueError, match="cannot hold"):
        LLM(model=str(folder), block_size=4, num_kv_blocks=32).beam_search(prompts, params)


def test_width_1_is_greedy():
    model = tiny_model("llama-gqa")
    results, _ = search(model, PROMPTS, BeamSearchParams(1, 10, ignore_eos=True))
    folder = tiny_checkpoint("llama-gqa")
    with torch.inference_mode():
        for prompt, (best,) in zip(PROMPTS, results, strict=True):
            greedy = hf_oracle(folder).generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)
            assert best.tokens == greedy[0].tolist()


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_beams_share_blocks_and_copy_on_write(block_size):
    results, manager = search(tiny_model("llama-gqa"), PROMPTS, BeamSearchParams(4, 8, ignore_eos=True), block_size=block_size)
    want, _ = search(tiny_model("llama-gqa"), PROMPTS, BeamSearchParams(4, 8, ignore_eos=True), block_size=4, caching=False)
    assert [[s.tokens for s in r] for r in results] == [[s.tokens for s in r] for r in want]
    assert (manager.num_blocks_copied > 0) == (block_size > 1)  # block size 1: no partial block, no copy


def test_beam_search_memory_is_shared():
    peaks = []

    def on_step(manager, beams):
        own = sum(-(-b.seq.num_tokens // manager.block_size) for b in beams)
        peaks.append((manager.num_used_blocks, own))

    manager = KVCacheManager(256, 4)
    run_beam_search(manager, ModelRunner(tiny_model("llama-gqa"), 256, 4), [list(range(1, 40))], BeamSearchParams(4, 8, ignore_eos=True), None, 512, on_step=on_step)
    shared, own = peaks[-1]
    assert shared < own / 2  # four beams of a 39-token prompt: the prompt's blocks are held once


def test_finished_beams_are_ranked_with_the_length_penalty():
    model = tiny_model("llama-gqa")
    eos = 0
    manager = KVCacheManager(256, 4)
    runner = ModelRunner(model, 256, 4)
    (sequences,) = run_beam_search(manager, runner, [PROMPTS[0]], BeamSearchParams(3, 12), eos_token_id=eos, max_model_len=512)
    scores = [get_beam_search_score(s.tokens, s.cum_logprob, eos, 1.0) for s in sequences]
    assert scores == sorted(scores, reverse=True) and len(sequences) == 3
    assert manager.num_used_blocks == 0


def test_beam_search_params_validation():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(0, 4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(2, True)


# LLM.beam_search on SmolLM2 --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    return LLM(model="smollm2-135m", max_num_seqs=8, max_model_len=256, num_kv_blocks=256)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_llm_beam_search_matches_hugging_face_on_smollm2(smollm2, width):
    outputs = smollm2.beam_search(TEXTS, BeamSearchParams(width, 12, ignore_eos=True))
    folder = resolve_model("smollm2-135m")
    for text, output in zip(TEXTS, outputs, strict=True):
        prompt = smollm2.tokenizer.encode(text)
        assert [s.tokens for s in output.sequences] == hf_beams(folder, prompt, width, 12), text
        assert output.sequences[0].text.startswith(text)
    assert smollm2.llm_engine.engine_core.scheduler.kv_cache_manager.num_used_blocks == 0


def test_llm_beam_search_stops_at_eos_and_needs_an_idle_engine(smollm2):
    (output,) = smollm2.beam_search(["<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"], BeamSearchParams(2, 40))
    assert len(output.sequences) == 2 and all(s.finish_reason in ("stop", "length") for s in output.sequences)
    smollm2.llm_engine.add_request("busy", "Hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="idle engine"):
        smollm2.beam_search(["Hello"], BeamSearchParams(2, 4))
    while smollm2.llm_engine.has_unfinished_requests():
        smollm2.llm_engine.step()

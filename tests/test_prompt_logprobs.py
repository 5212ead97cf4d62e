"""`SamplingParams.prompt_logprobs`: each prompt token's log-probability (and the top tokens there) equals Hugging
Face's log-softmax of its forward pass over the prompt — in one pass, over chunked prefill, past a cached prefix
(which such a request does not read, as in vLLM), after a preemption, and beside requests that do not ask.

Tolerance: fp32 on both sides, |ours - theirs| <= 1e-4 per logprob (measured: a few 1e-6)."""

import functools
from pathlib import Path

import pytest
import torch

from grading.tiny_models import hf_model, tiny_checkpoint
from solutions import LLM, SamplingParams
from solutions.engine.arg_utils import EngineArgs
from solutions.engine.llm_engine import LLMEngine
from solutions.model.loader import resolve_model
from solutions.outputs import Logprob
from solutions.sampling_params import RequestOutputKind

ATOL = 1e-4


@functools.cache
def hf_prompt_logprobs(folder: Path, prompt: tuple[int, ...]) -> torch.Tensor:
    """(P - 1, V): Hugging Face's log-softmax at positions 0 .. P - 2, the distributions of tokens 1 .. P - 1."""
    with torch.inference_mode():
        logits = hf_model(folder)(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_prompt_logprobs_match(folder: Path, prompt: list[int], got: list[dict[int, Logprob] | None], k: int):
    """The vLLM shape (None first, then one dict per token) and Hugging Face's values: the actual token's logprob
    and rank, and the top-k tokens with theirs."""
    want = hf_prompt_logprobs(folder, tuple(prompt))
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry, row, token_id = got[i], want[i - 1], prompt[i]
        assert abs(entry[token_id].logprob - row[token_id].item()) <= ATOL, f"prompt token {i}"
        assert abs(entry[token_id].rank - (int((row > row[token_id]).sum()) + 1)) <= 1, f"prompt token {i}: rank"
        top = row.topk(k)
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= k)
        assert [r for r, _, _ in ranked] == list(range(1, k + 1)) and len(entry) in (k, k + 1)
        torch.testing.assert_close(torch.tensor([lp for _, _, lp in ranked]), top.values, atol=ATOL, rtol=0)


def prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(2, 60, (count,), generator=g)]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(block_size=16),  # each prompt in one step
        dict(block_size=4, max_num_batched_tokens=16, long_prefill_token_threshold=7),  # chunks of at most 7
        dict(block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False),
    ],
    ids=["one-pass", "chunked", "no-prefix-caching"],
)
def test_tiny_prompt_logprobs_equal_hugging_face(engine_args):
    folder = tiny_checkpoint("llama-gqa")
    llm = LLM(model=str(folder), **engine_args)
    batch = prompts(5, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    for prompt, output in zip(batch, llm.generate(batch, params, use_tqdm=False), strict=True):
        assert_prompt_logprobs_match(folder, prompt, output.prompt_logprobs, 3)


def test_a_cached_prefix_is_not_read_but_computed():
    """The prefix is in the cache, yet the request computes it (num_cached_tokens 0) and gets every logprob; a
    plain request after it still hits the blocks it wrote."""
    folder = tiny_checkpoint("llama-gqa")
    llm = LLM(model=str(folder), block_size=4, max_num_batched_tokens=16, long_prefill_token_threshold=6)
    prefix = list(range(10, 42))
    (warm,) = llm.generate([prefix + [1, 2]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    prompt = prefix + [3, 4, 5]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.num_cached_tokens == 0
    assert_prompt_logprobs_match(folder, prompt, out.prompt_logprobs, 1)
    (after,) = llm.generate([prefix + [6]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert after.num_cached_tokens == len(prefix), "the blocks it computed are cached for the next request"


def test_n_samples_and_a_mixed_batch():
    """Requests with and without prompt_logprobs, n > 1 and prompt_logprobs=0 (the actual token only), together."""
    folder = tiny_checkpoint("llama-gqa")
    llm = LLM(model=str(folder), block_size=4, max_num_batched_tokens=24, long_prefill_token_threshold=10)
    batch = prompts(4, seed=2)
    params = [
        SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=5, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=0, logprobs=2),
        SamplingParams(temperature=0.5, max_tokens=5, prompt_logprobs=4, repetition_penalty=1.2),
    ]
    outputs = llm.generate(batch, params, use_tqdm=False)
    assert outputs[1].prompt_logprobs is None
    assert len(outputs[0].outputs) == 3
    for i, k in ((0, 2), (2, 0), (3, 4)):
        assert_prompt_logprobs_match(folder, batch[i], outputs[i].prompt_logprobs, k)
    assert all(len(entry) == 1 for entry in outputs[2].prompt_logprobs[1:]), "prompt_logprobs=0: the token alone"
    alone = llm.generate([batch[1]], params[1], use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_prompt_logprobs_survive_a_preemption():
    """Memory for one long prompt at a time: prefills are preempted and start over; the logprobs stay whole."""
    folder = tiny_checkpoint("llama-gqa")
    llm = LLM(model=str(folder), block_size=4, num_kv_blocks=24, max_num_batched_tokens=12,
              long_prefill_token_threshold=4)
    batch = [list(range(i, i + 50)) for i in (1, 60, 120)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(batch, params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    for prompt, output in zip(batch, outputs, strict=True):
        assert_prompt_logprobs_match(folder, prompt, output.prompt_logprobs, 1)


def test_delta_outputs_carry_the_prompt_logprobs_once():
    """Streaming (DELTA): the whole list in the first output, [] in the later ones, as vLLM."""
    folder = tiny_checkpoint("llama-gqa")
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(folder), block_size=4, long_prefill_token_threshold=5))
    prompt = list(range(5, 25))
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1,
                                                   output_kind=RequestOutputKind.DELTA))
    seen = []
    while engine.has_unfinished_requests():
        seen += [output.prompt_logprobs for output in engine.step()]
    assert len(seen) == 4 and all(p == [] for p in seen[1:])
    assert_prompt_logprobs_match(folder, prompt, seen[0], 1)


def test_smollm2_prompt_logprobs_score_a_continuation():
    """What an evaluation harness asks (`echo` with `logprobs`): the prompt's logprobs, decoded tokens included."""
    folder = resolve_model("smollm2-135m")
    llm = LLM(model="smollm2-135m", max_num_seqs=2, max_model_len=256, max_num_batched_tokens=64)
    text = "The capital of France is Paris. The capital of Germany is Berlin."
    (out,) = llm.generate(text, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    prompt = out.prompt_token_ids
    assert_prompt_logprobs_match(folder, prompt, out.prompt_logprobs, 1)
    berlin = out.prompt_logprobs[len(prompt) - 2]
    assert berlin[prompt[-2]].decoded_token == " Berlin"

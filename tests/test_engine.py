"""The reference engine behind `LLM.generate`: HF-identical greedy tokens over the paged cache in any batch
composition, sampling, stop conditions, and input validation that never disturbs the engine."""

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grading.parity import assert_greedy_close
from grading.tiny_models import TINY_CONFIGS, hf_model, tiny_checkpoint
from solutions import LLM, FinishReason, SamplingParams
from solutions.model.loader import resolve_model
from solutions.sample.sampler import apply_top_k_top_p_min_p

GREEDY_64 = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def core(llm: LLM):
    """The engine core behind `llm`, through its in-process client: its scheduler (and KV cache manager), its
    model executor."""
    return llm.llm_engine.engine_core


@functools.cache
def hf_oracle(folder: Path) -> torch.nn.Module:
    return hf_model(folder)


@functools.cache
def hf_greedy(folder: Path, prompt: tuple[int, ...], n: int) -> list[int]:
    """HF `generate`'s greedy tokens (EOS disabled), computed once per prompt for every engine configuration."""
    with torch.inference_mode():
        out = hf_oracle(folder).generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


def tiny_prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (count,), generator=g).tolist()
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


# --- greedy parity with Hugging Face ---------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY_CONFIGS)
@pytest.mark.parametrize(
    "engine_args",
    [
        dict(block_size=16),  # everything in one static batch
        dict(block_size=4, max_num_seqs=2),  # several batches, many small blocks
        dict(block_size=8, max_num_batched_tokens=40),  # prefills split over several steps
        dict(block_size=16, num_kv_blocks=14),  # memory admits only part of the queue at a time
    ],
    ids=["one-batch", "small-blocks", "token-budget", "tight-memory"],
)
def test_tiny_greedy_matches_hugging_face_in_any_batch_composition(name, engine_args):
    folder = tiny_checkpoint(name)
    llm = LLM(model=str(folder), **engine_args)
    prompts = tiny_prompts(6, seed=len(name))
    outputs = llm.generate(prompts, GREEDY_64)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        theirs = hf_greedy(folder, tuple(prompt), 64)
        assert_greedy_close(output.outputs[0].token_ids, theirs, prompt, hf_oracle(folder))
    assert core(llm).scheduler.kv_cache_manager.num_used_blocks == 0, "every block is freed when the requests finish"


@pytest.fixture(scope="module")
def smollm2():
    return LLM(model="smollm2-135m", max_num_seqs=4, max_model_len=512)


@pytest.mark.quick
def test_smollm2_greedy_matches_hugging_face_generate(smollm2):
    folder = resolve_model("smollm2-135m")
    texts = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Paged attention"]
    outputs = smollm2.generate(texts, GREEDY_64)
    for output in outputs:
        prompt = output.prompt_token_ids
        theirs = hf_greedy(folder, tuple(prompt), 64)
        assert_greedy_close(output.outputs[0].token_ids, theirs, prompt, hf_oracle(folder))
    assert smollm2.llm_engine.stats.peak_blocks_used > 0
    assert core(smollm2).scheduler.kv_cache_manager.num_used_blocks == 0


# --- outputs, stop conditions, sampling ------------------------------------------------------------------


def test_chat_answer_stops_at_eos(smollm2):
    prompt = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    (out,) = smollm2.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48))
    completion = out.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == FinishReason.STOP == "stop"
    assert completion.token_ids[-1] == core(smollm2).model_executor.model_runner.model.config.eos_token_id
    (ignored,) = smollm2.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    assert ignored.outputs[0].finish_reason == "length" and len(ignored.outputs[0].token_ids) == 48


def test_stop_string_cuts_the_text(smollm2):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    (full,) = smollm2.generate("Once upon a time", params)
    stop = full.outputs[0].text[10:16]
    (cut,) = smollm2.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=32, stop=[stop]))
    completion = cut.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == full.outputs[0].text[: full.outputs[0].text.find(stop)]
    assert len(completion.token_ids) < 32


def test_stop_token_id_ends_after_that_token(smollm2):
    (full,) = smollm2.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    stop_id = full.outputs[0].token_ids[5]
    first = full.outputs[0].token_ids.index(stop_id)
    (cut,) = smollm2.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_id]))
    assert cut.outputs[0].token_ids == full.outputs[0].token_ids[: first + 1]
    assert cut.outputs[0].stop_reason == stop_id


def test_context_limit_finishes_with_length():
    llm = LLM(model=str(tiny_checkpoint("llama-gqa")), max_model_len=20)
    (out,) = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 15


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_samples():
    llm = LLM(model=str(tiny_checkpoint("llama-gqa")))
    params = SamplingParams(n=3, temperature=1.5, max_tokens=20, seed=42)
    first, again = llm.generate([[5, 6, 7]], params)[0], llm.generate([[5, 6, 7]], params)[0]
    samples = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert samples == [c.token_ids for c in again.outputs], "the same seed gives the same samples"
    assert len({tuple(s) for s in samples}) == 3, "each of the n samples draws its own tokens"


def test_top_k_one_is_greedy():
    llm = LLM(model=str(tiny_checkpoint("qwen2-bias-mqa")))
    prompts = tiny_prompts(3, seed=3)
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    top1 = llm.generate(prompts, SamplingParams(temperature=0.9, top_k=1, max_tokens=12, seed=1))
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def kept(logits: list[float], top_k: int = 4, top_p: float = 1.0, min_p: float = 0.0) -> list[bool]:
    """Which of one row's tokens survive the filters."""
    row = torch.log(torch.tensor([logits]))  # (1, V)
    out = apply_top_k_top_p_min_p(row, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
    return out[0].isfinite().tolist()


def test_top_p_keeps_the_smallest_nucleus():
    probs = [0.5, 0.3, 0.15, 0.05]
    assert kept(probs, top_p=0.8) == [True, True, False, False]
    assert kept(probs, top_p=0.81) == [True, True, True, False]
    assert kept(probs, top_p=0.1) == [True, False, False, False]


def test_top_k_and_min_p_filters():
    probs = [0.05, 0.5, 0.15, 0.3]  # not sorted: the filters must sort
    assert kept(probs, top_k=2) == [False, True, False, True]
    assert kept(probs, min_p=0.3) == [False, True, True, True]  # 0.15 >= 0.3 * 0.5
    assert kept(probs, min_p=0.31) == [False, True, False, True]


def test_filters_apply_per_row():
    rows = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    out = apply_top_k_top_p_min_p(rows, torch.tensor([1, 4]), torch.tensor([1.0, 0.5]), torch.tensor([0.0, 0.0]))
    assert out.isfinite().sum(dim=-1).tolist() == [1, 2]


def test_lower_priority_value_runs_first():
    llm = LLM(model=str(tiny_checkpoint("llama-gqa")), max_num_seqs=1, scheduling_policy="priority")
    engine, params = llm.llm_engine, SamplingParams(temperature=0.0, max_tokens=3)
    for request_id, priority in [("late", 5), ("urgent", -1), ("normal", 0)]:
        engine.add_request(request_id, [1, 2, 3], params, priority)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["urgent", "normal", "late"]


# --- validation: clear errors, nothing disturbed ---------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("n", 0, "an int >= 1"),
        ("temperature", -0.5, "a number >= 0"),
        ("top_p", 0.0, "in (0, 1]"),
        ("top_p", 1.5, "in (0, 1]"),
        ("top_k", -2, "-1, 0 (both: disabled) or an int >= 1"),
        ("max_tokens", 0, "an int >= 1"),
        ("stop", [""], "a non-empty string or a list of them"),
        ("stop_token_ids", [-1], "a list of non-negative ints"),
        ("ignore_eos", "yes", "True or False"),
        ("seed", 1.5, "None or an int"),
    ],
)
def test_invalid_sampling_params_name_the_field_and_the_allowed_values(field, value, allowed):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    assert f"SamplingParams.{field} must be {allowed}, got {value!r}" == str(error.value)


@pytest.mark.parametrize(
    "args,message",
    [
        (dict(attention_backend="cuda"), "attention_backend must be one of ('torch', 'inductor', 'triton'), got 'cuda'"),
        (dict(block_size=0), "block_size must be a positive int, got 0"),
        (dict(max_num_seqs=-1), "max_num_seqs must be a positive int, got -1"),
        (dict(num_kv_blocks=0), "num_kv_blocks must be a positive int, got 0"),
        (dict(max_model_len=4096), "max_model_len must be at most the model's max_position_embeddings=512, got 4096"),
    ],
)
def test_invalid_engine_arguments_are_named(args, message):
    with pytest.raises(ValueError) as error:
        LLM(model=str(tiny_checkpoint("llama-gqa")), **args)
    assert str(error.value) == message


def test_a_bad_request_is_rejected_and_disturbs_nothing():
    llm = LLM(model=str(tiny_checkpoint("llama-gqa")), max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    before = llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
    bad_batches = [
        ([[1, 2, 3], [999]], "must lie in [0, 256)"),
        ([[1, 2, 3], []], "is empty"),
        ([[1, 2, 3], list(range(64))], "must be shorter than max_model_len=64"),
        ([[1, 2, 3], "text"], "this model folder has no tokenizer"),
    ]
    for prompts, message in bad_batches:
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate(prompts, params)
        assert not llm.llm_engine.has_unfinished_requests()
        assert core(llm).scheduler.kv_cache_manager.num_used_blocks == 0
    assert llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids == before


def test_command_line_generates_and_reports_the_engine(tmp_path):
    cmd = [sys.executable, "-m", "solutions", "What is the capital of France?", "--max-tokens", "12"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    assert "Paris" in proc.stdout
    assert "what the engine did" in proc.stdout and "steps" in proc.stdout and "peak in use" in proc.stdout


def test_every_step_keeps_its_time_in_one_ledger_by_stage():
    """Each step's `SchedulerStats.seconds` holds the time of every stage, the model runner's share (inputs, forward)
    included: the runner keeps no running totals of its own."""
    from solutions.metrics.stats import STEP_STAGES

    llm = LLM(model=str(tiny_checkpoint("llama-gqa")), block_size=16, max_num_seqs=4, max_model_len=128)
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    steps = llm.llm_engine.stats.steps
    assert len(steps) == 5
    for step in steps:
        assert tuple(step.seconds) == STEP_STAGES
        assert step.seconds["prepare"] > 0 and step.seconds["forward"] > 0, "every step ran the model"
    assert not hasattr(core(llm).model_executor.model_runner, "seconds")

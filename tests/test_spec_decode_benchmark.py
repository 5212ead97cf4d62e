"""The speculative decoding benchmark's parts: its copying prompts, the expected tokens per step, and a paired run
on a tiny model whose numbers must agree with each other (acceptance, tokens per step, the greedy tokens)."""

import pytest

from benchmarks.spec_decode import (
    MAX_PROMPT_TOKENS,
    add_speedups,
    copying_prompts,
    expected_tokens_per_step,
    explaining_prompts,
    paired_rows,
    parse_args,
    percentile,
    run_once,
    speculative_config,
    tokens_per_step,
    workload_prompts,
)
from benchmarks.w64 import draw_workload
from grading.tiny_models import tiny_checkpoint
from solutions import LLM
from solutions.model.loader import load_tokenizer

K = 4


def test_copying_prompts_are_seeded_chat_requests_to_copy_code():
    tokenizer = load_tokenizer("smollm2-135m")
    prompts = copying_prompts(tokenizer, 3)
    assert prompts == copying_prompts(tokenizer, 3)  # the same seed, the same prompts
    assert prompts != copying_prompts(tokenizer, 3, seed=1)
    for prompt in prompts:
        assert len(prompt) < MAX_PROMPT_TOKENS
        text = tokenizer.decode(prompt)
        assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
        assert "renamed to" in text and "```python\ndef " in text
    with pytest.raises(ValueError, match="num_prompts"):
        copying_prompts(tokenizer, 0)
    with pytest.raises(ValueError, match="num_prompts must be <="):
        copying_prompts(tokenizer, 10_000)
    assert workload_prompts("copying", tokenizer, 2) == prompts[:2]  # batch b runs the first b of the workload
    assert workload_prompts("w64", tokenizer, 2) == draw_workload(len(tokenizer))[0][:2]
    explaining = explaining_prompts(tokenizer, 2)
    assert explaining == workload_prompts("explaining", tokenizer, 2) and explaining != prompts[:2]
    assert all("Explain in two or three sentences" in tokenizer.decode(p) for p in explaining)
    with pytest.raises(ValueError, match="workload must be one of"):
        workload_prompts("sharegpt", tokenizer, 2)


def test_expected_tokens_per_step_is_the_geometric_sum():
    assert expected_tokens_per_step(0.0, K) == 1.0  # every draft rejected: the target's own token only
    assert expected_tokens_per_step(1.0, K) == K + 1  # every draft accepted, and the bonus token
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    with pytest.raises(ValueError, match="acceptance_rate"):
        expected_tokens_per_step(1.5, K)


def test_percentile_interpolates_as_numpy():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)


def test_bad_options_are_refused_by_name():
    with pytest.raises(SystemExit):
        parse_args(["--batch-sizes", "65"])
    with pytest.raises(SystemExit):
        parse_args(["--prompt-lookup-min", "5", "--prompt-lookup-max", "4"])
    args = parse_args(["--quick"])
    assert args.batch_sizes == [1, 8] and args.repeats == 2 and args.max_tokens_for(8) == 32


def test_paired_run_on_a_tiny_model_gives_consistent_numbers():
    """Spec and plain on the same prompts, as the benchmark runs them: the same greedy tokens, an acceptance rate
    in [0, 1], and per sequence as many decode-step tokens as its decode steps plus its accepted drafts."""
    model = str(tiny_checkpoint("llama-gqa"))
    engines = {
        mode: LLM(model=model, enforce_eager=True, enable_prefix_caching=False, max_num_seqs=4,
                  speculative_config=speculative_config(K, 1, 4) if mode == "spec" else None)
        for mode in ("plain", "spec")
    }
    prompts = draw_workload(256, 3, low=8, high=24)[0]  # a tiny model's random loops give the drafts something
    max_tokens = 24
    spec_run = run_once(engines["spec"], prompts, max_tokens)
    generated = sum(map(len, spec_run["tokens"]))
    assert generated == len(prompts) * max_tokens  # EOS ignored: exactly max_tokens each
    # each request's first token came from its prefill; every other one is a decode step's own token or a draft
    assert generated - len(prompts) == spec_run["num_decode_seq_steps"] + spec_run["num_accepted_tokens"]
    assert 0 < spec_run["num_accepted_tokens"] <= spec_run["num_draft_tokens"]
    assert 1.0 < tokens_per_step(spec_run, len(prompts)) <= K + 1

    batches = [{"workload": "w64", "prompts": prompts, "max_tokens": max_tokens}]
    rows = paired_rows(engines, batches, repeats=2, k=K)
    add_speedups(rows)
    plain, spec = sorted(rows, key=lambda r: r["mode"])
    assert plain["mode"] == "plain" and spec["mode"] == "spec"
    assert plain["tokens_equal_plain"] and spec["tokens_equal_plain"]  # speculation changes no greedy token
    assert plain["mean_tokens_per_step"] == 1.0 and plain["acceptance_rate"] is None
    assert 0.0 < spec["acceptance_rate"] <= 1.0
    assert spec["acceptance_rate"] == spec_run["num_accepted_tokens"] / spec_run["num_draft_tokens"]
    assert spec["mean_tokens_per_step"] == tokens_per_step(spec_run, len(prompts))
    assert 1.0 <= spec["expected_tokens_per_step"] <= K + 1
    for row in rows:
        assert len(row["tokens_per_s"]) == 2 and all(t > 0 for t in row["tokens_per_s"])
        assert 0 < row["latency_p50_s"] <= row["latency_p90_s"]
    assert spec["speedup"] > 0 and "speedup" not in plain

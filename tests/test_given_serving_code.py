"""The front end's merge of DELTA outputs and the serving benchmark's statistics: given code of chapter 07, tested
here since they are no longer exercises (moved from chapters/07_serving/test_07_serving.py, issue 30)."""

import math

from benchmarks import serving as serving_benchmark
from benchmarks.serving import RequestTimeline as Timeline
from grading import expect_equal
from solutions.engine.async_llm import merge_delta
from solutions.outputs import CompletionOutput, FinishReason, Logprob, RequestOutput


def delta(*samples: tuple, finished: bool = False, cached: int = 0) -> RequestOutput:
    """A DELTA output: samples given as (index, text, token_ids[, finish_reason[, logprobs, cumulative]])."""
    outputs = []
    for index, text, token_ids, *rest in samples:
        reason = rest[0] if rest else None
        logprobs, cumulative = (rest[1], rest[2]) if len(rest) > 1 else (None, None)
        outputs.append(CompletionOutput(index, text, list(token_ids), reason, None, cumulative, logprobs))
    return RequestOutput("r", "a prompt", [1, 2, 3], outputs, finished, cached)


def completions(output: RequestOutput) -> list[tuple]:
    return [(c.index, c.text, c.token_ids, c.finish_reason) for c in output.outputs]


def test_merge_delta_concatenates_one_sample():
    inputs = "pending: ' Once' [11]; new: ' upon a' [12, 13], finished with 'length'"
    new = delta((0, " upon a", [12, 13], FinishReason.LENGTH), finished=True)
    merged = merge_delta(delta((0, " Once", [11])), new)
    expect_equal(completions(merged), [(0, " Once upon a", [11, 12, 13], FinishReason.LENGTH)],
                 inputs=f"{inputs}; samples")
    expect_equal(merged.finished, True, inputs=f"{inputs}; finished (the newer output's)")


def test_merge_delta_matches_samples_by_index():
    inputs = "n=3: pending has samples 2 and 0; new has samples 0 and 1 (a sample moves only when it has a token)"
    pending = delta((2, "c", [3]), (0, "a", [1]))
    merged = merge_delta(pending, delta((0, "A", [10]), (1, "B", [20], FinishReason.STOP)))
    expect_equal(completions(merged),
                 [(0, "aA", [1, 10], None), (1, "B", [20], FinishReason.STOP), (2, "c", [3], None)],
                 inputs=f"{inputs}; samples, by index")


def test_merge_delta_keeps_every_logprob():
    first = [{11: Logprob(-0.5, 1)}]
    second = [{12: Logprob(-0.25, 1)}, {13: Logprob(-1.0, 2)}]
    inputs = "logprobs: pending has one token's, new has two (cumulative -0.5, then -1.75)"
    new = delta((0, "yz", [12, 13], None, second, -1.75), cached=2)
    merged = merge_delta(delta((0, "x", [11], None, first, -0.5)), new)
    sample = merged.outputs[0]
    expect_equal([list(entry) for entry in sample.logprobs], [[11], [12], [13]], inputs=f"{inputs}; logprobs per token")
    expect_equal(sample.cumulative_logprob, -1.75, inputs=f"{inputs}; cumulative_logprob (the newer output's)")
    expect_equal(merged.num_cached_tokens, 2, inputs=f"{inputs}; num_cached_tokens (the newer output's)")




def hand_made_timelines() -> list:
    """Two streamed requests and a failed one (seconds):
    A: sent 0.0, chunks at 0.5, 0.6, 0.8, ends 0.8, 3 tokens → TTFT 0.5, TPOT (0.8-0.5)/2 = 0.15, ITLs 0.1, 0.2, e2e 0.8
    B: sent 1.0, chunks at 1.2, 2.0,      ends 2.0, 2 tokens → TTFT 0.2, TPOT (1.0-0.2)/1 = 0.8,  ITL 0.8,      e2e 1.0
    C: sent 1.5, failed at 1.6."""
    return [
        Timeline(sent=0.0, chunk_times=[0.5, 0.6, 0.8], end=0.8, output_tokens=3),
        Timeline(sent=1.0, chunk_times=[1.2, 2.0], end=2.0, output_tokens=2),
        Timeline(sent=1.5, end=1.6, error="the stream carried no tokens"),
    ]


def rounded(stats: dict) -> dict:
    return {key: round(value, 6) for key, value in stats.items()}


def test_serving_metrics_latencies():
    inputs = "hand-made timelines (see hand_made_timelines): A and B completed, C failed; duration 2.0 s"
    metrics = serving_benchmark.serving_metrics(hand_made_timelines(), 2.0)
    expect_equal(rounded(metrics["ttft_s"]), {"mean": 0.35, "p50": 0.35, "p99": 0.497}, inputs=f"{inputs}; ttft_s")
    expect_equal(rounded(metrics["tpot_s"]), {"mean": 0.475, "p50": 0.475, "p99": 0.7935}, inputs=f"{inputs}; tpot_s")
    expect_equal(rounded(metrics["e2e_s"]), {"mean": 0.9, "p50": 0.9, "p99": 0.998}, inputs=f"{inputs}; e2e_s")


def test_serving_metrics_inter_token_latencies_are_gaps_between_chunks():
    inputs = "hand-made timelines: ITLs 0.1, 0.2 (A) and 0.8 (B)"
    metrics = serving_benchmark.serving_metrics(hand_made_timelines(), 2.0)
    expect_equal(rounded(metrics["itl_s"]), {"mean": 0.366667, "p50": 0.2, "p99": 0.788}, inputs=f"{inputs}; itl_s")


def test_serving_metrics_counts_and_throughput():
    inputs = "hand-made timelines: 2 completed (5 output tokens), 1 failed, duration 2.0 s"
    metrics = serving_benchmark.serving_metrics(hand_made_timelines(), 2.0)
    got = {k: round(metrics[k], 6) for k in ("completed", "failed", "request_throughput", "output_throughput")}
    expect_equal(got, {"completed": 2, "failed": 1, "request_throughput": 1.0, "output_throughput": 2.5}, inputs=inputs)
    expect_equal(round(metrics["normalized_latency_s_per_token"], 6), round((0.8 / 3 + 1.0 / 2) / 2, 6),
                 inputs=f"{inputs}; normalized_latency_s_per_token (mean of e2e / output tokens)")


def test_serving_metrics_skips_tpot_for_a_one_token_request():
    inputs = "A from hand_made_timelines and D: sent 0, one chunk at 0.3, 1 token"
    timelines = [hand_made_timelines()[0], Timeline(sent=0.0, chunk_times=[0.3], end=0.3, output_tokens=1)]
    metrics = serving_benchmark.serving_metrics(timelines, 1.0)
    expect_equal(rounded(metrics["tpot_s"]), {"mean": 0.15, "p50": 0.15, "p99": 0.15},
                 inputs=f"{inputs}; tpot_s (a single token has no time per output token after the first)")




def test_merge_delta_with_logprobs_on_one_side_only():
    with_logprobs = delta((0, "x", [11], None, [{11: Logprob(-0.5, 1)}], -0.5))
    merged = merge_delta(with_logprobs, delta((0, "y", [12])))
    assert [list(entry) for entry in merged.outputs[0].logprobs] == [[11]]
    assert merged.outputs[0].token_ids == [11, 12]


def test_serving_metrics_with_no_completed_request_is_nan_not_zero():
    metrics = serving_benchmark.serving_metrics([Timeline(sent=0.0, end=1.0, error="refused")], 1.0)
    assert (metrics["completed"], metrics["failed"], metrics["request_throughput"]) == (0, 1, 0.0)
    assert all(math.isnan(metrics[key]["p50"]) for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"))

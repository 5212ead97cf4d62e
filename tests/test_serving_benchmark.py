"""The serving benchmark's pure parts: Poisson arrivals, the workload, vLLM's latency metrics on a hand-made
timeline, and the sustainable-rate rule of the Fig. 12 comparison."""

import math

import numpy as np
import pytest

from benchmarks.serving import (
    MAX_MODEL_LEN,
    SCALE,
    RequestTimeline,
    make_requests,
    normalized_latency,
    poisson_arrivals,
    rate_ratio,
    serving_metrics,
    summary,
    sustainable_rate,
)
from benchmarks.workload import SHAREGPT_MEAN_OUTPUT_LEN, SHAREGPT_MEAN_PROMPT_LEN


def test_poisson_arrivals_have_mean_gap_one_over_the_rate():
    arrivals = poisson_arrivals(20_000, rate=4.0, seed=0)
    gaps = np.diff(arrivals)
    assert arrivals[0] == 0.0
    assert np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 4.0, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 4.0, rel=0.05)  # exponential: standard deviation = mean


def test_poisson_arrivals_are_seeded_and_scale_with_the_rate():
    assert np.array_equal(poisson_arrivals(50, 2.0, seed=3), poisson_arrivals(50, 2.0, seed=3))
    assert not np.array_equal(poisson_arrivals(50, 2.0, seed=3), poisson_arrivals(50, 2.0, seed=4))
    assert np.allclose(poisson_arrivals(50, 8.0, seed=3), poisson_arrivals(50, 2.0, seed=3) / 4)


def test_requests_are_scaled_sharegpt_lengths_of_random_ids():
    requests = make_requests(4000, vocab_size=1000, seed=0)
    prompt_lens = np.array([len(r.prompt_token_ids) for r in requests])
    output_lens = np.array([r.output_len for r in requests])
    assert prompt_lens.min() >= 1 and output_lens.min() >= 1
    assert np.all(prompt_lens + output_lens <= MAX_MODEL_LEN)
    assert all(100 <= t < 1000 for r in requests[:50] for t in r.prompt_token_ids)
    assert prompt_lens.mean() == pytest.approx(SHAREGPT_MEAN_PROMPT_LEN / SCALE, rel=0.15)
    assert output_lens.mean() == pytest.approx(SHAREGPT_MEAN_OUTPUT_LEN / SCALE, rel=0.15)
    assert make_requests(10, 1000, seed=0) == make_requests(10, 1000, seed=0)
    assert make_requests(10, 1000, seed=1) != make_requests(10, 1000, seed=0)


def timeline(sent: float, chunks: list[float], end: float, tokens: int) -> RequestTimeline:
    return RequestTimeline(sent=sent, chunk_times=chunks, end=end, output_tokens=tokens)


def test_latency_metrics_of_one_request():
    t = timeline(10.0, [10.5, 10.7, 11.0, 11.1], end=11.2, tokens=4)
    assert t.ttft == pytest.approx(0.5)
    assert t.e2e == pytest.approx(1.2)
    assert t.tpot == pytest.approx((1.2 - 0.5) / 3)  # vLLM: (e2e - ttft) / (output tokens - 1)
    assert t.itls == pytest.approx([0.2, 0.3, 0.1])
    assert timeline(0.0, [0.3], end=0.3, tokens=1).tpot is None


def test_serving_metrics_over_requests_skip_the_failed_ones():
    a = timeline(0.0, [0.5, 0.7, 1.0], end=1.0, tokens=3)  # ttft 0.5, e2e 1.0, tpot 0.25, itls 0.2 0.3
    b = timeline(1.0, [1.1, 1.5], end=2.0, tokens=2)  # ttft 0.1, e2e 1.0, tpot 0.9, itl 0.4
    failed = RequestTimeline(sent=0.5, end=0.6, error="ConnectionError")
    m = serving_metrics([a, b, failed], duration=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["ttft_s"] == pytest.approx(dict(mean=0.3, p50=0.3, p99=0.1 + 0.99 * 0.4))
    assert m["tpot_s"]["mean"] == pytest.approx((0.25 + 0.9) / 2)
    assert m["itl_s"] == pytest.approx(dict(mean=0.3, p50=0.3, p99=np.percentile([0.2, 0.3, 0.4], 99)))
    assert m["e2e_s"]["p50"] == pytest.approx(1.0)
    assert m["normalized_latency_s_per_token"] == pytest.approx((1.0 / 3 + 1.0 / 2) / 2)
    assert normalized_latency([a, b]) == m["normalized_latency_s_per_token"]


def test_summary_of_nothing_is_nan():
    assert all(math.isnan(v) for v in summary([]).values())


def test_sustainable_rate_interpolates_the_crossing():
    rate, crossed = sustainable_rate([1, 2, 4, 8], [0.1, 0.2, 0.3, 0.7], threshold=0.5)
    assert crossed
    assert rate == pytest.approx(4 + (0.5 - 0.3) * (8 - 4) / (0.7 - 0.3))  # 6.0


def test_sustainable_rate_without_a_crossing_is_a_lower_bound():
    assert sustainable_rate([1, 2, 4], [0.1, 0.2, 0.3], threshold=0.5) == (4, False)


def test_sustainable_rate_is_none_when_even_the_lowest_rate_is_over():
    assert sustainable_rate([1, 2], [0.6, 0.9], threshold=0.5) == (None, True)


def test_rate_ratio_says_when_it_is_only_a_bound():
    assert rate_ratio((6.0, True), (2.0, True)) == (3.0, "exact")
    assert rate_ratio((16.0, False), (4.0, True)) == (4.0, "at least")  # paged never crossed: it sustains more
    assert rate_ratio((6.0, True), (16.0, False)) == (6.0 / 16.0, "at most")
    assert rate_ratio((16.0, False), (16.0, False)) == (None, "unknown")
    assert rate_ratio((6.0, True), (None, True)) == (None, "unknown")

"""The memory benchmark: its workload, its closed-form expectations, and the targets of the paged design.

`benchmarks/memory.py --json` runs once (a few seconds) in a subprocess, as a user would run it.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.memory import expected_utilization, simulate_contiguous, simulate_paged
from benchmarks.workload import (
    SHAREGPT_MEAN_OUTPUT_LEN,
    SHAREGPT_MEAN_PROMPT_LEN,
    Request,
    sample_lengths,
    sharegpt_like_requests,
)
from solutions.baselines.contiguous_allocator import ReservationPolicy
from solutions.utils.math_utils import cdiv

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report() -> dict:
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=120,
    )
    return json.loads(completed.stdout)


# workload ------------------------------------------------------------------------------------------------------


def test_workload_is_seeded():
    assert sharegpt_like_requests(50, seed=1) == sharegpt_like_requests(50, seed=1)
    assert sharegpt_like_requests(50, seed=1) != sharegpt_like_requests(50, seed=2)


def test_workload_lengths_fit_max_model_len():
    prompt_lens, output_lens = sample_lengths(20_000, seed=0, max_model_len=2048)
    assert prompt_lens.min() >= 1 and output_lens.min() >= 1
    assert prompt_lens.max() <= 1024 and (prompt_lens + output_lens).max() <= 2048


def test_workload_means_are_close_to_the_papers():
    prompt_lens, output_lens = sample_lengths(100_000, seed=0)
    assert prompt_lens.mean() == pytest.approx(SHAREGPT_MEAN_PROMPT_LEN, rel=0.08)
    assert output_lens.mean() == pytest.approx(SHAREGPT_MEAN_OUTPUT_LEN, rel=0.08)


# closed forms against brute force ------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_expected_paged_utilization_matches_a_brute_force_sum(block_size):
    requests = [Request(0, 1, 1), Request(1, 5, 7), Request(2, 16, 33), Request(3, 17, 100)]
    stored = allocated = 0
    for r in requests:
        for num_tokens in range(r.prompt_len, r.prompt_len + r.output_len):
            stored += num_tokens
            allocated += block_size * cdiv(num_tokens, block_size)
    assert expected_utilization(requests, block_size) == pytest.approx(stored / allocated)


def test_simulations_match_expectations_without_fragmentation():
    requests = sharegpt_like_requests(300, seed=3)
    paged = simulate_paged(requests, block_size=16, num_slots=8192)
    assert paged.utilization == pytest.approx(expected_utilization(requests, 16), abs=0.01)
    max_model_len = simulate_contiguous(requests, ReservationPolicy.MAX_MODEL_LEN, num_slots=8192)
    assert max_model_len.utilization == pytest.approx(
        expected_utilization(requests, ReservationPolicy.MAX_MODEL_LEN), abs=0.01
    )
    assert max_model_len.max_concurrent == 8192 // 2048


def test_simulation_refuses_a_pool_too_small_for_one_request():
    with pytest.raises(ValueError, match="does not fit in an empty pool"):
        simulate_paged([Request(0, 100, 10)], block_size=16, num_slots=64)


# the targets of issue #3 ---------------------------------------------------------------------------------------


def test_report_has_the_documented_shape(report):
    assert report["block_size"] == 16
    assert set(report["utilization"]) == {
        "contiguous_max", "contiguous_pow2", "contiguous_oracle", "paged", "paged_limit"
    }
    assert set(report["max_concurrent"]) == {"contiguous_max", "contiguous_pow2", "contiguous_oracle", "paged"}
    assert set(report["paged_by_block_size"]) == {"8", "16", "32", "64", "128"}
    assert report["paged_by_block_size"]["16"] == report["utilization"]["paged"]


def test_paged_utilization_reaches_the_paper_and_its_own_limit(report):
    utilization = report["utilization"]
    assert utilization["paged"] >= 0.963
    assert abs(utilization["paged"] - utilization["paged_limit"]) <= 0.005


def test_contiguous_policies_waste_more_in_the_expected_order(report):
    utilization = report["utilization"]
    assert utilization["contiguous_max"] <= 0.45
    assert (
        utilization["contiguous_max"]
        < utilization["contiguous_pow2"]
        < utilization["contiguous_oracle"]
        < utilization["paged"]
    )


def test_paged_holds_more_requests_than_every_contiguous_policy(report):
    held = report["max_concurrent"]
    assert all(held["paged"] > held[name] for name in ("contiguous_max", "contiguous_pow2", "contiguous_oracle"))


def test_smaller_blocks_waste_less(report):
    by_size = [report["paged_by_block_size"][str(size)] for size in (8, 16, 32, 64, 128)]
    assert by_size == sorted(by_size, reverse=True)

"""The throughput benchmark's pure-Python parts: how two engines' greedy streams are compared, and its options."""

import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.throughput import flops_per_token, reachable_roofline_fraction, token_agreement


def test_token_agreement_counts_positions_prefixes_and_identical_requests():
    ours = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    theirs = [[1, 2, 3, 4], [5, 0, 7, 8], [0, 9]]  # request 1 parts at token 1 and meets again; request 2 at 0
    agreement = token_agreement(ours, theirs)
    assert agreement["identical_requests"] == 1
    assert agreement["equal_tokens"] == 8 / 10  # 4 + 3 + 1 equal positions of 10
    assert agreement["before_first_divergence"] == 5 / 10  # 4 + 1 + 0: a request counts only up to where it parts


def test_preload_of_a_missing_library_is_refused_by_name():
    """`--preload` re-runs the benchmark under LD_PRELOAD; a path that is no file stops it first, naming the option."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.throughput", "--preload", "/no/such/libtcmalloc.so"],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert run.returncode != 0
    assert "--preload must name a shared library file" in run.stderr and "/no/such/libtcmalloc.so" in run.stderr


def test_reachable_roofline_charges_prompt_tokens_a_forward_pass_without_the_lm_head():
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(10, 20, bias=False)  # 200 weights
            self.lm_head = torch.nn.Linear(20, 50, bias=False)  # 1000 weights

    model = Model()
    assert flops_per_token(model) == 2400
    assert reachable_roofline_fraction(model, 0, 1000) == 1.0  # no prompts: all of the roofline
    # 10 output tokens of 2400 FLOPs are credited; 30 prompt tokens of 400 FLOPs (no LM head) are not
    assert reachable_roofline_fraction(model, 30, 10) == 24000 / (24000 + 12000)

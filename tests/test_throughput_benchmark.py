"""The throughput benchmark's pure-Python parts (how two engines' greedy streams are compared, its options), and its
rows' code paths on tiny models on the CPU (Hugging Face's padded static shapes, the step ledger, the op count)."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.throughput import (
    HF_DYNAMIC,
    best_hf,
    decode_kv_bytes,
    flops_per_token,
    matmul_gflops,
    ops_per_decode_step,
    reachable_roofline_fraction,
    run_hf_systems,
    serial_roofline_fraction,
    step_ledger,
    stream_gbytes_per_s,
    token_agreement,
)
from grading.tiny_models import hf_model, tiny_checkpoint
from solutions import LLM, SamplingParams
from solutions.metrics.stats import STEP_STAGES


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


def test_float16_on_the_cpu_is_refused_by_name():
    run = subprocess.run([sys.executable, "-m", "benchmarks.throughput", "--dtype", "float16"],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert run.returncode != 0
    assert "--dtype float16 needs a GPU" in run.stderr and "float32 or bfloat16" in run.stderr


def test_matmul_rate_is_measured_in_the_runs_dtype():
    for dtype in (torch.float32, torch.bfloat16):
        for packed in (False, True):
            assert matmul_gflops(8, 64, 64, packed, windows=1, seconds=0.02, dtype=dtype) > 0


class TwoLayerModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(10, 20, bias=False)  # 200 weights: 400 FLOPs a token
        self.lm_head = torch.nn.Linear(20, 50, bias=False)  # 1000 weights: 2000 FLOPs a token


def test_reachable_roofline_charges_prompt_tokens_a_forward_pass_without_the_lm_head():
    model = TwoLayerModel()
    assert flops_per_token(model) == 2400
    # One request, no prompt to speak of (1 token) and 1000 outputs: 1000 body passes, 1000 heads, all credited
    assert reachable_roofline_fraction(model, [1], [1000]) == 1.0
    # 10 output tokens of 2400 FLOPs are credited. The work: 30 prompt tokens and 9 fed-back outputs through the
    # body (39 × 400) and 10 LM heads (10 × 2000); the last prompt token's pass makes the first output token.
    assert reachable_roofline_fraction(model, [30], [10]) == 24000 / (39 * 400 + 10 * 2000)
    # Per request: two requests are the sum of their parts
    assert reachable_roofline_fraction(model, [30, 5], [10, 3]) == (13 * 2400) / ((39 + 7) * 400 + 13 * 2000)


def test_decode_kv_bytes_reads_each_context_once_per_decode_token():
    # p = 4, o = 3: decodes 1 and 2 attend to 5 and 6 tokens; the first output token came from the prefill
    assert decode_kv_bytes(100, [4], [3]) == (5 + 6) * 100
    assert decode_kv_bytes(100, [4, 2], [3, 1]) == (5 + 6) * 100  # o = 1: no decode step at all
    assert decode_kv_bytes(100, [2], [4]) == (3 + 4 + 5) * 100


def test_serial_roofline_adds_the_kv_reads_to_the_matmuls():
    model = TwoLayerModel()
    prompt_lens, output_lens = [30], [10]
    matmul_seconds = (39 * 400 + 10 * 2000) / 1e9  # at 1 GFLOP/s
    credited_seconds = 24000 / 1e9
    no_reads = serial_roofline_fraction(model, prompt_lens, output_lens, 0, 1.0, 1.0)
    assert abs(no_reads - reachable_roofline_fraction(model, prompt_lens, output_lens)) < 1e-12
    # 35,600 bytes at 1 GB/s take as long as the matmuls: half of what is reachable
    bound = serial_roofline_fraction(model, prompt_lens, output_lens, 35_600, 1.0, 1.0)
    assert abs(bound - credited_seconds / (matmul_seconds + 35_600 / 1e9)) < 1e-12
    assert abs(bound - reachable_roofline_fraction(model, prompt_lens, output_lens) / 2) < 1e-12


def test_stream_rate_is_a_plausible_memory_bandwidth():
    rate = stream_gbytes_per_s(num_bytes=2**26, repeats=2)
    assert 0.5 < rate < 10_000, rate


def test_matmul_probe_runs_eagerly_and_pre_packed():
    for packed in (False, True):
        assert matmul_gflops(8, 32, 48, packed=packed, windows=2, seconds=0.01) > 0


# --- on tiny models: the rows' code paths run on the CPU ----------------------------------------------------------


def test_hugging_face_rows_run_padded_to_one_shape_and_save_as_json(tmp_path):
    """The GPU section's Hugging Face rows (dynamic cache, static cache + compile in batches of 32 and in one of 64)
    run on the CPU on a tiny model: every request gets its tokens, the padded static shapes generate what the
    dynamic cache does, and the rows are JSON."""
    hf = hf_model(tiny_checkpoint("llama-gqa"))
    prompts = [[(5 * i + j) % 250 + 3 for j in range(4 + 3 * i)] for i in range(5)]
    output_lens = [3, 6, 2, 5, 4]
    systems = run_hf_systems(hf, prompts, output_lens, pad_id=0)
    assert list(systems) == [HF_DYNAMIC, "HF static cache + torch.compile", "HF static + compile, batch 64"]
    for row in systems.values():
        assert row["useful_tokens"] == sum(output_lens) and row["seconds"] > 0
        assert row["outputs"] == systems[HF_DYNAMIC]["outputs"]
    assert "compile_seconds" in systems["HF static + compile, batch 64"]
    assert best_hf(systems) in systems
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(systems))
    assert json.loads(path.read_text())[HF_DYNAMIC]["useful_tokens"] == sum(output_lens)


def test_step_ledger_and_ops_per_decode_step_of_an_engine():
    llm = LLM(str(tiny_checkpoint("llama-gqa")), max_num_seqs=4, max_model_len=256, seed=0)
    llm.generate([[3, 4, 5], [6, 7]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    ledger = step_ledger(llm.llm_engine.stats.steps)
    assert list(ledger) == [*STEP_STAGES, "host"]
    assert ledger["host"] == ledger["schedule"] + ledger["prepare"] + ledger["postprocess"]
    ops = ops_per_decode_step(llm)
    assert ops > 10  # two layers of attention and MLP, the LM head, the sampler: each at least one op
    assert not llm.llm_engine.has_unfinished_requests()  # its request is aborted after the count
    assert ops_per_decode_step(llm) == ops  # the same step, the same ops


def test_cuda_run_without_a_gpu_says_skipped():
    run = subprocess.run([sys.executable, "-m", "benchmarks.throughput", "--device", "cuda", "--quick"],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert run.returncode == 0 and "skipped: no GPU" in run.stdout

"""Tensor parallelism on this machine's CPU: W64 and the decode step at 1 and 2 ranks, what crosses between ranks,
and a paper model of when splitting pays.

    python -m benchmarks.tensor_parallel            # W64 at TP=1 and TP=2, SmolLM2, greedy (several minutes)
    python -m benchmarks.tensor_parallel --quick    # 16 requests of W64's shape
    python -m benchmarks.tensor_parallel --json     # one JSON object
    python -m benchmarks.tensor_parallel --save chapters/09_tensor_parallelism/tensor_parallel.json   # the stored run

Measured, in one run:
    throughput   W64 (`benchmarks/w64.py`) through `LLM(tensor_parallel_size=t)`, t = 1 and 2, output tok/s; the
                 tokens of both runs compared
    step         the engine's median decode step at the batch sizes W64 passes through (from its step ledger)
    all-reduce   the latency of one gloo all-reduce between 2 processes on this machine, at the sizes a step
                 sends (hidden_size floats per token), fitted as alpha + bytes / beta
    matmul       the fp32 rate of one decode token's matmuls at 1 thread and at all threads
Bytes between ranks per token: every layer all-reduces its attention output and its MLP output (hidden_size floats
each), the embedding one more, and each sampled row gathers the vocabulary's logits.

The paper model: a decode step of B tokens at t ranks costs compute F·B / (t · r) — F the FLOPs per token, r one
rank's matmul rate — plus (2L + 1) all-reduces of B·D floats and one gather of B·V logits, each alpha + bytes/beta.
Splitting pays when the compute it removes, F·B·(1 − 1/t)/r, exceeds the communication it adds. On a 2-core
machine the two ranks share the cores that one rank would use, so r halves with t and nothing is removed: the
model predicts a slowdown, and says by how much communication alone costs.
"""

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.w64 import draw_workload

MODEL = "smollm2-135m"
ALL_REDUCE_TOKENS = (1, 8, 64, 256)  # B·D floats per all-reduce, for these batch sizes


def run_w64(tensor_parallel_size: int, prompts: list[list[int]], output_lens: list[int]) -> dict:
    from solutions import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=MODEL, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=1024,
              tensor_parallel_size=tensor_parallel_size)
    setup = time.perf_counter() - start
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    try:
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        engine = llm.llm_engine
        engine.stats.steps.clear()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        decode = [s for s in engine.stats.steps if s.num_prefill_tokens == 0]
        by_batch: dict[int, list[float]] = {}
        for s in decode:
            by_batch.setdefault(s.num_decode_tokens, []).append(sum(s.seconds.values()))
        step_ms = {b: 1e3 * statistics.median(t) for b, t in sorted(by_batch.items()) if b in (1, 8, 32, 64)}
    finally:
        llm.llm_engine.shutdown()  # the workers of tensor_parallel_size > 1 (nothing to do at 1)
    tokens = [o.outputs[0].token_ids for o in outputs]
    return {"tp": tensor_parallel_size, "tok_s": sum(map(len, tokens)) / seconds, "seconds": seconds,
            "setup_seconds": setup, "decode_step_ms": step_ms, "tokens": tokens}


def _all_reduce_probe(rank: int, init_method: str, sizes: list[int], results: "multiprocessing.Queue") -> None:
    from solutions.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)
    init_tensor_parallel(rank, 2, init_method)
    timings = {}
    for size in sizes:
        x = torch.randn(size)
        for _ in range(5):
            torch.distributed.all_reduce(x)
        samples = []
        for _ in range(30):
            start = time.perf_counter()
            torch.distributed.all_reduce(x)
            samples.append(time.perf_counter() - start)
        timings[size] = statistics.median(samples)
    if rank == 0:
        results.put(timings)
    destroy_tensor_parallel()


def measure_all_reduce(hidden_size: int) -> dict:
    """Seconds per all-reduce of B·D floats between 2 processes, and the alpha-beta fit."""
    from solutions.distributed.parallel_state import free_port

    sizes = [b * hidden_size for b in ALL_REDUCE_TOKENS]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [context.Process(target=_all_reduce_probe, args=(r, init_method, sizes, results)) for r in range(2)]
    for p in procs:
        p.start()
    timings = results.get(timeout=120)
    for p in procs:
        p.join()
    nbytes = [4 * s for s in sizes]
    seconds = [timings[s] for s in sizes]
    slope, alpha = np.polyfit(nbytes, seconds, 1)  # least squares: seconds = alpha + bytes * slope
    beta = 1 / slope  # bytes/s
    return {"bytes": nbytes, "seconds": seconds, "alpha_us": 1e6 * alpha, "beta_gb_s": beta / 1e9}


def measure_matmul_rate(model: torch.nn.Module, batch: int = 32) -> dict:
    """GFLOP/s of one decode step's matmuls (every Linear at `batch` rows), at 1 thread and at all threads."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    flops = 2.0 * batch * sum(m.weight.numel() for m in linears)
    rates = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        x = {m.in_features: torch.randn(batch, m.in_features) for m in linears}
        with torch.inference_mode():
            for _ in range(2):
                for m in linears:
                    m(x[m.in_features])
            start = time.perf_counter()
            for _ in range(5):
                for m in linears:
                    m(x[m.in_features])
        rates[threads] = flops * 5 / (time.perf_counter() - start) / 1e9
    torch.set_num_threads(os.cpu_count() or 1)
    return {"flops_per_token": flops / batch, "gflops_by_threads": rates}


def model_step_ms(batch: int, tp: int, flops_per_token: float, rate_gflops: float, layers: int, hidden: int,
                  vocab: int, alpha_us: float, beta_gb_s: float) -> dict:
    """The paper model's decode step (ms) at `tp` ranks: compute, and communication (zero at 1 rank)."""
    compute = flops_per_token * batch / (tp * rate_gflops * 1e9)
    if tp == 1:
        return {"compute_ms": 1e3 * compute, "comm_ms": 0.0}
    def collective(nbytes: float) -> float:
        return alpha_us * 1e-6 + nbytes / (beta_gb_s * 1e9)
    comm = (2 * layers + 1) * collective(4 * batch * hidden) + collective(4 * batch * vocab)
    return {"compute_ms": 1e3 * compute, "comm_ms": 1e3 * comm}


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (a stored run names its machine)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown CPU"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")


def run(quick: bool) -> dict:
    from solutions.model.loader import load_model

    model = load_model(MODEL)
    config = model.config
    prompts, output_lens = draw_workload(config.vocab_size, num_requests=16 if quick else 64)
    runs = [run_w64(tp, prompts, output_lens) for tp in (1, 2)]
    agree = sum(a == b for a, b in zip(runs[0]["tokens"], runs[1]["tokens"], strict=True))
    all_reduce = measure_all_reduce(config.hidden_size)
    matmul = measure_matmul_rate(model)
    threads = os.cpu_count() or 1
    rates = matmul["gflops_by_threads"]
    rate = {1: rates[threads], 2: rates.get(max(1, threads // 2), rates[1])}  # one rank's rate: its share of the cores
    bytes_per_token = 4 * ((2 * config.num_hidden_layers + 1) * config.hidden_size)
    paper = {
        batch: {tp: model_step_ms(batch, tp, matmul["flops_per_token"], rate[tp], config.num_hidden_layers, config.hidden_size, config.vocab_size,
                                  all_reduce["alpha_us"], all_reduce["beta_gb_s"]) for tp in (1, 2)}
        for batch in (1, 8, 32, 64)
    }
    for r in runs:
        del r["tokens"]
    return {"model": MODEL, "machine": cpu_name(), "date": time.strftime("%Y-%m-%d"), "num_requests": len(prompts),
            "cpu_count": threads, "runs": runs,
            "requests_with_equal_tokens": agree, "all_reduce": all_reduce, "matmul": matmul,
            "all_reduce_bytes_per_token": bytes_per_token, "logits_gather_bytes_per_sampled_row": 4 * config.vocab_size,
            "paper_model_step_ms": paper}


def table(result: dict) -> str:
    result = json.loads(json.dumps(result))  # one form, fresh or stored: JSON's keys are strings
    one, two = result["runs"]
    lines = [f"W{result['num_requests']}, {result['model']}, greedy, {result['cpu_count']} cores "
             f"({result.get('machine', 'machine not recorded')}, {result.get('date', 'date not recorded')})",
             f"{'ranks':>5} {'tok/s':>8} {'vs TP=1':>8}   median decode step ms by batch",
             *(f"{r['tp']:>5} {r['tok_s']:>8.1f} {r['tok_s'] / one['tok_s']:>7.2f}×   "
               + ", ".join(f"{b}: {ms:.1f}" for b, ms in r["decode_step_ms"].items()) for r in (one, two)),
             f"requests with equal tokens at 1 and 2 ranks: {result['requests_with_equal_tokens']} of {result['num_requests']}"]
    ar = result["all_reduce"]
    lines.append(f"all-reduce between 2 processes: alpha {ar['alpha_us']:.0f} µs + bytes / {ar['beta_gb_s']:.2f} GB/s; "
                 f"per token {result['all_reduce_bytes_per_token'] / 1024:.0f} KiB all-reduced, "
                 f"{result['logits_gather_bytes_per_sampled_row'] / 1024:.0f} KiB of logits gathered per sampled row")
    mm = result["matmul"]["gflops_by_threads"]
    lines.append("matmul rate of a decode step (batch 32): " + ", ".join(f"{t} thread(s) {g:.0f} GFLOP/s" for t, g in mm.items()))
    lines.append("paper model (matmuls and collectives only) beside the measured decode step, ms:")
    lines.append(f"{'batch':>5} {'TP=1 model':>11} {'measured':>9} {'TP=2 model (compute + comm)':>30} {'measured':>9}")
    for batch, by_tp in result["paper_model_step_ms"].items():
        a, b = by_tp["1"], by_tp["2"]
        m1, m2 = (r["decode_step_ms"].get(batch) for r in (one, two))
        lines.append(f"{batch:>5} {a['compute_ms']:>11.1f} {'-' if m1 is None else f'{m1:.1f}':>9} "
                     f"{b['compute_ms'] + b['comm_ms']:>10.1f} ({b['compute_ms']:.1f} + {b['comm_ms']:.1f}){'':>6} "
                     f"{'-' if m2 is None else f'{m2:.1f}':>9}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 requests instead of 64")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--save", type=Path, help="also write the JSON object to this file")
    args = parser.parse_args()
    result = run(args.quick) | {"command": "python -m benchmarks.tensor_parallel " + " ".join(sys.argv[1:])}
    print(json.dumps(result) if args.json else table(result))
    if args.save:
        args.save.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

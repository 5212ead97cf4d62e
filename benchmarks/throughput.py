"""Throughput of continuous batching against the baselines a user would reach for, side by side in one run.

    python -m benchmarks.throughput              # workload W64, a table (about 20 minutes on 2 cores)
    python -m benchmarks.throughput --quick      # W16 with short lengths, a few minutes
    python -m benchmarks.throughput --json       # one JSON object (the table's figures)
    python -m benchmarks.throughput --save chapters/05_continuous_batching/throughput_cpu.json
    python -m benchmarks.throughput --vllm-python VENV/bin/python --vllm-preload TCMALLOC:VENV/lib/libiomp5.so \
        --preload TCMALLOC     # every system on the allocator vLLM's CPU docs prescribe
    python -m benchmarks.throughput --dtype bfloat16 --vllm-python VENV/bin/python   # every row in bf16
    python -m benchmarks.throughput --device cuda   # W64 on a GPU (prints "skipped: no GPU" and exits 0 without)

Workload W64 (`benchmarks/w64.py`, drawn the same way for every system, vLLM included): 64 requests, prompts of
random token ids with lengths uniform in [16, 256], outputs uniform in [16, 256], EOS ignored. Useful tokens =
the requested output tokens; a baseline that generates more (a static batch runs to its longest request) gets no
credit for the extra. Every system runs SmolLM2-135M in one dtype (`--dtype`: fp32 by default, or bf16, which a
CPU with AVX512-BF16 or AMX multiplies in hardware) on this machine's cores, one after the other, so the ratios
compare like with like:

- engine, torch backend, eager:      chapter 5's engine (`LLM.generate`, max_num_seqs 64), as the chapters build it;
- engine, inductor backend, eager:   the same with decode attention that reads the paged cache in place, and
                                     blocks of 128 tokens (vLLM's CPU default, which its row below uses too: a
                                     sequence's K/V in fewer, longer runs of memory);
- engine, inductor backend, compiled: that, and the forward pass compiled by `torch.compile` (weights frozen and
                                     pre-packed for oneDNN, linears sharing an input joined); its compile time,
                                     at start-up, is printed, not timed;
- HF generate:                       Hugging Face `generate`, static batches of 32 with left padding, each to its longest;
- HF continuous batching:            Hugging Face's `ContinuousBatchingManager`, per-request max_new_tokens;
- chapter 3 static paged loop:       one batch of all 64, run to the longest;
- vLLM's CPU build:                  `benchmarks/vllm_cpu.py` in vLLM's own venv (`--vllm-python`), with the
                                     settings its CPU docs recommend; without the option the row says skipped.

The allocator is part of a CPU engine's speed. vLLM's CPU docs prescribe TCMalloc (`LD_PRELOAD`) over glibc's
malloc; `--preload` gives this benchmark's own rows the same, by running it again with `LD_PRELOAD` set (a
library cannot replace malloc once the process runs). The table says which allocator each side ran on.

The roofline: the machine's matmul rate in the run's dtype bounds decode, since every generated token costs at least
2 × (weights it multiplies) FLOPs. The rate is the best of three probes (a decode step's shape eagerly and
pre-packed as the fast path runs it, and a 1024³ GEMM), each the best of five windows, at the start of the run and
at its end: one probe in one window swung from 196 to 130 GFLOP/s between two sittings on the same machine type.
`roofline_fraction` = that per-token cost × engine tokens/s ÷ matmul FLOP/s, over the whole workload (prefill and
the tail included in the time, not in the numerator). Since the prompts' FLOPs are not credited, not all of it is
reachable: `reachable_roofline_fraction` is what an engine would reach if every matmul, the prompts' included, ran
at the roofline's rate and nothing else took any time, and `serial_roofline_fraction` adds the one other cost no
engine escapes, the decodes' reads of the K/V cache (each context once per decode token, at the machine's measured
streaming rate), done after the matmuls as every layer does them. Then the decode step time with exactly N
sequences of context L running, before (torch, eager) and after (the fast path).

What a step costs, per engine row: the step ledger (`SchedulerStats.seconds`, mean ms per step over the workload:
schedule, prepare inputs, forward, sample, postprocess, and `host` = schedule + prepare + postprocess, the Python
around the model), and the operators one decode step runs (`ops_per_decode_step`, counted with torch.profiler;
what exactly is counted is in its docstring). A regression in either shows here before it shows in tok/s.

On a GPU (`--device cuda`, `--dtype`, default bfloat16), the same W64, one system after the other:

- engine, CUDA graphs:  `LLM(device="cuda", attention_backend="triton")`, decode steps replayed as graphs;
- engine, eager:        the same with `enforce_eager=True` (every kernel launched from Python);
- HF generate:          static batches of 32 as above, dynamic cache, no compilation;
- HF static + compile:  the same batches with `cache_implementation="static"`, which makes `generate` compile the
                        decode forward with torch.compile, every batch padded to one shape (the longest prompt and
                        output) so that it compiles once: a first pass over the workload compiles, the second is
                        timed; the compile time (first pass minus second) is printed apart, not counted in tok/s;
- HF static + compile, batch 64: the same in one batch of all 64, Hugging Face at its best on this workload.

The speedups are taken against the best Hugging Face row.

Each engine row also prints its step ledger (below), and the eager one the CUDA kernels one decode step launches.
Then the decode step time against the batch size (exactly N sequences of 128 tokens running), graphs on and off,
beside the launch-bound floor: the kernels one eager decode step launches (counted with the profiler) times the
measured cost of launching one small kernel from Python. An eager step near that floor is bound by launches, not
by the GPU; a graph replay removes most of it. One table, saved as JSON (`--save`, default throughput_cuda.json).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import torch

from benchmarks.machine import threads_note
from benchmarks.w64 import draw_workload

MODEL = "smollm2-135m"


def matmul_gflops(m: int, k: int, n: int, packed: bool = False, windows: int = 5, seconds: float = 0.3,
                  dtype: torch.dtype = torch.float32) -> float:
    """Measured matmul rate in `dtype` at (m×k)·(k×n), GFLOP/s: the best of `windows` timed windows, since a
    roofline is the most the machine does (a window that another process slowed says nothing about the machine).
    `packed`: the (k×n) weight pre-packed into oneDNN's blocked layout, as the fast path's frozen graph calls its
    linears."""
    x = torch.randn(m, k, dtype=dtype)
    if packed:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, dtype=dtype), None)

        def matmul() -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    else:
        weight = torch.randn(k, n, dtype=dtype)

        def matmul() -> torch.Tensor:
            return x @ weight
    for _ in range(3):
        matmul()
    best = 0.0
    for _ in range(windows):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            matmul()
            count += 1
        best = max(best, 2 * m * k * n * count / (time.perf_counter() - start) / 1e9)
    return best


def matmul_probes(dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """The matmul rates the roofline takes its peak from: a decode step's shape as PyTorch runs it eagerly and as
    the fast path runs it (pre-packed), and a large square GEMM, in `dtype`."""
    probes = {"64x576x1536": matmul_gflops(64, 576, 1536, dtype=dtype),
              "1024x1024x1024": matmul_gflops(1024, 1024, 1024, dtype=dtype)}
    if torch.backends.mkldnn.is_available():
        probes["64x576x1536 pre-packed"] = matmul_gflops(64, 576, 1536, packed=True, dtype=dtype)
    return probes


def flops_per_token(model: torch.nn.Module) -> float:
    """2 × the weights a decode token multiplies: every Linear, the LM head included (embedding lookup is free)."""
    return 2.0 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def workload_matmul_flops(model: torch.nn.Module, prompt_lens: list[int], output_lens: list[int]) -> float:
    """Every matmul FLOP the workload needs. A request of p prompt tokens and o output tokens runs p + o - 1 tokens
    through the layers (its prompt, then each output token but the last is fed back) and o of them through the LM
    head (the prompt's last position, then each decode)."""
    per_token = flops_per_token(model)
    head = 2.0 * model.lm_head.weight.numel()
    return sum((p + o - 1) * (per_token - head) + o * head for p, o in zip(prompt_lens, output_lens, strict=True))


def reachable_roofline_fraction(model: torch.nn.Module, prompt_lens: list[int], output_lens: list[int]) -> float:
    """The most of the roofline a workload with prompts allows: its matmuls, the prompts' included, at the
    roofline's rate, and nothing else taking any time. The roofline credits each output token a whole forward pass;
    the prompts' passes are work it does not credit."""
    return sum(output_lens) * flops_per_token(model) / workload_matmul_flops(model, prompt_lens, output_lens)


def decode_kv_bytes(kv_bytes_per_token: int, prompt_lens: list[int], output_lens: list[int]) -> int:
    """The K/V the workload's decode steps read at the least: each context once per decode token, every layer.

    A request's first output token comes from its prefill; its decode j (1 <= j < o) attends to p + j tokens.
    `kv_bytes_per_token`: K and V of one token in every layer (`KVCache.bytes_per_block(config, 1)`)."""
    decodes = zip(prompt_lens, output_lens, strict=True)
    return kv_bytes_per_token * sum((o - 1) * p + (o - 1) * o // 2 for p, o in decodes)


def stream_gbytes_per_s(num_bytes: int = 2**30, repeats: int = 5) -> float:
    """Measured rate of reading memory, GB/s: the best of `repeats` sums over an fp32 tensor far larger than the
    caches, as a decode step's K/V is (W64's decodes read tens of GB of it)."""
    x = torch.ones(num_bytes // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best / 1e9


def serial_roofline_fraction(
    model: torch.nn.Module, prompt_lens: list[int], output_lens: list[int], kv_bytes: int, gflops: float,
    gbytes_per_s: float,
) -> float:
    """The most of the roofline an engine that attends and multiplies one after the other can reach: every matmul
    at the roofline's rate (`gflops`), then the decodes' `kv_bytes` read once at the streaming rate, and nothing
    else taking any time. Tighter than `reachable_roofline_fraction`: attention's reads are a cost too."""
    seconds = workload_matmul_flops(model, prompt_lens, output_lens) / (gflops * 1e9) + kv_bytes / (gbytes_per_s * 1e9)
    return sum(output_lens) * flops_per_token(model) / (gflops * 1e9) / seconds


REFERENCE = "engine, torch backend, eager (chapter 5)"
FAST = "engine, inductor backend, compiled"
ENGINES = {  # the engine three ways: as chapter 5 builds it, attention in place only, then compiled as well
    REFERENCE: dict(enforce_eager=True),
    "engine, inductor backend, eager": dict(attention_backend="inductor", block_size=128, enforce_eager=True),
    FAST: dict(attention_backend="inductor", block_size=128),
}
CURVES = (REFERENCE, FAST)  # the engines whose decode step cost is measured
VLLM = "vLLM's CPU build (vllm-cpu 0.32.0)"


def engine_core(llm):
    """The engine core behind an `LLM`, through its in-process client (its scheduler and its model executor,
    whose runner holds the model)."""
    return llm.llm_engine.engine_core


def run_engine(prompts: list[list[int]], output_lens: list[int], **llm_kwargs) -> dict:
    """The engine on the workload (after a warm-up), with `LLM` options: tok/s, the step ledger, the tokens.

    `setup_seconds` is the construction (load, KV cache, and with the compiled path its compile); the compile
    alone is `compile_seconds`."""
    from solutions import LLM, SamplingParams
    from solutions.metrics.stats import STEP_STAGES

    start = time.perf_counter()
    # 2 GiB of KV cache: room for the cost curve's 64 sequences of 512 tokens (W64 itself needs under 1 GiB)
    llm = LLM(model=MODEL, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=1024, kv_cache_memory_bytes=2**31,
              **llm_kwargs)
    setup = time.perf_counter() - start
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    # Warm-up (first-call allocations, the C kernel's build) on prompts of its own, as vLLM's run warms up: a
    # workload prompt here would be a prefix-cache hit in the timed run.
    llm.generate([list(range(1000, 1000 + n)) for n in (16, 200)], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)
    engine = llm.llm_engine
    engine.stats.steps.clear()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    steps = engine.stats.steps
    breakdown = {stage: sum(s.seconds[stage] for s in steps) for stage in STEP_STAGES}
    step_ms = step_ledger(steps)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == sum(output_lens), "every request generates exactly its max_tokens (EOS ignored)"
    runner = engine_core(llm).model_executor.model_runner
    compiled = runner.compiled_forward
    return {"seconds": seconds, "useful_tokens": generated, "steps": len(steps), "breakdown": breakdown,
            "step_ms": step_ms, "setup_seconds": setup,
            "compile_seconds": compiled.compile_seconds if compiled else None,
            "model": runner.model, "outputs": [o.outputs[0].token_ids for o in outputs], "llm": llm}


def step_ledger(steps: list) -> dict[str, float]:
    """Milliseconds per step in each stage of the engine's step ledger (`SchedulerStats.seconds`: schedule, prepare
    inputs, forward, sample, postprocess), the mean over `steps`, and `host`: schedule + prepare + postprocess, the
    Python work around the model, which must not grow with the contexts (`python -m benchmarks.engine_core
    --host-time` shows it against the context length)."""
    from solutions.metrics.stats import STEP_STAGES

    ledger = {stage: 1e3 * sum(s.seconds[stage] for s in steps) / len(steps) for stage in STEP_STAGES}
    return ledger | {"host": ledger["schedule"] + ledger["prepare"] + ledger["postprocess"]}


def print_ledger(rows: dict[str, dict], ops_label: str) -> None:
    """The engine rows' step ledgers side by side, with each row's operator (or kernel) count per decode step."""
    print(f"{'ms per step (mean)':<42}{'schedule':>9}{'prepare':>9}{'forward':>9}{'sample':>8}{'postproc':>9}"
          f"{'host':>7}  {ops_label}")
    for name, row in rows.items():
        ms = row["step_ms"]
        ops = row.get("ops_per_decode_step")
        print(f"{name:<42}{ms['schedule']:9.2f}{ms['prepare']:9.2f}{ms['forward']:9.2f}{ms['sample']:8.2f}"
              f"{ms['postprocess']:9.2f}{ms['host']:7.2f}  {'' if ops is None else ops}")


def preloaded(ld_preload: str | None) -> str:
    """The file names in an LD_PRELOAD value ("none" for glibc's malloc alone), for the table and the JSON."""
    return ", ".join(Path(path).name for path in ld_preload.split(":")) if ld_preload else "none"


def run_vllm(python: str, preload: str | None, num_requests: int, low: int, high: int, dtype: str) -> dict:
    """`benchmarks/vllm_cpu.py` in vLLM's venv, now: its tok/s and greedy tokens (the same draw of the workload)."""
    script = Path(__file__).with_name("vllm_cpu.py")
    dump = Path(os.environ.get("TMPDIR", "/tmp")) / "vllm_cpu_tokens.json"
    env = {**os.environ, **({"LD_PRELOAD": preload} if preload else {})}
    command = [python, str(script), "--requests", str(num_requests), "--low", str(low), "--high", str(high),
               "--dtype", dtype, "--dump", str(dump)]
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    found = re.search(r"vLLM-CPU W64: (\d+) useful tokens in ([\d.]+) s", run.stdout)
    if run.returncode != 0 or not found:
        sys.stderr.write(run.stdout[-3000:] + run.stderr[-3000:])
        raise SystemExit(f"vLLM's run failed (exit {run.returncode}): {' '.join(command)}")
    return {"useful_tokens": int(found[1]), "seconds": float(found[2]), "outputs": json.loads(dump.read_text()),
            "preload": env.get("LD_PRELOAD")}  # inherited from this process when not given


def run_hf_generate(hf, prompts: list[list[int]], output_lens: list[int], pad_id: int, batch_size: int = 32,
                    width: int | None = None, max_new_tokens: int | None = None, **generate_kwargs) -> dict:
    """Static batches as a user writes them: left padding, each batch generates up to its longest request.

    `width` and `max_new_tokens` (default: each batch's own) pad every batch to one shape, so that a compiled
    forward over a static cache compiles once. Runs on the model's device."""
    device = hf.device
    start, useful, tokens = time.perf_counter(), 0, []
    for first in range(0, len(prompts), batch_size):
        batch, lens = prompts[first : first + batch_size], output_lens[first : first + batch_size]
        batch_width = width or max(len(p) for p in batch)
        new_tokens = max_new_tokens or max(lens)
        input_ids = torch.tensor([[pad_id] * (batch_width - len(p)) + p for p in batch], device=device)
        attention_mask = torch.tensor([[0] * (batch_width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = hf.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_id,
                              **generate_kwargs)
        useful += sum(min(n, out.shape[1] - batch_width) for n in lens)
        tokens += [row[batch_width : batch_width + n] for row, n in zip(out.tolist(), lens, strict=True)]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - start, "useful_tokens": useful, "outputs": tokens}


def run_hf_generate_batch(hf, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """Hugging Face's own continuous batching, one request per prompt with its own max_new_tokens."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=max(output_lens))
    start = time.perf_counter()
    results = {}
    with hf.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, output_lens, strict=True)]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
    seconds = time.perf_counter() - start
    useful = sum(min(len(results[i].generated_tokens), n) for i, n in zip(ids, output_lens, strict=True))
    return {"seconds": seconds, "useful_tokens": useful}


def run_static_paged(model, prompts: list[list[int]], output_lens: list[int]) -> dict:
    from solutions.baselines.paged_generation import generate_paged

    start = time.perf_counter()
    outputs = generate_paged(model, prompts, max(output_lens))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "useful_tokens": sum(min(len(o), n) for o, n in zip(outputs, output_lens, strict=True))}


def step_cost_curve(llm, num_running: list[int], context_lens: list[int], num_steps: int = 8) -> list[dict]:
    """Decode step time with exactly N sequences of context about L running (prompts prefilled first, untimed).

    Every request asks for more tokens than the prefill and the timed steps produce (the first prompts done decode
    while the rest prefill), so none finishes while timed; they are aborted afterwards.
    """
    from solutions import SamplingParams

    engine, scheduler, rows = llm.llm_engine, engine_core(llm).scheduler, []
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    for context_len in context_lens:
        for n in num_running:
            ids = [f"curve-{context_len}-{n}-{i}" for i in range(n)]
            for i, request_id in enumerate(ids):
                engine.add_request(request_id, [100 + (i + j) % 1000 for j in range(context_len)], params)
            while any(s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running) or scheduler.waiting:
                engine.step()
            times = []
            for _ in range(num_steps):
                assert len(scheduler.running) == n and not scheduler.waiting, "all N run at once"
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            engine.abort_request(ids)
            step_ms = 1000 * float(np.median(times))
            rows.append({"running": n, "context": context_len, "step_ms": step_ms, "ms_per_token": step_ms / n})
    return rows


def ops_per_decode_step(llm) -> int:
    """Operators one decode step of one sequence of 128 tokens runs on the CPU (as `launch_floor` counts kernels on a
    GPU), from torch.profiler's CPU trace of `engine.step()`: its outermost events, those no other event encloses.
    Eager, each is an ATen op called from Python (the model's, the backend's, the sampler's; an op's own sub-ops,
    linear's addmm, are its body, not counted again). Compiled (inductor), the forward pass is one graph call whose
    fused C++ kernels the profiler does not see: it counts as two (`TorchDynamo Cache Lookup`, its guards, and
    `Torch-Compiled Region`), beside the ops outside the graph (the inputs' tensors, the sampler's argmax)."""
    from torch.profiler import ProfilerActivity, profile

    from solutions import SamplingParams

    engine = llm.llm_engine
    engine.add_request("ops", list(range(100, 228)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()  # a first decode, so that one-time work (a kernel's first build) stays out of the count
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    engine.abort_request("ops")
    return sum(1 for event in prof.events() if event.cpu_parent is None)


# --- on a GPU ---------------------------------------------------------------------------------------------------


def run_engine_cuda(prompts: list[list[int]], output_lens: list[int], dtype: str, enforce_eager: bool) -> dict:
    """The engine on the GPU with the Triton backend, graphs on or off: tok/s over the workload after a warm-up."""
    from solutions import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=MODEL, device="cuda", dtype=dtype, attention_backend="triton", max_num_seqs=64,
              max_num_batched_tokens=2048, max_model_len=1024, kv_cache_memory_bytes=2**31, enforce_eager=enforce_eager)
    setup = time.perf_counter() - start  # load + KV cache + (graphs on) capture of every batch size
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    # Warm-up (Triton compiles the prefill kernels) on prompts of its own: a workload prompt would be a prefix hit.
    llm.generate([list(range(1000, 1000 + n)) for n in (16, 200)], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)
    torch.cuda.synchronize()
    llm.llm_engine.stats.steps.clear()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == sum(output_lens), "every request generates exactly its max_tokens (EOS ignored)"
    return {"seconds": seconds, "useful_tokens": generated, "setup_seconds": setup, "llm": llm,
            "step_ms": step_ledger(llm.llm_engine.stats.steps), "outputs": [o.outputs[0].token_ids for o in outputs]}


def launch_floor(llm) -> dict:
    """Kernels launched by one eager decode step of one sequence (profiler count) × the measured cost of one launch."""
    from torch.profiler import ProfilerActivity, profile

    from solutions import SamplingParams

    engine, runner = llm.llm_engine, engine_core(llm).model_executor.model_runner
    engine.add_request("floor", list(range(100, 228)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()  # the prefill
    graphs, runner.cuda_graphs = runner.cuda_graphs, None  # this step eagerly
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    runner.cuda_graphs = graphs
    engine.abort_request("floor")
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                  and not e.name.startswith(("Memcpy", "Memset")))  # kernels only, not the copies
    x = torch.zeros(1, device="cuda")
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    reps, start = 2000, time.perf_counter()
    for _ in range(reps):
        x.add_(1)  # one tiny kernel per call: the launch path, not the GPU, is what is timed
    torch.cuda.synchronize()
    launch_us = (time.perf_counter() - start) / reps * 1e6
    return {"kernels_per_step": kernels, "launch_us": launch_us, "floor_ms": kernels * launch_us / 1e3}


def token_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far two engines' greedy streams agree: the share of positions with equal tokens, the share of tokens
    generated before each request's first divergence (after it the two continue different texts), and the number
    of requests that agree throughout."""
    total = sum(map(len, ours))
    equal = sum(a == b for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y))
    prefix = 0
    for x, y in zip(ours, theirs, strict=True):
        prefix += next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
    identical = sum(x == y for x, y in zip(ours, theirs, strict=True))
    return {"equal_tokens": equal / total, "before_first_divergence": prefix / total, "identical_requests": identical}


def run_hf_static_compiled(
    hf, prompts: list[list[int]], output_lens: list[int], pad_id: int, batch_size: int = 32
) -> dict:
    """HF generate with a static cache, which on a GPU makes it compile the decode forward with torch.compile, every
    batch padded to one shape (the longest prompt, the longest output) so that it compiles once: a first pass over
    the workload compiles and warms up, the second is timed. `compile_seconds`: the first pass's time less the
    second's. On the CPU `generate` does not compile (its auto-compile is for accelerators); the same code runs
    there uncompiled, which is how the tests exercise it."""
    shape = dict(batch_size=batch_size, width=max(map(len, prompts)), max_new_tokens=max(output_lens),
                 cache_implementation="static")
    first = run_hf_generate(hf, prompts, output_lens, pad_id, **shape)["seconds"]
    result = run_hf_generate(hf, prompts, output_lens, pad_id, **shape)
    return {**result, "compile_seconds": first - result["seconds"]}


HF_DYNAMIC = "HF generate (dynamic cache)"


def run_hf_systems(hf, prompts: list[list[int]], output_lens: list[int], pad_id: int) -> dict[str, dict]:
    """Hugging Face `generate` three ways on the model's device, each a row: dynamic cache in static batches of 32
    (as a user writes it), then a static cache with torch.compile in batches of 32 and in one batch of 64."""
    run_hf_generate(hf, prompts[:2], [4, 4], pad_id)  # warm-up: cuBLAS handles, kernel selection, allocator
    return {
        HF_DYNAMIC: run_hf_generate(hf, prompts, output_lens, pad_id),
        "HF static cache + torch.compile": run_hf_static_compiled(hf, prompts, output_lens, pad_id),
        "HF static + compile, batch 64": run_hf_static_compiled(hf, prompts, output_lens, pad_id, batch_size=64),
    }


def best_hf(systems: dict[str, dict]) -> str:
    """The fastest Hugging Face row (most useful tokens per second): what the engine's speedups are taken against."""
    return max((name for name in systems if name.startswith("HF")),
               key=lambda name: systems[name]["useful_tokens"] / systems[name]["seconds"])


def cuda_main(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        print("skipped: no GPU (torch.cuda.is_available() is False); "
              "the CPU benchmark is `python -m benchmarks.throughput`")
        return
    from transformers import AutoModelForCausalLM

    from solutions.model.loader import load_tokenizer, resolve_model

    torch.manual_seed(0)
    num_requests, low, high = (16, 16, 64) if args.quick else (64, 16, 256)
    tokenizer = load_tokenizer(MODEL)
    prompts, output_lens = draw_workload(len(tokenizer), num_requests, low, high)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    systems: dict[str, dict] = {}
    curves: dict[str, list[dict]] = {}
    running = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= num_requests or n == 1]
    floor = None
    for name, eager in (("engine, CUDA graphs", False), ("engine, eager", True)):
        result = run_engine_cuda(prompts, output_lens, args.dtype, enforce_eager=eager)
        curves[name] = step_cost_curve(result["llm"], running, [128])
        if eager:
            floor = launch_floor(result["llm"])
        systems[name] = result
        del result["llm"]
        torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), dtype=getattr(torch, args.dtype)).to("cuda").eval()
    systems |= run_hf_systems(hf, prompts, output_lens, pad_id)
    systems["engine, eager"]["ops_per_decode_step"] = floor["kernels_per_step"]

    engine_tokens = systems["engine, CUDA graphs"]["outputs"]
    graphs_equal_eager = engine_tokens == systems["engine, eager"]["outputs"]
    agreement = token_agreement(engine_tokens, systems[HF_DYNAMIC]["outputs"])
    for result in systems.values():
        result.pop("outputs", None)
    summary = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype,
        "workload": {"requests": num_requests, "prompt_len": [low, high], "output_len": [low, high],
                     "useful_tokens": sum(output_lens)},
        "systems": {name: {"tok_s": r["useful_tokens"] / r["seconds"], **r} for name, r in systems.items()},
        "best_hf": best_hf(systems),
        "graphs_tokens_equal_eager": graphs_equal_eager,
        "agreement_with_hf": agreement,
        "step_time_vs_batch": curves,
        "launch_floor": floor,
    }
    save = args.save or Path("throughput_cuda.json")
    save.write_text(json.dumps(summary, indent=1) + "\n")
    if args.json:
        print(json.dumps(summary))
        return
    print(f"{summary['device']}, torch {summary['torch']}, SmolLM2-135M {args.dtype}; "
          f"workload: {num_requests} requests, prompts and outputs uniform in [{low}, {high}] tokens, {sum(output_lens)} useful output tokens\n")
    print(f"{'system':<36}{'tok/s':>10}{'× best HF':>11}  notes (best HF: {summary['best_hf']})")
    base = summary["systems"][summary["best_hf"]]["tok_s"]
    for name, row in summary["systems"].items():
        note = (f"setup {row['setup_seconds']:.1f} s" if "setup_seconds" in row else
                f"compile {row['compile_seconds']:.1f} s (not in tok/s)" if "compile_seconds" in row else "")
        print(f"{name:<36}{row['tok_s']:10.0f}{row['tok_s'] / base:10.2f}×  {note}")
    print()
    print_ledger({name: row for name, row in summary["systems"].items() if "step_ms" in row},
                 "CUDA kernels per eager decode step")
    print(f"\ngreedy tokens, graphs on == off: {graphs_equal_eager}")
    print(f"greedy tokens against HF generate ({args.dtype}): {agreement['equal_tokens']:.1%} of positions equal, "
          f"{agreement['before_first_divergence']:.1%} of tokens before a request's first divergence, "
          f"{agreement['identical_requests']} of {num_requests} requests identical")
    print(f"\ndecode step time, N sequences of 128 tokens running (ms); launch-bound floor of an eager step: "
          f"{floor['kernels_per_step']} kernels × {floor['launch_us']:.1f} µs = {floor['floor_ms']:.2f} ms")
    print(f"{'N':>4}{'graphs':>10}{'eager':>10}")
    for on, off in zip(curves["engine, CUDA graphs"], curves["engine, eager"], strict=True):
        print(f"{on['running']:>4}{on['step_ms']:>10.2f}{off['step_ms']:>10.2f}")
    print(f"\nsaved to {save}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="W16 with lengths in [16, 64]: under two minutes")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--save", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the GPU comparison (W64)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="every row's dtype (default: float32 on the CPU, bfloat16 on a GPU; float16 GPU only)")
    parser.add_argument("--vllm-python", help="the python of a venv with vLLM's CPU build: adds its row (CPU only)")
    parser.add_argument("--vllm-preload", help="LD_PRELOAD for vLLM's run (its docs: tcmalloc, then libiomp5.so)")
    parser.add_argument("--preload", help="LD_PRELOAD for this benchmark's own rows (the engine, HF, chapter 3), "
                        "e.g. the tcmalloc of --vllm-preload, so that both sides run on the same allocator")
    args = parser.parse_args()
    if args.preload and os.environ.get("LD_PRELOAD") != args.preload:  # only a new process can preload
        if not Path(args.preload).is_file():
            raise SystemExit(f"--preload must name a shared library file, got {args.preload!r}")
        command = [sys.executable, "-m", "benchmarks.throughput", *sys.argv[1:]]
        os.execve(sys.executable, command, {**os.environ, "LD_PRELOAD": args.preload})
    if args.device == "cuda":
        args.dtype = args.dtype or "bfloat16"
        cuda_main(args)
        return
    args.dtype = args.dtype or "float32"
    if args.dtype == "float16":
        parser.error("--dtype float16 needs a GPU (--device cuda); on the CPU: float32 or bfloat16")
    dtype = getattr(torch, args.dtype)

    from transformers import AutoModelForCausalLM

    from solutions.attention.paged import KVCache
    from solutions.model.loader import load_tokenizer, resolve_model

    torch.manual_seed(0)
    num_requests, low, high = (16, 16, 64) if args.quick else (64, 16, 256)
    tokenizer = load_tokenizer(MODEL)
    prompts, output_lens = draw_workload(len(tokenizer), num_requests, low, high)
    gflops = matmul_probes(dtype)  # again at the end: the best of both is the roofline's rate
    stream = stream_gbytes_per_s()
    running, contexts = ([1, 8, 32, 64], [128, 512]) if not args.quick else ([1, 8], [64])

    # vLLM first, while this process holds no KV cache: under TCMalloc (--preload) the memory the rows below free
    # goes back to the OS only slowly, and vLLM's worker refuses to start without free memory for its own cache.
    vllm = (run_vllm(args.vllm_python, args.vllm_preload, num_requests, low, high, args.dtype) if args.vllm_python
            else None)
    engines = {}
    for name, kwargs in ENGINES.items():
        result = run_engine(prompts, output_lens, dtype=args.dtype, **kwargs)
        if name in CURVES:
            result["step_cost_curve"] = step_cost_curve(result["llm"], running, contexts)
        result["ops_per_decode_step"] = ops_per_decode_step(result["llm"])
        model = result.pop("model")
        del result["llm"]
        engines[name] = result
    hf = AutoModelForCausalLM.from_pretrained(
        resolve_model(MODEL), dtype=dtype, attn_implementation="eager"
    ).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    hf_static = run_hf_generate(hf, prompts, output_lens, pad_id)
    hf_cb = run_hf_generate_batch(hf, prompts, output_lens)
    static_paged = run_static_paged(model, prompts, output_lens)
    again = matmul_probes(dtype)
    gflops = {shape: max(rate, again[shape]) for shape, rate in gflops.items()}

    def tok_s(result: dict) -> float:
        return result["useful_tokens"] / result["seconds"]

    peak = max(gflops.values())
    roofline_tok_s = peak * 1e9 / flops_per_token(model)
    prompt_lens = [len(p) for p in prompts]
    kv_bytes = decode_kv_bytes(KVCache.bytes_per_block(model.config, 1, dtype), prompt_lens, output_lens)
    reference = engines[REFERENCE]
    fast = engines[FAST]
    systems = {name: tok_s(r) for name, r in engines.items()}
    systems |= {"HF generate, static batches of 32": tok_s(hf_static),
                "HF continuous batching (generate_batch)": tok_s(hf_cb),
                "chapter 3 static paged loop": tok_s(static_paged)}
    if vllm is not None:
        systems[VLLM] = tok_s(vllm)
    breakdown = reference["breakdown"]
    step_total = sum(breakdown.values())
    summary = {
        "dtype": args.dtype,
        "workload": {"requests": num_requests, "prompt_len": [low, high], "output_len": [low, high],
                     "prompt_tokens": sum(prompt_lens), "useful_tokens": sum(output_lens)},
        "systems": systems,
        "engine_tok_s": tok_s(reference),  # chapter 5's engine: the torch backend, eager
        "fast_tok_s": tok_s(fast),
        "vllm_tok_s": tok_s(vllm) if vllm else None,
        "hf_generate_tok_s": tok_s(hf_static),
        "hf_generate_batch_tok_s": tok_s(hf_cb),
        "static_paged_tok_s": tok_s(static_paged),
        "preload": preloaded(os.environ.get("LD_PRELOAD")),  # the libraries this process's rows ran on
        "vllm_preload": preloaded(vllm["preload"]) if vllm else None,
        "compile_seconds": fast["compile_seconds"],
        "setup_seconds": {name: r["setup_seconds"] for name, r in engines.items()},
        "fast_tokens_equal_reference": fast["outputs"] == reference["outputs"],
        "vllm_agreement": token_agreement(fast["outputs"], vllm["outputs"]) if vllm else None,
        "matmul_gflops": peak,
        "matmul_gflops_by_shape": gflops,
        "roofline_tok_s": roofline_tok_s,
        "roofline_fraction": tok_s(reference) / roofline_tok_s,
        "fast_roofline_fraction": tok_s(fast) / roofline_tok_s,
        "reachable_roofline_fraction": reachable_roofline_fraction(model, prompt_lens, output_lens),
        "stream_gbytes_per_s": stream,
        "decode_kv_bytes": kv_bytes,
        "serial_roofline_fraction": serial_roofline_fraction(model, prompt_lens, output_lens, kv_bytes, peak, stream),
        "engine_steps": reference["steps"],
        "step_breakdown": {k: v / step_total for k, v in breakdown.items()},
        "step_ms": {name: r["step_ms"] for name, r in engines.items()},
        "ops_per_decode_step": {name: r["ops_per_decode_step"] for name, r in engines.items()},
        "step_cost_curve": reference["step_cost_curve"],
        "fast_step_cost_curve": fast["step_cost_curve"],
    }
    if args.save:
        args.save.write_text(json.dumps(summary, indent=1) + "\n")
    if args.json:
        print(json.dumps(summary))
        return
    print(f"workload: {num_requests} requests, prompts and outputs uniform in [{low}, {high}] tokens, "
          f"{sum(output_lens)} useful output tokens; SmolLM2-135M {args.dtype}, {threads_note()}; "
          f"preload: {summary['preload']}\n")
    print(f"{'system':<48}{'tok/s':>8}{'× engine':>10}{'× fast':>8}")
    for name, value in systems.items():
        print(f"{name:<48}{value:8.1f}{value / summary['engine_tok_s']:9.2f}×{value / summary['fast_tok_s']:7.2f}×")
    if vllm is None:
        print(f"{VLLM:<48}skipped: pass --vllm-python (see benchmarks/vllm_cpu.py)")
    else:
        agreement = summary["vllm_agreement"]
        print(f"\nvLLM's greedy tokens against the fast path's: {agreement['equal_tokens']:.1%} of positions equal, "
              f"{agreement['identical_requests']} of {num_requests} requests identical (preload: {summary['vllm_preload']})")
    print(f"fast path's tokens equal the torch backend's: {summary['fast_tokens_equal_reference']}; "
          f"compile {summary['compile_seconds']:.0f} s at start-up (not in tok/s)")
    print(f"\nmatmul {args.dtype}: {', '.join(f'{s} {g:.0f}' for s, g in gflops.items())} GFLOP/s; decode roofline "
          f"{roofline_tok_s:.0f} tok/s at {flops_per_token(model) / 1e9:.2f} GFLOP/token; engine at "
          f"{summary['roofline_fraction']:.0%} of it over the whole workload, the fast path at "
          f"{summary['fast_roofline_fraction']:.0%}")
    print(f"the {sum(prompt_lens)} prompt tokens' matmuls, which it does not credit, leave at most "
          f"{summary['reachable_roofline_fraction']:.0%} of it reachable on this workload; the fast path is at "
          f"{summary['fast_roofline_fraction'] / summary['reachable_roofline_fraction']:.0%} of that")
    serial = summary["serial_roofline_fraction"]
    print(f"add the decodes' {kv_bytes / 1e9:.1f} GB of K/V read once at the measured {stream:.0f} GB/s (attention "
          f"after the matmuls, not beside them): at most {serial:.0%}; the fast path is at "
          f"{summary['fast_roofline_fraction'] / serial:.0%} of that")
    print("engine step breakdown: " + ", ".join(f"{k} {v:.1%}" for k, v in summary["step_breakdown"].items()))
    print()
    print_ledger(engines, "CPU ops per decode step")
    print(f"\ndecode step cost: running × context → ms per step, {REFERENCE} | {FAST}")
    for before, after in zip(summary["step_cost_curve"], summary["fast_step_cost_curve"], strict=True):
        print(f"  {before['running']:3d} × {before['context']:4d}: {before['step_ms']:7.1f} ms | {after['step_ms']:7.1f} ms"
              f"  ({before['step_ms'] / after['step_ms']:.2f}×)")


if __name__ == "__main__":
    main()

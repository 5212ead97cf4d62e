"""What it costs to run the engine core in its own loop: a process, a thread, or (baseline) no loop at all.

    python -m benchmarks.engine_core            # 32 streaming requests, 64 prompt + 64 output tokens each
    python -m benchmarks.engine_core --quick    # 8 requests, 16 output tokens: checks that it runs
    python -m benchmarks.engine_core --json     # one JSON object (the table's figures)
    python -m benchmarks.engine_core --threads 1   # torch intra-op threads, here and in the core's process
    python -m benchmarks.engine_core --host-time   # host time per decode step against the context length
    python -m benchmarks.engine_core --step-bytes  # bytes and ms of a decode step's message to a worker

The same seeded workload (SmolLM2-135M, fp32 on this machine's cores; prompts of random token ids, greedy,
EOS ignored, every request present at once) through three paths, one after the other:

- offline:  `LLMEngine.step()` in a plain loop, as `LLM.generate` runs it — no queues, no event loop;
- process:  `AsyncLLM` with `engine_core="process"`, each request a streaming `generate` on one asyncio event loop;
- thread:   `AsyncLLM` with `engine_core="thread"`, the same callers, the core in a thread of the same process.

Each streaming caller does a server's per-output work: it formats an SSE chunk (`json.dumps`) for every output.
Reported per path: engine step time (median, p90: the core's own `perf_counter` around `engine.step()`, sent in
each step's stats), output tokens per second over the whole run, and for the two AsyncLLM paths the transfer
time of a message (the core putting it on its queue → the front end's output thread reading it; pickling and the
pipe in process mode) and how many outputs a request received (fewer than its tokens when the caller fell behind
and DELTA outputs were merged). In thread mode the step time includes what the GIL costs the core: the event
loop's Python work runs between the core's Python work, never beside it.

`--host-time` asks another question: does the Python around the model stay O(changes) per step, or grow with
the contexts (a block table or a token list rebuilt every step)? 64 decoding sequences of a tiny random Llama
(2 layers of 64 wide: the model costs little, so the host's share shows) at each context length, the step ledger's
median ms per stage over 20 decode steps (`SchedulerStats.seconds`), `host` = schedule + prepare inputs +
postprocess, and the block-table entries the model runner wrote per step (`BlockTable.num_block_writes`).

`--step-bytes`: what one decode step costs to send to a worker process (a tensor-parallel rank, or a data-parallel
replica, which is also sent a drawing sequence's generator state, 5 KB, with the first data it holds of it): 64
sequences of 1,000 prompt tokens through a real scheduler (no model, each sampling row given one token), 20 decode
steps. `whole` sends every sequence whole each step, generator states included (a fresh `StepEncoder`: what a
worker cost before it kept its requests and their generators), `delta` what it sends now; per
step, the pickled bytes and the milliseconds to encode, pickle, unpickle and apply them (median of the steps).
"""

import argparse
import asyncio
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import torch

from benchmarks.machine import threads_note

MODEL = "smollm2-135m"
ENGINE_ARGS = dict(max_num_seqs=64, max_model_len=512, seed=0)


def make_workload(num_requests: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts of random token ids, lengths within ±25% of `prompt_len` (ids below 100: SmolLM2's special tokens)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prompt_len * 3 // 4, prompt_len * 5 // 4 + 1, num_requests)
    return [rng.integers(100, vocab_size, n).tolist() for n in lengths]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_offline(prompts: list[list[int]], params) -> dict:
    """The engine's step loop with nothing around it (what `LLM.generate` does), each step timed."""
    from solutions import LLM

    engine = LLM(MODEL, **ENGINE_ARGS).llm_engine
    engine.add_request("warmup", prompts[0][:8], type(params)(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    step_seconds, num_tokens = [], 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        step_seconds.append(time.perf_counter() - step_start)
        num_tokens += sum(len(c.token_ids) for output in outputs for c in output.outputs)
    return dict(path="offline", seconds=time.perf_counter() - start, tokens=num_tokens, step_seconds=step_seconds)


class StepRecorder:
    """A stat logger (beside the Prometheus one) that keeps the raw per-step and per-message figures."""

    def __init__(self) -> None:
        self.step_seconds: list[float] = []
        self.transfer_seconds: list[float] = []

    def record(self, scheduler_stats, iteration_stats) -> None:
        if scheduler_stats is not None and scheduler_stats.step_seconds is not None:
            self.step_seconds.append(scheduler_stats.step_seconds)
        if iteration_stats is not None:
            self.transfer_seconds.append(iteration_stats.transfer_seconds)


async def workload_warmup(llm, prompt: list[int], params) -> None:
    """One short request first: the first forward pass pays one-time costs (allocations, kernel selection)."""
    async for _ in llm.generate(prompt, params, "warmup"):
        pass


def run_async(engine_core: str, prompts: list[list[int]], params) -> dict:
    """All prompts as concurrent streaming `generate` calls on one event loop, each formatting SSE chunks."""
    from solutions.engine.arg_utils import AsyncEngineArgs
    from solutions.engine.async_llm import AsyncLLM

    async def stream(llm, prompt: list[int], request_id: str) -> tuple[int, int]:
        num_outputs = num_tokens = num_bytes = 0
        async for output in llm.generate(prompt, params, request_id):
            completion = output.outputs[0]
            chunk = {"id": request_id, "object": "text_completion", "choices": [
                {"index": 0, "text": completion.text, "finish_reason": completion.finish_reason}]}
            num_bytes += len(f"data: {json.dumps(chunk)}\n\n".encode())  # the server's per-output work
            num_outputs, num_tokens = num_outputs + 1, num_tokens + len(completion.token_ids)
        return num_outputs, num_tokens

    async def workload(llm) -> list[tuple[int, int]]:
        return await asyncio.gather(*(stream(llm, prompt, str(i)) for i, prompt in enumerate(prompts)))

    with AsyncLLM.from_engine_args(AsyncEngineArgs(model=MODEL, engine_core=engine_core, **ENGINE_ARGS)) as llm:
        asyncio.run(workload_warmup(llm, prompts[0][:8], type(params)(max_tokens=2)))
        recorder = StepRecorder()
        llm.stat_loggers.append(recorder)
        start = time.perf_counter()
        results = asyncio.run(workload(llm))
        seconds = time.perf_counter() - start
    return dict(
        path=engine_core, seconds=seconds, tokens=sum(t for _, t in results), step_seconds=recorder.step_seconds,
        transfer_seconds=recorder.transfer_seconds, outputs_per_request=statistics.mean(n for n, _ in results),
    )


def summarise(run: dict, baseline: dict) -> dict:
    steps = run["step_seconds"]
    row = dict(
        path=run["path"], steps=len(steps), step_ms_p50=1e3 * percentile(steps, 50),
        step_ms_p90=1e3 * percentile(steps, 90), tokens_per_s=run["tokens"] / run["seconds"],
    )
    row["step_p50_vs_offline"] = row["step_ms_p50"] / (1e3 * percentile(baseline["step_seconds"], 50))
    row["tokens_per_s_vs_offline"] = row["tokens_per_s"] / (baseline["tokens"] / baseline["seconds"])
    if "transfer_seconds" in run:
        row["transfer_ms_p50"] = 1e3 * percentile(run["transfer_seconds"], 50)
        row["transfer_ms_p90"] = 1e3 * percentile(run["transfer_seconds"], 90)
        row["outputs_per_request"] = run["outputs_per_request"]
    return row


def print_table(rows: list[dict], num_requests: int, prompt_len: int, max_tokens: int) -> None:
    print(f"{num_requests} streaming requests, prompts ~{prompt_len} tokens, {max_tokens} output tokens, "
          f"{MODEL} fp32, {threads_note(ENGINE_ARGS.get('cpu_threads'))}")
    header = ("path", "steps", "step ms p50", "p90", "x offline", "tok/s", "x offline", "transfer ms p50", "p90",
              "outputs/req")
    print(" | ".join(f"{h:>12}" for h in header))
    for r in rows:
        cells = [r["path"], r["steps"], f"{r['step_ms_p50']:.1f}", f"{r['step_ms_p90']:.1f}",
                 f"{r['step_p50_vs_offline']:.2f}", f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_s_vs_offline']:.2f}",
                 f"{r.get('transfer_ms_p50', float('nan')):.2f}", f"{r.get('transfer_ms_p90', float('nan')):.2f}",
                 f"{r.get('outputs_per_request', float('nan')):.1f}"]
        print(" | ".join(f"{c:>12}" for c in cells))


def host_time_vs_context(
    context_lens: list[int], num_seqs: int = 64, num_steps: int = 20, block_size: int = 16
) -> list[dict]:
    """Per context length: `num_seqs` sequences of that many prompt tokens prefilled (untimed), then `num_steps`
    decode steps of all of them; the ledger's median ms per stage, `host`, and block-table writes per step."""
    from grading.tiny_models import tiny_checkpoint
    from solutions import LLM, SamplingParams
    from solutions.metrics.stats import STEP_STAGES

    max_model_len = max(context_lens) + 512  # room for the first sequences' decodes while the last ones prefill
    llm = LLM(str(tiny_checkpoint("llama-gqa", max_position_embeddings=max_model_len)), block_size=block_size,
              max_num_seqs=num_seqs, max_num_batched_tokens=8192, max_model_len=max_model_len,
              kv_cache_memory_bytes=2**30, enforce_eager=True, seed=0)
    engine = llm.llm_engine
    scheduler, block_table = engine.engine_core.scheduler, engine.engine_core.model_executor.model_runner.block_table
    params = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True)
    rows = []
    for context_len in context_lens:
        ids = [f"{context_len}-{i}" for i in range(num_seqs)]
        for i, request_id in enumerate(ids):
            engine.add_request(request_id, [(7 * i + j) % 250 + 3 for j in range(context_len)], params)
        while scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running):
            engine.step()
        engine.step()  # the first decode: its rows enter the block table
        engine.stats.steps.clear()
        writes = block_table.num_block_writes
        for _ in range(num_steps):
            engine.step()
        steps = engine.stats.steps
        assert len(steps) == num_steps and all(s.num_decode_tokens == num_seqs for s in steps), "decodes only"
        row = {stage: 1e3 * statistics.median(s.seconds[stage] for s in steps) for stage in STEP_STAGES}
        row["host"] = row["schedule"] + row["prepare"] + row["postprocess"]
        row["block_writes_per_step"] = (block_table.num_block_writes - writes) / num_steps
        rows.append({"context": context_len, **row})
        engine.abort_request(ids)
    return rows


def print_host_time(rows: list[dict], num_seqs: int) -> None:
    print(f"{num_seqs} decoding sequences, tiny Llama (2 layers, 64 wide), torch backend eager, block_size 16; "
          f"median ms per step; {threads_note(ENGINE_ARGS.get('cpu_threads'))}")
    header = ("context", "schedule", "prepare", "forward", "sample", "postprocess", "host", "block writes")
    print(" | ".join(f"{h:>11}" for h in header))
    for r in rows:
        cells = [r["context"], *(f"{r[k]:.3f}" for k in header[1:-1]), f"{r['block_writes_per_step']:.1f}"]
        print(" | ".join(f"{c:>11}" for c in cells))


def step_message_costs(
    num_seqs: int = 64, context_len: int = 1000, num_steps: int = 20, temperature: float = 0.0
) -> dict[str, dict[str, float]]:
    """Median bytes and ms per decode step of each way of telling a worker its step (see `--step-bytes`)."""
    import pickle

    from solutions import SamplingParams
    from solutions.core.kv_cache_manager import KVCacheManager
    from solutions.core.sched.output import ModelRunnerOutput, sampling_rows
    from solutions.core.sched.scheduler import Scheduler
    from solutions.core.sequence import Sequence
    from solutions.worker.cached_requests import CachedRequests, StepEncoder

    block_size, generators = 16, temperature > 0
    scheduler = Scheduler(KVCacheManager(num_seqs * (context_len // block_size + 4), block_size), max_num_seqs=num_seqs,
                          max_num_batched_tokens=num_seqs * context_len, long_prefill_token_threshold=context_len,
                          max_model_len=context_len + num_steps + 2)
    for i in range(num_seqs):
        seq = Sequence(i, [(7 * i + j) % 250 + 3 for j in range(context_len)])
        seq.request_id = f"r{i}"
        seq.sampling_params = SamplingParams(temperature=temperature, max_tokens=num_steps + 2, ignore_eos=True)
        seq.generator = torch.Generator().manual_seed(i)
        scheduler.add_request(seq)
    encoder, worker = StepEncoder(block_size), CachedRequests()
    costs: dict[str, dict[str, list[float]]] = {way: {"bytes": [], "ms": []} for way in ("whole", "delta")}
    for step in range(num_steps + 1):
        out = scheduler.schedule()
        for way in ("whole", "delta"):
            start = time.perf_counter()
            if way == "whole":
                pickle.loads(StepEncoder(block_size).message(out, generators))
            else:
                message = encoder.message(out, generators)
                worker.apply(pickle.loads(message))
            if step:  # the first step prefills: every sequence is new to the worker either way
                costs[way]["ms"].append(1e3 * (time.perf_counter() - start))
                costs[way]["bytes"].append(len(StepEncoder(block_size).message(out, generators)) if way == "whole"
                                           else len(message))
        _, seqs = sampling_rows(out)
        scheduler.update_from_output(out, ModelRunnerOutput([s.seq_id for s in seqs], [[7]] * len(seqs),
                                                            [None] * len(seqs)))
    return {way: {k: statistics.median(v) for k, v in c.items()} for way, c in costs.items()}


def print_step_bytes() -> None:
    print(f"a decode step's message to a worker, 64 sequences x 1,000 tokens; {threads_note(None)}")
    print(" | ".join(f"{h:>14}" for h in ("worker", "whole bytes", "delta bytes", "x less", "whole ms", "delta ms",
                                          "x less")))
    for worker, temperature in (("TP rank", 0.0), ("DP, greedy", 0.0), ("DP, sampling", 1.0)):
        c = step_message_costs(temperature=temperature)
        whole, delta = c["whole"], c["delta"]
        cells = [worker, f"{whole['bytes']:.0f}", f"{delta['bytes']:.0f}", f"{whole['bytes'] / delta['bytes']:.1f}",
                 f"{whole['ms']:.2f}", f"{delta['ms']:.2f}", f"{whole['ms'] / delta['ms']:.1f}"]
        print(" | ".join(f"{cell:>14}" for cell in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 requests, 16 output tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--threads", type=int,
                        help="torch threads for every path, fixed (default: the engine's thread policy)")
    parser.add_argument("--host-time", action="store_true",
                        help="host time per decode step of 64 sequences at several context lengths (tiny model)")
    parser.add_argument("--step-bytes", action="store_true",
                        help="bytes and ms of a decode step's message to a worker, whole against deltas")
    args = parser.parse_args()
    if args.step_bytes:
        print_step_bytes()
        return
    if args.threads is not None:  # fixed: the engines' thread policy would otherwise choose per step
        ENGINE_ARGS["cpu_threads"] = args.threads
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by torch when the spawned core process starts
    if args.host_time:
        contexts = [100, 400] if args.quick else [100, 1000, 4000]
        rows = host_time_vs_context(contexts, num_steps=5 if args.quick else 20)
        if args.json:
            print(json.dumps(dict(num_seqs=64, rows=rows)))
        else:
            print_host_time(rows, 64)
        return
    from solutions import SamplingParams
    from solutions.model.loader import load_tokenizer

    num_requests, prompt_len, max_tokens = (8, 32, 16) if args.quick else (32, 64, 64)
    prompts = make_workload(num_requests, prompt_len, len(load_tokenizer(MODEL)))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    baseline = run_offline(prompts, params)
    runs = [baseline, run_async("process", prompts, params), run_async("thread", prompts, params)]
    rows = [summarise(run, baseline) for run in runs]
    if args.json:
        print(json.dumps(dict(num_requests=num_requests, prompt_len=prompt_len, max_tokens=max_tokens, rows=rows)))
    else:
        print_table(rows, num_requests, prompt_len, max_tokens)


if __name__ == "__main__":
    main()

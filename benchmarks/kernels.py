"""What a paged read costs: gather bandwidth on the CPU, and the Triton decode kernel on a GPU.

    python -m benchmarks.kernels --cpu     # read a sequence's K/V through a block table, block size 1..128
    python -m benchmarks.kernels           # the GPU benchmark ("skipped: no GPU", exit 0, without one)

CPU (no GPU needed). One sequence's K and V, 32,768 tokens × 3 KV heads × 64 dims in fp32 (SmolLM2's head
shape, 48 MiB together, so that main memory and not a cache serves them), sit in shuffled order in a pool of
blocks twice that size. (Which level serves them depends on the machine: a server CPU's last-level cache can
hold hundreds of MiB. The ceiling is therefore measured on a buffer of the same size.) Reading them in
position order means following the block table: one contiguous run of `block_size` token rows per block, then
a jump. We time that gather (`index_select` of the blocks into a buffer) against copying the same bytes from a
contiguous tensor, and against the machine's copy bandwidth measured on a large buffer (the ceiling). Bandwidth
counts bytes read + bytes written, as a copy benchmark does.

GPU. Paged decode with the course's Triton kernels (`kernels.paged_decode_attention`, launched by its rule), bf16,
block size 16, query length 1, shuffled block tables, for batch 1–256 × context 512–8192 and two head shapes
(Llama-3-8B: 32 query / 8 KV heads, head dim 128; SmolLM2-135M: 9 / 3, 64). For each: the fraction of the
measured device copy bandwidth reached (bytes = K + V + q + out), timed as a CUDA-graph replay (the kernels
alone) and eagerly (the Python launch included, which dominates short kernels); the same kernels on an in-order
table (the cost of the indirection); PyTorch SDPA (cuDNN / flash) on contiguous KV, graph and eager; and vLLM's
Triton kernel's figure on an H100, quoted. The L2 cache is flushed before every timed run. Targets at 64 × 2048:
SDPA's contiguous figure (94% Llama-3-8B, 70% SmolLM2 on an H100), and vLLM's figure at every point.

    python -m benchmarks.kernels --sweep sweep.jsonl   # every (splits, TILE_N, warps) launch at every point

The sweep is what `choose_num_splits` and `choose_tile` were fitted to. Uses only Triton features present in 3.6
and 3.9 (no `tl.make_block_ptr`).
"""

import argparse
import time

import torch

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
CPU_SEQ_LEN, CPU_KV_HEADS, CPU_HEAD_DIM = 32768, 3, 64


def _best_seconds(fn, reps: int) -> float:
    fn()  # warm-up: page faults, allocator
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def cpu_copy_bandwidth(num_bytes: int = 2 * CPU_SEQ_LEN * CPU_KV_HEADS * CPU_HEAD_DIM * 4, reps: int = 5) -> float:
    """GB/s (read + write) of one contiguous copy of `num_bytes` (by default the sequence's K + V, so that the
    ceiling comes from the same level of the memory hierarchy as the gathers): the ceiling for any gather."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _best_seconds(lambda: dst.copy_(src), reps) / 1e9


def cpu_gather_bandwidth(block_size: int, pools: tuple[torch.Tensor, torch.Tensor] | None = None, reps: int = 5,
                         seed: int = 0) -> tuple[float, float]:
    """(paged GB/s, contiguous GB/s) for reading one sequence's K and V in position order (read + write)."""
    key_pool, value_pool = pools if pools is not None else _pools()
    num_blocks = CPU_SEQ_LEN // block_size
    key_cache = key_pool.view(-1, block_size, CPU_KV_HEADS, CPU_HEAD_DIM)  # (2 * num_blocks, block_size, Hkv, D)
    value_cache = value_pool.view(-1, block_size, CPU_KV_HEADS, CPU_HEAD_DIM)
    gen = torch.Generator().manual_seed(seed)
    block_table = torch.randperm(key_cache.shape[0], generator=gen)[:num_blocks]  # (num_blocks,) shuffled
    key_out = torch.empty(num_blocks, block_size, CPU_KV_HEADS, CPU_HEAD_DIM)
    value_out = torch.empty_like(key_out)
    key_dense = key_cache[block_table]  # the same bytes, contiguous (a copy)
    value_dense = value_cache[block_table]

    def paged() -> None:
        torch.index_select(key_cache, 0, block_table, out=key_out)
        torch.index_select(value_cache, 0, block_table, out=value_out)

    def contiguous() -> None:
        key_out.copy_(key_dense)
        value_out.copy_(value_dense)

    moved = 2 * 2 * key_out.numel() * key_out.element_size()  # K and V, each read once and written once
    paged_s, contiguous_s = _best_seconds_interleaved(paged, contiguous, reps)
    return moved / paged_s / 1e9, moved / contiguous_s / 1e9


def _best_seconds_interleaved(fn_a, fn_b, reps: int) -> tuple[float, float]:
    """Best times of two functions run alternately, so that a busy machine slows both alike."""
    fn_a(), fn_b()
    best_a = best_b = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn_a()
        middle = time.perf_counter()
        fn_b()
        best_a, best_b = min(best_a, middle - start), min(best_b, time.perf_counter() - middle)
    return best_a, best_b


def _pools() -> tuple[torch.Tensor, torch.Tensor]:
    """K and V pools of 2 * CPU_SEQ_LEN token rows each, filled (every page touched), reshaped per block size."""
    shape = (2 * CPU_SEQ_LEN, CPU_KV_HEADS, CPU_HEAD_DIM)
    return torch.empty(shape).fill_(1.0), torch.empty(shape).fill_(2.0)


def cpu_measurement(reps: int = 10) -> dict[str, object]:
    """The block-size sweep: {"copy": GB/s, "rows": [(block_size, paged GB/s, contiguous GB/s), ...]}."""
    copy = cpu_copy_bandwidth(reps=reps)
    pools = _pools()
    rows = [(bs, *cpu_gather_bandwidth(bs, pools, reps=reps)) for bs in BLOCK_SIZES]
    return {"copy": copy, "rows": rows}


def cpu_table(result: dict[str, object]) -> str:
    copy = result["copy"]
    lines = [
        f"one sequence: {CPU_SEQ_LEN} tokens × {CPU_KV_HEADS} KV heads × {CPU_HEAD_DIM} dims, fp32, K and V "
        f"({2 * CPU_SEQ_LEN * CPU_KV_HEADS * CPU_HEAD_DIM * 4 / 2**20:.0f} MiB); measured copy bandwidth {copy:.1f} GB/s",
        f"{'block size':>10} {'bytes/run':>10} {'paged GB/s':>11} {'contiguous GB/s':>16} {'paged/contig':>13} {'paged/copy':>11}",
    ]
    for block_size, paged, contiguous in result["rows"]:
        run_bytes = block_size * CPU_KV_HEADS * CPU_HEAD_DIM * 4
        lines.append(
            f"{block_size:>10} {run_bytes:>10,} {paged:>11.1f} {contiguous:>16.1f} {paged / contiguous:>12.0%} {paged / copy:>10.0%}"
        )
    return "\n".join(lines)


# --- GPU -------------------------------------------------------------------------------------------------------------

HEAD_SHAPES = {"llama-3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}  # (Hq, Hkv, D)
BATCHES = (1, 8, 64, 256)
CONTEXTS = (512, 2048, 8192)


def gpu_time(fn, reps: int = 20) -> float:
    """Median seconds of `fn` on the GPU, the L2 flushed before each run (a 256 MiB write evicts it). Events
    bracket the call on the stream: for an eager call the GPU waits on the Python launch between them, so a launch
    slower than the kernel is counted; for a graph replay it is not."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def as_cuda_graph(fn):
    """`fn` captured as a CUDA graph (after a warm-up on a side stream, where Triton compiles); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def gpu_copy_bandwidth() -> float:
    src = torch.empty(2**30, dtype=torch.int8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / gpu_time(lambda: dst.copy_(src)) / 1e9


# vLLM's Triton unified-attention kernel (vllm/v1/attention/ops/triton_unified_attention.py) on the same cases:
# fraction of copy bandwidth, measured on an H100 80GB HBM3 on 2026-11-22 (copy bandwidth 3002 GB/s), bf16, block
# size 16, shuffled tables, timed eagerly with triton.testing.do_bench. vLLM is not a dependency of the course, so
# these figures are quoted beside the live measurement, not measured in the same run.
VLLM_H100 = {
    "llama-3-8b": {(1, 512): 0.04, (1, 2048): 0.13, (1, 8192): 0.20, (8, 512): 0.26, (8, 2048): 0.46,
                   (8, 8192): 0.63, (64, 512): 0.73, (64, 2048): 0.91, (64, 8192): 0.98, (256, 512): 0.85,
                   (256, 2048): 0.90, (256, 8192): 0.91},
    "smollm2-135m": {(1, 512): 0.00, (1, 2048): 0.02, (1, 8192): 0.05, (8, 512): 0.01, (8, 2048): 0.16,
                     (8, 8192): 0.29, (64, 512): 0.27, (64, 2048): 0.34, (64, 8192): 0.39, (256, 512): 0.64,
                     (256, 2048): 0.82, (256, 8192): 0.89},
}
TARGETS = {"llama-3-8b": 0.94, "smollm2-135m": 0.70}  # at 64 × 2048: cuDNN's figure on contiguous KV (same H100)


def decode_inputs(batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  device: str = "cuda") -> dict[str, object]:
    """One decode step's arguments for `paged_decode_attention` (bf16, block size 16, every sequence `context`
    tokens long, its blocks scattered by a shuffled table), and the bytes the step must move (K + V + q + out)."""
    block_size, dtype = 16, torch.bfloat16
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    query = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    return {
        "query": query, "key_cache": key_cache, "value_cache": torch.randn_like(key_cache),
        "block_tables": torch.randperm(num_blocks, device=device).reshape(batch, blocks_per_seq).to(torch.int32),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=device), "scale": head_dim**-0.5,
        "bytes": 2 * key_cache.numel() * key_cache.element_size() + 2 * query.numel() * query.element_size(),
    }


def sdpa_contiguous(query: torch.Tensor, num_kv_heads: int, context: int):
    """PyTorch SDPA for the same queries over a contiguous cache (B, Hkv, L, D), the layout its fused kernels
    want: the figure paging should reach. Returns the call."""
    import torch.nn.functional as F

    batch, _, head_dim = query.shape
    k = torch.randn(batch, num_kv_heads, context, head_dim, dtype=query.dtype, device=query.device)
    v = torch.randn_like(k)
    q = query[:, :, None, :]  # (B, Hq, 1, D)
    return lambda: F.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5, enable_gqa=True)


def gpu_case(batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, float]:
    """Seconds for each variant at one shape (graph replay and eager), and the bytes a decode step must move."""
    from kernels import paged_decode_attention

    args = decode_inputs(batch, context, num_heads, num_kv_heads, head_dim)
    nbytes = args.pop("bytes")
    in_order = torch.arange(args["block_tables"].numel(), device="cuda").reshape(batch, -1).to(torch.int32)
    paged = lambda: paged_decode_attention(**args)  # noqa: E731
    times = {
        "paged_graph": gpu_time(as_cuda_graph(paged)),
        "paged_eager": gpu_time(paged),
        "in_order_graph": gpu_time(as_cuda_graph(lambda: paged_decode_attention(**args | {"block_tables": in_order}))),
    }
    query = args["query"]
    del args  # the paged cache, before the contiguous one is made
    sdpa = sdpa_contiguous(query, num_kv_heads, context)
    times["sdpa_graph"], times["sdpa_eager"] = gpu_time(as_cuda_graph(sdpa)), gpu_time(sdpa)
    times["bytes"] = nbytes
    return times


def gpu_benchmark(save: str | None = None) -> None:
    import json

    import kernels
    from kernels.paged_decode import _num_sms, choose_num_splits

    copy = gpu_copy_bandwidth()
    name = torch.cuda.get_device_name()
    print(f"{name}: measured device copy bandwidth (read + write) {copy:.0f} GB/s; kernels interpreted: {kernels.interpreted()}")
    print("fraction of copy bandwidth reached (bytes = K + V + q + out), bf16, block size 16, shuffled tables, L2 "
          "flushed;\n'graph' = CUDA-graph replay (the kernels alone), 'eager' = launched from Python (launch cost "
          "included); vLLM: its Triton kernel on an H100, eager (quoted, 2026-11-22)")
    print(f"{'shape':<14}{'batch':>6}{'context':>8}{'splits':>7}{'graph':>7}{'(µs)':>7}{'eager':>7}{'in-order':>9}"
          f"{'SDPA graph':>11}{'SDPA eager':>11}{'vLLM':>6}{'/SDPA':>7}")
    rows = []
    for shape, (hq, hkv, d) in HEAD_SHAPES.items():
        for batch in BATCHES:
            for context in CONTEXTS:
                t = gpu_case(batch, context, hq, hkv, d)
                frac = {k: t["bytes"] / t[k] / 1e9 / copy for k in t if k != "bytes"}
                splits = choose_num_splits(batch, hkv, context, _num_sms(torch.device("cuda")))
                vllm = VLLM_H100[shape][(batch, context)]
                rows.append({"shape": shape, "batch": batch, "context": context, "splits": splits, "vllm": vllm,
                             "seconds": {k: v for k, v in t.items() if k != "bytes"}, "fraction": frac})
                print(f"{shape:<14}{batch:>6}{context:>8}{splits:>7}{frac['paged_graph']:>7.0%}"
                      f"{t['paged_graph'] * 1e6:>7.0f}{frac['paged_eager']:>7.0%}{frac['in_order_graph']:>9.0%}"
                      f"{frac['sdpa_graph']:>11.0%}{frac['sdpa_eager']:>11.0%}{vllm:>6.0%}"
                      f"{frac['paged_graph'] / frac['sdpa_graph']:>7.2f}", flush=True)
                torch.cuda.empty_cache()
    for shape, target in TARGETS.items():
        row = next(r for r in rows if (r["shape"], r["batch"], r["context"]) == (shape, 64, 2048))
        got = row["fraction"]["paged_graph"]
        print(f"target {shape} at 64 × 2048: {got:.0%} (graph) against {target:.0%}: "
              f"{'meets' if got >= target else 'MISSES'} it")
    behind = [f"{r['shape']} {r['batch']}×{r['context']}" for r in rows if r["fraction"]["paged_graph"] < r["vllm"]]
    print(f"at or above vLLM's figure (graph timing against its eager): {len(rows) - len(behind)} of {len(rows)} "
          f"points{'; behind: ' + ', '.join(behind) if behind else ''}")
    if save:
        with open(save, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "copy_gbs": copy, "rows": rows}, f, indent=1)
        print(f"saved to {save}")


SWEEP_SPLITS = (1, 2, 4, 8, 16, 32)
SWEEP_TILES = (32, 64, 128)
SWEEP_WARPS = (2, 4, 8)


def gpu_sweep(path: str) -> None:
    """Every (num_splits, TILE_N, num_warps) launch of the paged decode kernels at every grid point, timed under
    CUDA-graph replay with the L2 flushed; one JSON line per grid point, appended to `path` as it is measured."""
    import json

    from kernels import paged_decode_attention

    copy = gpu_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy:.0f} GB/s", flush=True)
    for shape, (hq, hkv, d) in HEAD_SHAPES.items():
        for batch in BATCHES:
            for context in CONTEXTS:
                args = decode_inputs(batch, context, hq, hkv, d)
                nbytes = args.pop("bytes")
                record = {"shape": shape, "batch": batch, "context": context, "bytes": nbytes, "copy_gbs": copy,
                          "launches": []}
                for splits in SWEEP_SPLITS:
                    if context // splits < 64:
                        continue
                    for tile_n in SWEEP_TILES:
                        for warps in SWEEP_WARPS:
                            fn = lambda: paged_decode_attention(  # noqa: E731
                                **args, num_splits=splits, tile_n=tile_n, num_warps=warps)
                            seconds = gpu_time(as_cuda_graph(fn), reps=10)
                            record["launches"].append([splits, tile_n, warps, seconds])
                default = lambda: paged_decode_attention(**args)  # noqa: E731
                record["default_graph"] = gpu_time(as_cuda_graph(default), reps=10)
                record["default_eager"] = gpu_time(default, reps=10)
                query = args["query"]
                del args, default, fn  # the paged cache, before the contiguous one is made
                sdpa = sdpa_contiguous(query, hkv, context)
                record["sdpa_graph"] = gpu_time(as_cuda_graph(sdpa), reps=10)
                record["sdpa_eager"] = gpu_time(sdpa, reps=10)
                del sdpa
                torch.cuda.empty_cache()
                best = min(record["launches"], key=lambda r: r[3])
                print(f"{shape} {batch}x{context}: best {best[:3]} {nbytes / best[3] / 1e9 / copy:.0%}, default graph "
                      f"{nbytes / record['default_graph'] / 1e9 / copy:.0%}, sdpa graph "
                      f"{nbytes / record['sdpa_graph'] / 1e9 / copy:.0%}", flush=True)
                with open(path, "a") as f:
                    f.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU block-size sweep (no GPU needed)")
    parser.add_argument("--sweep", metavar="PATH", help="time every launch at every grid point (JSON lines to PATH)")
    parser.add_argument("--save", metavar="PATH", help="also write the GPU table as JSON to PATH")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per measurement (best is kept)")
    args = parser.parse_args()
    if args.cpu:
        print(cpu_table(cpu_measurement(reps=args.reps)))
        return
    if not torch.cuda.is_available():
        print("skipped: no GPU (torch.cuda.is_available() is False); the CPU measurement is --cpu")
        return
    if args.sweep:
        gpu_sweep(args.sweep)
        return
    gpu_benchmark(args.save)


if __name__ == "__main__":
    main()

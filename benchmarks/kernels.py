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

GPU. Paged decode with the course's Triton kernel (`kernels.paged_decode_attention`), bf16, block size 16,
query length 1, random block tables, for batch 1–256 × context 512–8192 and two head shapes (Llama-3-8B:
32 query / 8 KV heads, head dim 128; SmolLM2-135M: 9 / 3, 64). For each: the achieved bandwidth (bytes = K + V
+ q + out, over the measured device copy bandwidth), the same kernel on contiguous KV (an in-order table: the
cost of the indirection), split against unsplit, and PyTorch SDPA on contiguous KV. The L2 cache is flushed
between timed runs. Target: paged decode ≥ 70% of the measured copy bandwidth at batch 64 × context 2048 on an
H100. Uses only Triton features present in 3.6 and 3.9 (no `tl.make_block_ptr`).

Eager against CUDA graphs: the same paged decode call timed per call, back to back without flushing (what an
engine step pays), launched from Python (eager: argument checks, Triton's launcher) and replayed from a CUDA
graph that captured it. The difference is the launch cost; it matters where the kernel itself is short.
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
TARGET = (64, 2048, 0.70)  # batch, context, fraction of copy bandwidth on an H100


def gpu_time(fn, reps: int = 20) -> float:
    """Median seconds of `fn` on the GPU, the L2 flushed before each run (a 256 MiB write evicts it)."""
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


def wall_time_per_call(fn, reps: int = 200) -> float:
    """Seconds per call of `fn` run back to back, synchronised once at the end: launch cost included."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


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


def gpu_case(batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, float]:
    """Seconds for each variant at one shape, and the bytes a decode step must move."""
    import torch.nn.functional as F

    from kernels import paged_decode_attention

    block_size, dtype, device = 16, torch.bfloat16, "cuda"
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    shuffled = torch.randperm(num_blocks, device=device).reshape(batch, blocks_per_seq).to(torch.int32)
    in_order = torch.arange(num_blocks, device=device).reshape(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    paged = lambda: paged_decode_attention(query, key_cache, value_cache, shuffled, seq_lens, scale)  # noqa: E731
    times = {
        "paged": gpu_time(paged),
        "eager_call": wall_time_per_call(paged),
        "graph_call": wall_time_per_call(as_cuda_graph(paged)),
        "in_order": gpu_time(lambda: paged_decode_attention(query, key_cache, value_cache, in_order, seq_lens, scale)),
        "unsplit": gpu_time(
            lambda: paged_decode_attention(query, key_cache, value_cache, shuffled, seq_lens, scale, num_splits=1)
        ),
    }
    del key_cache, value_cache
    # contiguous KV for SDPA: (B, Hkv, L, D), the layout its fused kernels want
    k = torch.randn(batch, num_kv_heads, context, head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    q = query[:, :, None, :]  # (B, Hq, 1, D)
    times["sdpa"] = gpu_time(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True))
    times["bytes"] = 2 * k.numel() * k.element_size() + 2 * query.numel() * query.element_size()
    return times


def gpu_benchmark() -> None:
    import kernels
    from kernels.paged_decode import _num_sms, choose_num_splits

    copy = gpu_copy_bandwidth()
    name = torch.cuda.get_device_name()
    print(f"{name}: measured device copy bandwidth (read + write) {copy:.0f} GB/s; kernels interpreted: {kernels.interpreted()}")
    print("fraction of copy bandwidth reached (bytes = K + V + q + out), bf16, block size 16, shuffled tables")
    header = (f"{'shape':<14} {'batch':>5} {'context':>7} {'splits':>6} {'paged':>7} {'in-order':>8} {'unsplit':>8} "
              f"{'SDPA contig':>11} {'paged µs':>9} {'eager µs/call':>13} {'graph µs/call':>13}")
    print(header)
    verdict = None
    for shape, (hq, hkv, d) in HEAD_SHAPES.items():
        for batch in BATCHES:
            for context in CONTEXTS:
                if batch * context * hkv * d * 4 > 24 * 2**30:  # K + V above 24 GiB: skip
                    continue
                t = gpu_case(batch, context, hq, hkv, d)
                frac = {k: t["bytes"] / t[k] / 1e9 / copy for k in ("paged", "in_order", "unsplit", "sdpa")}
                splits = choose_num_splits(batch, hkv, context, _num_sms(torch.device("cuda")))
                print(
                    f"{shape:<14} {batch:>5} {context:>7} {splits:>6} {frac['paged']:>7.0%} {frac['in_order']:>8.0%} "
                    f"{frac['unsplit']:>8.0%} {frac['sdpa']:>11.0%} {t['paged'] * 1e6:>9.0f} "
                    f"{t['eager_call'] * 1e6:>13.1f} {t['graph_call'] * 1e6:>13.1f}"
                )
                if (batch, context) == TARGET[:2] and shape == "llama-3-8b":
                    verdict = frac["paged"]
                torch.cuda.empty_cache()
    if verdict is not None:
        ok = "meets" if verdict >= TARGET[2] else "MISSES"
        print(f"target: paged decode at batch {TARGET[0]} × context {TARGET[1]} (llama-3-8b shape) reaches "
              f"{verdict:.0%} of copy bandwidth: {ok} the {TARGET[2]:.0%} target")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU block-size sweep (no GPU needed)")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per measurement (best is kept)")
    args = parser.parse_args()
    if args.cpu:
        print(cpu_table(cpu_measurement(reps=args.reps)))
        return
    if not torch.cuda.is_available():
        print("skipped: no GPU (torch.cuda.is_available() is False); the CPU measurement is --cpu")
        return
    gpu_benchmark()


if __name__ == "__main__":
    main()

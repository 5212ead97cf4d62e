"""The copies the scheduler's swap and offload decisions ask for, made by the model runner before the forward pass.

A host pool is a `KVCache` like the device's, in host memory (pinned on a GPU, so PCIe copies run at full speed;
on the CPU a "swap" is a memcpy). `swap_blocks` moves any number of blocks with three operations per cache tensor,
never one per block: gather the source blocks into one run, copy it across, scatter it into the destination
blocks. On a GPU a step's copies run on their own stream (`KVTransfer`), and the forward pass waits for them only
where it first touches the cache.

Where this lives in vLLM: `vllm/worker/cache_engine.py` (vLLM v0: `CacheEngine.swap_in` / `swap_out`, one
`swap_blocks` call per layer, which issues one `cudaMemcpyAsync` per block) and `vllm/v1/kv_offload/cpu/gpu_worker.py`
(v1's offloading worker, its copies on CUDA streams with events).
"""

import torch

from solutions.attention.paged import KVCache, KVCacheShape


def allocate_host_cache(
    config: KVCacheShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCache:
    """Host blocks shaped like the device cache's, pinned when the device is a GPU (a copy from pageable memory is
    staged through a pinned buffer by the driver, synchronously). Uninitialised (`torch.empty`): a host block is
    always written whole (by a swap-out or a store) before it is read, and a large pool should not touch its pages
    up front."""
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    pin = device.type == "cuda" and torch.cuda.is_available()
    return KVCache([torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(config.num_hidden_layers)],
                   [torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(config.num_hidden_layers)])


def swap_blocks(src: KVCache, dst: KVCache, pairs: list[tuple[int, int]]) -> None:
    """For every layer's K and V: block `s` of `src` into block `d` of `dst`, for each (s, d) in `pairs`.

    Per cache tensor one gather, one copy across and one scatter, however many pairs (a source may repeat). Pairs
    must have distinct destinations (the block pools guarantee it: each is a block handed out once). Runs on the
    current stream. Device to host waits for its copies before the host scatters them (a CPU operation); host to
    device returns with its copies queued, reading pinned buffers that outlive them.
    """
    if not pairs:
        return
    src_device, dst_device = src.key_caches[0].device, dst.key_caches[0].device
    src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.long).to(src_device)  # (P,)
    dst_ids = torch.tensor([d for _, d in pairs], dtype=torch.long).to(dst_device)  # (P,)
    src_caches, dst_caches = src.key_caches + src.value_caches, dst.key_caches + dst.value_caches
    if src_device == dst_device:  # the CPU's two pools (or one device's): no crossing, one run reused (cache-hot)
        run = torch.empty((len(pairs), *src_caches[0].shape[1:]), dtype=src_caches[0].dtype, device=src_device)
        for src_cache, dst_cache in zip(src_caches, dst_caches, strict=True):
            torch.index_select(src_cache, 0, src_ids, out=run)  # (P, block_size, Hkv, D)
            dst_cache.index_copy_(0, dst_ids, run)
    elif dst_device.type == "cpu":  # device to host: gather there, one copy down per tensor, scatter here
        runs = [cache.index_select(0, src_ids).to(dst_device, non_blocking=True) for cache in src_caches]  # pinned
        torch.cuda.current_stream(src_device).synchronize()  # the runs have landed
        for dst_cache, run in zip(dst_caches, runs, strict=True):
            dst_cache.index_copy_(0, dst_ids, run)
    else:  # host to device: gather here into pinned memory, one copy up per tensor, scatter there
        for src_cache, dst_cache in zip(src_caches, dst_caches, strict=True):
            run = torch.empty((len(pairs), *src_cache.shape[1:]), dtype=src_cache.dtype, pin_memory=True)
            torch.index_select(src_cache, 0, src_ids, out=run)  # (P, block_size, Hkv, D)
            dst_cache.index_copy_(0, dst_ids, run.to(dst_device, non_blocking=True))


class KVTransfer:
    """A step's copies between the device cache and host memory, off the forward pass's stream on a GPU.

    `start` issues them in the order given on a stream of their own, after everything already queued on the
    current stream (the last step wrote the blocks a swap-out reads); `wait` makes the current stream wait for them,
    called just before the first operation that reads or writes the device cache. The host-side work between the
    two (the step's metadata) overlaps the copies. On the CPU there is no stream: `start` copies, `wait` is free.
    """

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.done: torch.cuda.Event | None = None  # recorded after the last copies issued, until waited for

    def start(self, copies: list[tuple[KVCache, KVCache, list[tuple[int, int]]]]) -> None:
        """Issue `swap_blocks(src, dst, pairs)` for each (src, dst, pairs), in order."""
        copies = [copy for copy in copies if copy[2]]
        if self.stream is None or not copies:
            for src, dst, pairs in copies:
                swap_blocks(src, dst, pairs)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            for src, dst, pairs in copies:
                swap_blocks(src, dst, pairs)
        self.done = torch.cuda.Event()
        self.done.record(self.stream)

    def wait(self) -> None:
        """The current stream waits for the copies issued so far (nothing to wait for on the CPU)."""
        if self.done is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self.done)
            self.done = None

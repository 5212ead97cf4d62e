"""The copies the scheduler's swap and offload decisions ask for, made by the model runner before the forward pass.

A host pool is a `KVCache` like the device's (every layer's key and value blocks, the same block shape), in host
memory (pinned on a GPU, so copies over PCIe run at full speed). On the CPU both pools are RAM, and a "swap" is a
memory copy between them: what Fig. 19a times over PCIe costs here a memcpy. The copies are synchronous (the forward
pass reads what they write); vLLM overlaps them with compute on a separate CUDA stream.

Where this lives in vLLM: `vllm/worker/cache_engine.py` (v0: `CacheEngine.swap_in` / `swap_out`, one
`swap_blocks` call per layer) and `vllm/v1/kv_offload/cpu/gpu_worker.py` (v1's offloading worker).
"""

import torch

from solutions.attention.paged import KVCache, KVCacheShape


def allocate_host_cache(
    config: KVCacheShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCache:
    """Host blocks shaped like the device cache's. Uninitialised (`torch.empty`): a host block is always written
    whole (by a swap-out or a store) before it is read, and a large pool should not touch its pages up front."""
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    pin = device.type == "cuda"
    return KVCache(
        [torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(config.num_hidden_layers)],
        [torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(config.num_hidden_layers)],
    )


def swap_blocks(src: KVCache, dst: KVCache, pairs: list[tuple[int, int]]) -> None:
    """For every layer's K and V: block `s` of `src` into block `d` of `dst`, for each (s, d) in `pairs`.

    One indexed gather and one indexed write per cache tensor, however many pairs (2 × layers copies in all).
    Pairs must have distinct destinations (the block pools guarantee it: each is a block handed out once).
    """
    if not pairs:
        return
    device = src.key_caches[0].device
    src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)  # (P,)
    dst_ids = torch.tensor([d for _, d in pairs], dtype=torch.long, device=dst.key_caches[0].device)  # (P,)
    for src_cache, dst_cache in zip(src.key_caches + src.value_caches, dst.key_caches + dst.value_caches, strict=True):
        dst_cache[dst_ids] = src_cache[src_ids].to(dst_cache.device)  # (P, block_size, Hkv, D)

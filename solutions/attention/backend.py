"""What the model asks of an attention backend: one call per layer, with that layer's new q, k and v.

The model never knows where the keys and values live — nowhere (chapter 1), a contiguous cache (chapter 2), a
paged cache read by PyTorch, by the CPU's compiled kernel or by Triton (chapters 3, 5 and 6) — each backend is
built for one step from that step's metadata and passed down explicitly.

A backend the engine can be asked for (`registry.py`) is built by the model runner, once per step, as
`backend_cls(kv_cache, metadata)`, and says as a class what the engine's options may pair it with: the devices it
runs on, those where the runner compiles the forward pass around it, and whether it runs under tensor parallelism.

Where this lives in vLLM: `vllm/v1/attention/backend.py` (`AttentionBackend`, `AttentionImpl.forward`; vLLM moved
it there from `attention/backends/abstract.py`).
"""

from typing import ClassVar, Protocol

import torch

from solutions.attention.paged import AttentionMetadata, KVCache


class AttentionBackend(Protocol):
    """Computes attention for one layer, given this step's new q/k/v; it may read and write a KV cache."""

    devices: ClassVar[tuple[str, ...]]  # the device types it runs on ("cpu", "cuda")
    # where the model runner compiles the forward pass around it unless `enforce_eager` (on "cuda": and captures
    # CUDA graphs of pure-decode steps, from the backend's `for_decode`)
    compiles_on: ClassVar[tuple[str, ...]]
    supports_tensor_parallel: ClassVar[bool]  # whether each rank of tensor parallelism may run it

    def __init__(self, kv_cache: KVCache, metadata: AttentionMetadata) -> None:
        """One step's backend: `metadata` on the host; what the backend indexes with, copied to the cache's device."""
        ...

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, Hq, D), k and v (T, Hkv, D) for the T new tokens -> attention output (T, Hq, D); a layer with a
        sliding window (`KVCache.sliding_window(layer_idx)`) shows each query only the keys in its window."""
        ...

"""What the model asks of an attention backend: one call per layer, with that layer's new q, k and v.

The model never knows where the keys and values live — nowhere (chapter 1), a contiguous cache (chapter 2), a
paged cache read by PyTorch, by the CPU's compiled kernel or by Triton (chapters 3, 5 and 6) — each backend is
built for one step from that step's metadata and passed down explicitly.

Where this lives in vLLM: `vllm/attention/backends/abstract.py` (`AttentionBackend`, `AttentionImpl.forward`).
"""

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    """Computes attention for one layer, given this step's new q/k/v; it may read and write a KV cache."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, Hq, D), k and v (T, Hkv, D) for the T new tokens -> attention output (T, Hq, D)."""
        ...

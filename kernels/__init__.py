"""Triton kernels for paged attention, each beside a pure-PyTorch reference that says what it computes.

- `kv_store`: write each new token's K and V into the paged cache at its slot (vLLM's `reshape_and_cache_flash`).
- `paged_decode`: one query token per sequence attends to its context read through the block table, with an
  online softmax; optionally split over the context (flash-decoding) and merged by log-sum-exp.
- `unified_attention`: a mixed batch of prefills and decodes in one kernel (vLLM's `triton_unified_attention`).

Cache layout, as in vLLM's FlashAttention backend: `[num_blocks, block_size, num_kv_heads, head_dim]`, block
tables `[num_seqs, max_blocks]` int32.

Without a CUDA device the kernels run in Triton's interpreter, on the CPU: importing this package (or `solutions`)
sets `TRITON_INTERPRET=1` (unless it is already set) before any kernel is decorated, so `import kernels` just works
— provided Triton itself was not imported earlier without it (then importing this package says so).
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton's own standard library (tl.sum, tl.cdiv, ...) was decorated for compilation when it was imported;
        # kernels decorated for the interpreter cannot call it. Only setting the switch first avoids that.
        raise RuntimeError(
            "Triton was imported before `kernels`, without TRITON_INTERPRET=1, and there is no GPU: import `kernels` "
            "(or `solutions`) before anything that imports Triton (transformers may), or run with TRITON_INTERPRET=1"
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.kv_store import kv_store_kernel, store_kv_cache, store_kv_cache_reference  # noqa: E402
from kernels.paged_decode import (  # noqa: E402
    choose_num_splits,
    merge_splits_kernel,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_decode_kernel,
    paged_decode_split_kernel,
)
from kernels.unified_attention import unified_attention, unified_attention_kernel, unified_attention_reference  # noqa: E402

# In the interpreter a kernel object reports Triton's module as its own; name the module that defines it, so that
# `from <kernel.__module__> import <kernel.__name__>` finds it (chapter notebooks import the reference that way).
for _module in ("kv_store", "paged_decode", "unified_attention"):
    for _kernel in vars(__import__(f"kernels.{_module}", fromlist=["_"])).values():
        if getattr(_kernel, "__module__", None) == "triton.runtime.interpreter":
            _kernel.__module__ = f"kernels.{_module}"

__all__ = [
    "choose_num_splits",
    "kv_store_kernel",
    "merge_splits_kernel",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_decode_kernel",
    "paged_decode_split_kernel",
    "store_kv_cache",
    "store_kv_cache_reference",
    "unified_attention",
    "unified_attention_kernel",
    "unified_attention_reference",
]


def interpreted() -> bool:
    """True when kernels run in Triton's interpreter (on the CPU) rather than compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"

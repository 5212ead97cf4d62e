"""Triton kernels for paged attention, each beside a pure-PyTorch reference that says what it computes.

- `kv_store`: write each new token's K and V into the paged cache at its slot (vLLM's `reshape_and_cache_flash`).
- `paged_decode`: one query token per sequence attends to its context read through the block table, with an
  online softmax; optionally split over the context (flash-decoding) and merged by log-sum-exp.
- `unified_attention`: a mixed batch of prefills and decodes in one kernel (vLLM's `triton_unified_attention`).
- warm-ups of chapter 6: `online_softmax` (the online softmax in PyTorch, tile by tile) and `contiguous_decode`
  (the decode kernel over a contiguous cache, before the block table).

Cache layout, as in vLLM's FlashAttention backend: `[num_blocks, block_size, num_kv_heads, head_dim]`, block
tables `[num_seqs, max_blocks]` int32.

Without a CUDA device the kernels run in Triton's interpreter, on the CPU: importing this package (or `solutions`)
sets `TRITON_INTERPRET=1` (unless it is already set) before any kernel is decorated, so `import kernels` just works.
Triton reads that switch when it decorates a function, its own standard library (`tl.sum`, `tl.max`, ...) included,
and `transformers` may import Triton before anything of the course runs. So when Triton is already there, decorated
for compilation, and there is no GPU, this package re-decorates Triton's standard library for the interpreter — the
state Triton would be in had the switch been set first. Importing never fails: if the interpreter cannot be switched
on (`TRITON_INTERPRET=0` with no GPU, or a Triton whose layout this package does not know), the first kernel launch
raises `RuntimeError` saying what to do. With a GPU nothing is switched: the kernels compile natively, and their
tensors must be CUDA tensors.
"""

import os
import sys

import torch

from kernels import validation


def _interpret_triton_language() -> int:
    """Re-decorate every function of Triton's standard library that was decorated for compilation (a
    `JITFunction`) as an interpreted one, in every loaded `triton.language` module and as a `tl.tensor` method.

    A kernel running in the interpreter calls `tl.sum` as a Python function; a `JITFunction` refuses ("Cannot
    call @triton.jit'd outside of the scope of a kernel"). Wrapping the same Python function as
    `triton.jit` does under `TRITON_INTERPRET=1` restores the state of an interpreted import. Returns how many
    functions were re-decorated.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    interpreted: dict[int, InterpretedFunction] = {}

    def as_interpreted(fn: JITFunction) -> InterpretedFunction:
        return interpreted.setdefault(id(fn), InterpretedFunction(fn.fn))

    for name, module in list(sys.modules.items()):
        if name == "triton.language" or name.startswith("triton.language."):
            for attr, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    setattr(module, attr, as_interpreted(value))
    tensor_class = sys.modules["triton.language"].tensor
    for attr, value in list(vars(tensor_class).items()):
        if isinstance(value, JITFunction):  # `x.sum(axis=0)`: a plain function, so that `x` binds as the first argument
            fn = as_interpreted(value)
            setattr(tensor_class, attr, lambda *args, _fn=fn, **kwargs: _fn(*args, **kwargs))
    return len(interpreted)


def _triton_language_compiled() -> bool:
    """True if Triton's standard library is loaded and was decorated for compilation, not for the interpreter."""
    standard = sys.modules.get("triton.language.standard")
    if standard is None:
        return False
    from triton.runtime.jit import JITFunction

    return any(isinstance(value, JITFunction) for value in vars(standard).values())


if not torch.cuda.is_available():
    if os.environ.get("TRITON_INTERPRET", "1") != "1":  # switched off on purpose: respected, reported at launch
        validation.LAUNCH_ERROR = (
            f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} and there is no GPU: compiled Triton kernels need a "
            "CUDA device. Unset TRITON_INTERPRET (or set it to 1) before starting Python to run the kernels in "
            "Triton's interpreter on the CPU."
        )
    else:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel below is decorated
        if _triton_language_compiled():  # Triton came first (transformers imports it), without the switch
            try:
                _interpret_triton_language()
            except Exception as exc:  # an unknown Triton layout: fail at the first launch, saying what to do
                validation.LAUNCH_ERROR = (
                    f"Triton was imported before `kernels`, without TRITON_INTERPRET=1, and there is no GPU; "
                    f"switching its standard library to the interpreter failed ({type(exc).__name__}: {exc}). "
                    "Import `kernels` (or `solutions`) before anything that imports Triton (transformers may), or "
                    "start Python with TRITON_INTERPRET=1."
                )

import triton  # noqa: E402

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
from kernels.contiguous_decode import (  # noqa: E402
    contiguous_decode_attention,
    contiguous_decode_attention_reference,
    contiguous_decode_kernel,
)
from kernels.online_softmax import online_softmax_attention, online_softmax_attention_reference  # noqa: E402

# In the interpreter a kernel object reports Triton's module as its own; name the module that defines it, so that
# `from <kernel.__module__> import <kernel.__name__>` finds it (chapter notebooks import the reference that way).
for _module in ("kv_store", "paged_decode", "unified_attention", "contiguous_decode"):
    for _kernel in vars(__import__(f"kernels.{_module}", fromlist=["_"])).values():
        if getattr(_kernel, "__module__", None) == "triton.runtime.interpreter":
            _kernel.__module__ = f"kernels.{_module}"

__all__ = [
    "choose_num_splits",
    "contiguous_decode_attention",
    "contiguous_decode_attention_reference",
    "contiguous_decode_kernel",
    "kv_store_kernel",
    "merge_splits_kernel",
    "online_softmax_attention",
    "online_softmax_attention_reference",
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
    return not isinstance(kv_store_kernel, triton.runtime.jit.JITFunction)

"""The attention backends an engine can be asked for, by the name its `attention_backend` option takes.

The names live here, below every layer that checks or lists them (the engine's arguments, the model runner that
builds the backend, a benchmark's flags), so none of those imports another to learn them. Each name maps to its
backend class, imported when that name is asked for (so Triton is imported only for "triton"); what the engine's
options may pair a backend with, the class says itself (`AttentionBackend`'s class attributes). Adding a backend
is one class and one line here.

    torch     PyTorch gathers through the block table (chapters 3 and 5; `torch_backend.py`)
    inductor  the CPU's fast path: one compiled graph per step (`inductor_backend.py`)
    triton    chapter 6's kernels (`triton_backend.py`), natively on a GPU, interpreted on the CPU

Where this lives in vLLM: `vllm/v1/attention/backends/registry.py` (`AttentionBackendEnum`, name -> class path).
"""

import importlib

from solutions.attention.backend import AttentionBackend
from solutions.exceptions import check_one_of

_BACKEND_CLASSES = {  # name -> the backend class's qualified name
    "torch": "solutions.attention.torch_backend.TorchAttentionBackend",
    "inductor": "solutions.attention.inductor_backend.InductorAttentionBackend",
    "triton": "solutions.attention.triton_backend.TritonAttentionBackend",
}
ATTENTION_BACKENDS = tuple(_BACKEND_CLASSES)


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class of `name`, imported now; a ParameterError naming `attention_backend` for another name."""
    check_one_of("attention_backend", name, tuple(_BACKEND_CLASSES))
    module, _, cls_name = _BACKEND_CLASSES[name].rpartition(".")
    return getattr(importlib.import_module(module), cls_name)

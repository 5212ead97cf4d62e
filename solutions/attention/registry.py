"""The attention backends an engine can be asked for, by the name its `attention_backend` option takes.

The names live here, below every layer that checks or lists them (the engine's arguments, the model runner that
builds the backend, a benchmark's flags), so none of those imports another to learn them: the model runner maps a
name to its backend class, importing Triton only when "triton" is asked for.

    torch     PyTorch gathers through the block table (chapters 3 and 5; `torch_backend.py`)
    inductor  the CPU's fast path: one compiled graph per step (`inductor_backend.py`)
    triton    chapter 6's kernels (`triton_backend.py`), natively on a GPU, interpreted on the CPU

Where this lives in vLLM: `vllm/attention/backends/registry.py` (`AttentionBackendEnum`).
"""

ATTENTION_BACKENDS = ("torch", "inductor", "triton")

"""The reference engine: a small vLLM-shaped inference engine over a paged KV cache.

    from solutions import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")
    llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=32))
"""

import os

import torch

# Without a GPU, Triton runs only in its interpreter (chapter 6's `attention_backend="triton"`), and the switch is
# read when Triton decorates a function — including its own standard library, when it is first imported (which
# `transformers` may do). So it is set here, before anything else can import Triton. (If Triton came first anyway,
# `import kernels` switches its standard library over; see kernels/__init__.py.)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from solutions.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from solutions.entrypoints.llm import LLM
from solutions.outputs import CompletionOutput, FinishReason, RequestOutput
from solutions.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
    "RequestOutput", "CompletionOutput", "FinishReason",
]

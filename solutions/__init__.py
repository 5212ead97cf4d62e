"""The reference engine: a small vLLM-shaped inference engine over a paged KV cache.

    from solutions import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")
    llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=32))
"""

from solutions.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from solutions.llm import LLM
from solutions.outputs import CompletionOutput, FinishReason, RequestOutput
from solutions.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "RequestOutput", "CompletionOutput", "FinishReason"]

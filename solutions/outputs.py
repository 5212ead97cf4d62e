"""What `LLM.generate` returns, shaped like vLLM's `RequestOutput` (`vllm/outputs.py`)."""

from dataclasses import dataclass
from enum import Enum


class FinishReason(str, Enum):
    """Why a completion ended; a `str` subclass, so `reason == "length"` works as in vLLM."""

    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens reached, or the context reached max_model_len


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool

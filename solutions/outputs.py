"""What the engine returns, shaped like vLLM's `RequestOutput` (`vllm/outputs.py`, `vllm/logprobs.py`)."""

from dataclasses import dataclass
from enum import Enum


# A chunk of a prompt's logprobs, as the runner computes it and the engine core sends it: (the prompt position of its
# first token, then per token (top, (logprob, rank))).
PromptLogprobsChunk = tuple[int, list[tuple[list[tuple[int, float]], tuple[float, int]]]]


class FinishReason(str, Enum):
    """Why a completion ended; a `str` subclass, so `reason == "length"` works as in vLLM."""

    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens reached, or the context reached max_model_len
    ABORT = "abort"  # the caller aborted the request


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
    cumulative_logprob: float | None = None  # with `logprobs` requested
    logprobs: list[dict[int, Logprob]] | None = None  # per token: the top `logprobs` tokens and the sampled one

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache instead of computed
    # with `prompt_logprobs`: per prompt token, the top tokens and the actual one, None for the first (nothing
    # predicts it). A DELTA request gets them all in its first output, [] in the later ones (as vLLM).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

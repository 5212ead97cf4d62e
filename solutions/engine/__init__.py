"""The engine: the front ends (`LLMEngine`, `AsyncLLM`: processor, output processor, a client) over the engine
core (`EngineCore`: scheduler, executor, structured output manager), and the messages between them: requests down
(`EngineCoreRequest`), replies up (`EngineCoreOutputs`, which the scheduler fills in `update_from_output`). Both
sides import the messages from here, so a front end needs nothing of the core's.

Where this lives in vLLM: `vllm/v1/engine/__init__.py` (`EngineCoreRequest`, `EngineCoreRequestType`,
`EngineCoreOutput`, `EngineCoreOutputs`).
"""

import time
from dataclasses import dataclass, field
from enum import Enum

from solutions.metrics.stats import SchedulerStats
from solutions.outputs import FinishReason, PromptLogprobsChunk
from solutions.sampling_params import SamplingParams


class EngineCoreRequestType(Enum):
    ADD = "add"  # payload: an EngineCoreRequest
    ABORT = "abort"  # payload: list of request ids (unknown or finished ones are ignored)
    SHUTDOWN = "shutdown"  # payload: None


@dataclass(slots=True)
class EngineCoreRequest:
    """A request the front end has validated and tokenised: all the engine core needs to queue it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0


@dataclass(slots=True)
class EngineCoreOutput:
    """What one sample of a request got in one step: its new tokens (one, or more with speculative decoding), and
    its finish if it finished."""

    request_id: str
    index: int  # which of the request's n samples
    new_token_ids: list[int]
    new_logprobs: list[tuple[list[tuple[int, float]] | None, tuple[float, int]]] | None = None  # (top, sampled)
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int | None = None  # set in the step the request's prompt was looked up in the prefix cache
    new_prompt_logprobs: PromptLogprobsChunk | None = None  # this step's chunk of the prompt's logprobs


@dataclass(slots=True)
class EngineCoreOutputs:
    """One message from the engine core: a step's outputs and stats, or a refusal, or a stats report between
    steps (no outputs)."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    errors: dict[str, str] = field(default_factory=dict)  # request id -> why the core refused to add it
    timestamp: float = field(default_factory=time.monotonic)  # when it was put on the queue (one clock per host)

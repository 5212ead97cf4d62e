"""The engine: the front ends (`LLMEngine`, `AsyncLLM`: processor, output processor, a client) over the engine
core (`EngineCore`: scheduler, executor, structured output manager), and the messages between them.

Where this lives in vLLM: `vllm/v1/engine/__init__.py` (`EngineCoreRequest`, `EngineCoreRequestType`; the
outputs, `EngineCoreOutput(s)`, are made by the scheduler here: `solutions/core/sched/output.py`).
"""

from dataclasses import dataclass
from enum import Enum

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

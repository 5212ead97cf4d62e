"""The caller's mistakes, with the field they are about.

A bad option or a bad request is a `ValueError` whose message names the field and the allowed values; this
subclass also carries the field's name, so the server reports it as OpenAI's `param` without parsing the message.

Where this lives in vLLM: `vllm/exceptions.py` (`VLLMValidationError`, a `ValueError` with a `parameter`).
"""


class ParameterError(ValueError):
    """`parameter` is the field at fault: an `EngineArgs` option, a `SamplingParams` field, or "prompt"."""

    def __init__(self, message: str, parameter: str) -> None:
        super().__init__(message)
        self.parameter = parameter

    def __reduce__(self) -> tuple:  # crosses the engine core's process boundary whole
        return type(self), (str(self), self.parameter)

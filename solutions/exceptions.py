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


def check_one_of(name: str, value: object, allowed: tuple, extra: str = "", parameter: str | None = None) -> None:
    """ParameterError naming `name` and `allowed` unless `value` is one of them (`parameter`: the field, if not
    `name`)."""
    if value not in allowed:
        raise ParameterError(
            f"{name} must be one of {allowed}{' ' + extra if extra else ''}, got {value!r}", parameter or name
        )


def check_positive_int(name: str, value: object) -> None:
    """ParameterError naming `name` unless `value` is an int > 0 (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ParameterError(f"{name} must be a positive int, got {value!r}", name)

"""How to sample one request: vLLM's `SamplingParams`, validated once, at the boundary.

Where this lives in vLLM: `vllm/sampling_params.py` (`SamplingParams`, `StructuredOutputsParams`).
"""

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from solutions.exceptions import ParameterError


class RequestOutputKind(Enum):
    """What `LLMEngine.step()` reports for a request (vLLM's name)."""

    DELTA = "delta"  # each step: only the tokens and text that are new since the last output (streaming)
    FINAL_ONLY = "final_only"  # nothing until it finishes, then everything (what `LLM.generate` uses)


def _require(ok: bool, field_name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ParameterError(f"SamplingParams.{field_name} must be {allowed}, got {value!r}", field_name)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class StructuredOutputsParams:
    """What the output must look like: exactly one of a JSON schema, any JSON object, a regular expression, a
    list of choices, or a grammar in Lark syntax. The engine turns it into a token mask at every step
    (`solutions/structured_output/`), so the output always conforms.
    """

    json: str | dict[str, Any] | None = None  # a JSON schema (a dict, or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None  # the whole output matches this regular expression (Rust `regex` syntax)
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a context-free grammar in Lark syntax, with a `start` rule

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ParameterError(
                "StructuredOutputsParams needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {given or 'none'}", "structured_outputs",
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ParameterError(
                f"StructuredOutputsParams.json must be a JSON schema (dict or str), got {type(self.json).__name__}",
                "structured_outputs",
            )
        if not isinstance(self.json_object, bool):
            raise ParameterError(
                f"StructuredOutputsParams.json_object must be True or False, got {self.json_object!r}",
                "structured_outputs",
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ParameterError(
                    f"StructuredOutputsParams.{name} must be a non-empty string, got {value!r}", "structured_outputs"
                )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ParameterError(
                f"StructuredOutputsParams.choice must be a non-empty list of non-empty strings, got {self.choice!r}",
                "structured_outputs",
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "json_object", "regex", "choice" or "grammar"."""
        return "json_object" if self.json_object else next(
            name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None
        )

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec as text): the grammar cache's key. Key order is kept: a schema's property order is the
        order the output writes them in."""
        spec = {
            "json": self.json, "json_object": True, "regex": self.regex, "choice": self.choice, "grammar": self.grammar
        }[self.kind]
        return self.kind, spec if isinstance(spec, str) else json.dumps(spec)


@dataclass
class SamplingParams:
    n: int = 1  # independent completions per prompt (parallel sampling)
    temperature: float = 1.0  # 0 means greedy: always the most likely token
    top_p: float = 1.0  # keep the smallest set of tokens whose probability adds up to top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 keeps all
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one; 0 keeps all
    max_tokens: int = 16  # generate at most this many tokens
    stop: list[str] = field(default_factory=list)  # finish when the text contains one; it is cut from the text
    stop_token_ids: list[int] = field(default_factory=list)  # finish after generating one of these
    ignore_eos: bool = False  # keep going past the model's end-of-sequence token
    seed: int | None = None  # per-request random seed: the same seed gives the same samples
    logprobs: int | None = None  # also return this many most likely tokens' log-probabilities per step
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    # constrain the output to a schema, regex, choice, grammar
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _require(_is_int(self.n) and self.n >= 1, "n", "an int >= 1", self.n)
        _require(
            _is_number(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0", self.temperature
        )
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(_is_int(self.top_k) and self.top_k >= -1, "top_k", "-1, 0 (both: disabled) or an int >= 1", self.top_k)
        _require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an int >= 1", self.max_tokens)
        _require(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            "stop", "a non-empty string or a list of them", self.stop,
        )
        _require(
            isinstance(self.stop_token_ids, list) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids", "a list of non-negative ints", self.stop_token_ids,
        )
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", "True or False", self.ignore_eos)
        _require(self.seed is None or _is_int(self.seed), "seed", "None or an int", self.seed)
        _require(
            self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
            "logprobs", "None or an int >= 0", self.logprobs,
        )
        _require(
            isinstance(self.output_kind, RequestOutputKind), "output_kind", "a RequestOutputKind", self.output_kind
        )
        _require(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs", "None or a StructuredOutputsParams", self.structured_outputs,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

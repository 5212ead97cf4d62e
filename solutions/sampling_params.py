"""How to sample one request: vLLM's `SamplingParams`, validated once, at the boundary.

Where this lives in vLLM: `vllm/sampling_params.py` (`SamplingParams`, `StructuredOutputsParams`).
"""

import json
import math
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
    (`solutions/structured_output/`), so the output always conforms. `whitespace_pattern` (JSON only): the
    whitespace allowed between two JSON tokens, as a regular expression, in place of the engine's bounded default.
    """

    json: str | dict[str, Any] | None = None  # a JSON schema (a dict, or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None  # the whole output matches this regular expression (Rust `regex` syntax)
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a context-free grammar in Lark syntax, with a `start` rule
    whitespace_pattern: str | None = None  # JSON: one run of whitespace between tokens (Rust `regex` syntax)

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
        self._check_whitespace_pattern()

    def _check_whitespace_pattern(self) -> None:
        """A non-empty string, for a JSON constraint only (whether it parses is the backend's check)."""
        if self.whitespace_pattern is None:
            return
        if not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern:
            raise ParameterError(
                f"StructuredOutputsParams.whitespace_pattern must be a non-empty string, got "
                f"{self.whitespace_pattern!r}", "structured_outputs",
            )
        if self.kind not in ("json", "json_object"):
            raise ParameterError(
                f"StructuredOutputsParams.whitespace_pattern applies to json and json_object only, not {self.kind}",
                "structured_outputs",
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "json_object", "regex", "choice" or "grammar"."""
        return "json_object" if self.json_object else next(
            name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None
        )

    @property
    def key(self) -> tuple[str, str, str | None]:
        """(kind, spec as text, whitespace_pattern): the grammar cache's key. Key order is kept: a schema's
        property order is the order the output writes them in."""
        spec = {
            "json": self.json, "json_object": True, "regex": self.regex, "choice": self.choice, "grammar": self.grammar
        }[self.kind]
        return self.kind, spec if isinstance(spec, str) else json.dumps(spec), self.whitespace_pattern


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
    # the log-probability of each prompt token after the first, and of this many most likely tokens there
    prompt_logprobs: int | None = None
    # penalties on tokens already seen (vLLM's, applied to the logits before temperature, greedy rows included):
    repetition_penalty: float = 1.0  # prompt and output tokens: a positive logit divided by it, a negative multiplied
    presence_penalty: float = 0.0  # output tokens: subtracted once from a token that occurred at all
    frequency_penalty: float = 0.0  # output tokens: subtracted once per occurrence
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these tokens can be sampled
    # words that may not be generated: the last token of a word's tokens is banned wherever the output ends with
    # the ones before it (set from the tokenizer by the front end: `update_from_tokenizer`)
    bad_words: list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    # constrain the output to a schema, regex, choice, grammar
    structured_outputs: StructuredOutputsParams | None = None
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)  # each bad word's tokens

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
            self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
            "prompt_logprobs", "None or an int >= 0", self.prompt_logprobs,
        )
        _require(
            _is_number(self.repetition_penalty) and 0 < self.repetition_penalty < math.inf,
            "repetition_penalty", "a finite number > 0 (1 disables it)", self.repetition_penalty,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_number(value) and -2 <= value <= 2, name, "in [-2, 2] (0 disables it)", value)
        _require(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens", f"an int in [0, max_tokens={self.max_tokens}]", self.min_tokens,
        )
        _require(
            self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
                _is_int(t) and t >= 0 and _is_number(b) and math.isfinite(b) for t, b in self.logit_bias.items()
            )),
            "logit_bias", "None or a dict of token id (an int >= 0) -> a finite number", self.logit_bias,
        )
        _require(
            self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                                               and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
            "allowed_token_ids", "None or a non-empty list of token ids (ints >= 0)", self.allowed_token_ids,
        )
        _require(
            self.bad_words is None or (isinstance(self.bad_words, list) and all(
                isinstance(w, str) and w.strip() for w in self.bad_words
            )), "bad_words", "None or a list of non-blank strings", self.bad_words,
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

    @property
    def has_penalties(self) -> bool:
        """Whether a repetition, presence or frequency penalty changes the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_logit_bias(self) -> bool:
        """Whether `min_tokens`, `logit_bias`, `allowed_token_ids` or `bad_words` adds to the logits (`sample`'s one
        bias)."""
        return self.min_tokens > 0 or bool(self.logit_bias) or self.allowed_token_ids is not None or bool(
            self.bad_words
        )

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """A request that wants its prompt's logprobs computes its whole prompt: a prefix-cache hit would skip the
        forward pass over the cached tokens, and with it their logits (vLLM's `skip_reading_prefix_cache`). Its
        blocks are still cached for the requests after it."""
        return self.prompt_logprobs is not None

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenise `bad_words` (the front end's processor calls it; a ParameterError without a tokenizer). Each
        word is banned as written and, as a word inside the text, after a space (vLLM's rule: the spaced form only
        when it is as many tokens and starts with a different one)."""
        if not self.bad_words:
            return
        _require(
            tokenizer is not None, "bad_words", "None or [] with a model folder that has no tokenizer", self.bad_words
        )
        self._bad_words_token_ids = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            self._bad_words_token_ids.append(plain)
            if len(spaced) == len(plain) and spaced[0] != plain[0]:
                self._bad_words_token_ids.append(spaced)

    def verify_token_ids(self, vocab_size: int) -> None:
        """ParameterError unless every token id `logit_bias`, `allowed_token_ids` and `bad_words` name lies in
        [0, vocab_size): the sampler indexes the logits with them. (The front end's processor calls it: only it
        knows the model.)"""
        for name, token_ids in (
            ("logit_bias", self.logit_bias or {}), ("allowed_token_ids", self.allowed_token_ids or []),
            ("bad_words", [t for word in self._bad_words_token_ids for t in word]),
        ):
            bad = [t for t in token_ids if t >= vocab_size]
            _require(not bad, name, f"token ids in [0, {vocab_size})", bad)

"""JSON schemas, regular expressions and grammars, compiled by llguidance into token masks.

llguidance (the engine behind Microsoft's Guidance, one of vLLM's backends) parses the output with an Earley
parser over a lexer and computes each step's allowed tokens by walking a trie of the vocabulary's bytes. vLLM's
default, `auto`, takes xgrammar where it can and llguidance otherwise.

Why llguidance here (`python -m benchmarks.structured_output`, xgrammar 0.2.8, SmolLM2's tokenizer, a 4-field
schema, a 2-core Intel Xeon, 2026-11-23, one run): compiling took about 0.5 ms against xgrammar's 104 ms. A lazy
compiler against an eager one: xgrammar's precomputed masks are cheaper afterwards (1.3 µs against 27 µs per
request per step; 1.6 ms at 64 requests, filled while a ~130 ms forward pass runs), but this engine compiles at
`add_request`, between two steps (vLLM compiles on a thread pool while the request waits), where a lazy compiler
costs the steps less. llguidance also needs nothing else installed.

Where this lives in vLLM: `vllm/v1/structured_output/backend_guidance.py` (`GuidanceBackend`, `GuidanceGrammar`).
Its JSON whitespace (read 2026-12-07; that file at commit 0492a43): llguidance's `whitespace_flexible` unless the
engine's `disable_any_whitespace` (`StructuredOutputsConfig`, `vllm/config/structured_outputs.py` at 0172203);
the request's `StructuredOutputsParams.whitespace_pattern` (`vllm/sampling_params.py` at 00388f6) is accepted but
not read there. Here the request's pattern is honoured, and the default is bounded (`json_options`).
"""

import json

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from transformers import PreTrainedTokenizerBase

from solutions.exceptions import ParameterError
from solutions.sampling_params import StructuredOutputsParams


# The whitespace one gap between two JSON tokens may hold by default: a line break and an indent, or a space.
# Bounded, so a sample cannot spend its budget in one gap. Under llguidance's flexible whitespace (`[ \t\n\r]+`
# in every gap, vLLM's guidance default) SmolLM2-135M given "JSON:" and a two-field object schema at temperature 1
# (seed 11, max_tokens 120) wrote `{\n    \n\n"name":  "jack"` and then line breaks until it ran out. Not none
# at all either: JSON without whitespace forbids the layout the model writes of its own accord
# (`{\n  "name": "Alejandro",\n  "age": 25\n}`), and greedy SmolLM2-135M-Instruct in chat then wrote
# `{"Alec":18,"Alec-18":18,...` until max_tokens. `python -m benchmarks.structured_output --validity` (30 seeded
# samples each, 2 shared cores, 2026-12-07, one run): valid object, array, nested 29, 29, 28 of 30 under flexible
# whitespace; 30, 30, 30 under this bound, and under none.
BOUNDED_WHITESPACE = r"\n? {0,8}"
WHITESPACE_OPTIONS = ("whitespace_flexible", "whitespace_pattern")  # llguidance's keys that decide the whitespace


def json_options(params: StructuredOutputsParams, schema: object, disable_any_whitespace: bool) -> dict[str, dict]:
    """llguidance's JSON compile options, as keywords of `grammar_from_json_schema` (it applies `defaults`, then
    the schema's own `x-guidance`, then `overrides`): the request's `whitespace_pattern` over all; else the
    schema's own whitespace options over the engine's, which are none at all (`disable_any_whitespace`, vLLM's
    engine option) or `BOUNDED_WHITESPACE`."""
    if params.whitespace_pattern is not None:
        return {"overrides": {"whitespace_pattern": params.whitespace_pattern}}
    own = schema.get("x-guidance") if isinstance(schema, dict) else None
    if isinstance(own, dict) and own.keys() & set(WHITESPACE_OPTIONS):
        return {}
    if disable_any_whitespace:
        return {"defaults": {"whitespace_flexible": False}}
    return {"defaults": {"whitespace_pattern": BOUNDED_WHITESPACE}}


class GuidanceGrammar:
    """One sample's llguidance matcher (a `StructuredOutputGrammar`)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return self.matcher.consume_tokens(token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)  # drops the GIL while it computes

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()


class GuidanceBackend:
    """Compiles `StructuredOutputsParams` against one tokenizer; each compiled grammar serves many matchers."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_id: int | None,
        disable_any_whitespace: bool = False,
    ) -> None:
        # Wrapping the tokenizer walks the whole vocabulary (a few hundred ms): once per engine.
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)
        self.disable_any_whitespace = disable_any_whitespace

    def grammar_text(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar of `params` (not yet checked against the vocabulary); ParameterError if the
        constraint does not parse."""
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else params.json
                schema = json.loads(schema) if isinstance(schema, str) else schema
                options = json_options(params, schema, self.disable_any_whitespace)
                return llguidance.LLMatcher.grammar_from_json_schema(schema, **options)
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(params.regex)
            return llguidance.LLMatcher.grammar_from_lark(params.grammar)
        except ValueError as error:  # json.JSONDecodeError is a ValueError too
            raise ParameterError(
                f"StructuredOutputsParams.{kind} is not valid: {error}", "structured_outputs"
            ) from error

    def validate_grammar(self, params: StructuredOutputsParams) -> None:
        """The front end's check, before anything is queued: ParameterError naming the field if `params` is not
        valid for this vocabulary (vLLM: `validate_guidance_grammar`)."""
        if params.whitespace_pattern is not None:
            self._validate_whitespace_pattern(params.whitespace_pattern)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            self.grammar_text(params), self.ll_tokenizer
        )
        if is_error:
            raise ParameterError(
                f"StructuredOutputsParams.{params.kind} is not valid: {'; '.join(messages)}", "structured_outputs"
            )

    @staticmethod
    def _validate_whitespace_pattern(pattern: str) -> None:
        """ParameterError naming `whitespace_pattern` unless llguidance parses it as a regular expression (checked
        alone, so the schema's own patterns are not blamed on it)."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_regex(pattern)
        )
        if is_error:
            raise ParameterError(
                f"StructuredOutputsParams.whitespace_pattern is not valid: {'; '.join(messages)}", "structured_outputs"
            )

    def compile_grammar(self, params: StructuredOutputsParams) -> str:
        """The engine core's side: the grammar a matcher is built from (validated by the front end already)."""
        return self.grammar_text(params)

    def new_grammar(self, grammar: str) -> GuidanceGrammar:
        """A fresh matcher at the start of the output."""
        return GuidanceGrammar(llguidance.LLMatcher(self.ll_tokenizer, grammar))

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
"""

import json

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from transformers import PreTrainedTokenizerBase

from solutions.exceptions import ParameterError
from solutions.sampling_params import StructuredOutputsParams


# JSON with any whitespace between its tokens, as vLLM's guidance backend compiles it (`whitespace_flexible`, its
# default unless `disable_any_whitespace`), and as a default only: a schema's own `x-guidance` options win. JSON
# without whitespace forbids the layout the model writes of its own accord, and the mask then pushes it somewhere
# worse: greedy SmolLM2-135M-Instruct asked for `{"type": "object"}` in chat ("Invent a person: give a name and an
# age.") wrote `{"Alec":18,"Alec-18":18,...` until max_tokens under a grammar without whitespace, and
# `{\n  "name": "Alejandro",\n  "age": 25\n}` (20 tokens, then the grammar is complete) under this one.
JSON_DEFAULTS = {"whitespace_flexible": True}


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

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_id: int | None) -> None:
        # Wrapping the tokenizer walks the whole vocabulary (a few hundred ms): once per engine.
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)

    @staticmethod
    def grammar_text(params: StructuredOutputsParams) -> str:
        """The llguidance grammar of `params` (not yet checked against the vocabulary); ParameterError if the
        constraint does not parse."""
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else params.json
                schema = json.loads(schema) if isinstance(schema, str) else schema
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
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
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            self.grammar_text(params), self.ll_tokenizer
        )
        if is_error:
            raise ParameterError(
                f"StructuredOutputsParams.{params.kind} is not valid: {'; '.join(messages)}", "structured_outputs"
            )

    def compile_grammar(self, params: StructuredOutputsParams) -> str:
        """The engine core's side: the grammar a matcher is built from (validated by the front end already)."""
        return self.grammar_text(params)

    def new_grammar(self, grammar: str) -> GuidanceGrammar:
        """A fresh matcher at the start of the output."""
        return GuidanceGrammar(llguidance.LLMatcher(self.ll_tokenizer, grammar))

"""Structured output: every step, each constrained sample gets a mask of the tokens its grammar allows next.

    SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))   # or regex=, choice=, grammar=

The manager's part of a step, in the order the engine runs them:
    grammar_init     at `add_request`: compile the constraint (cached by its text), one matcher per sample;
                     a constraint that does not compile is a ValueError there, before anything is queued
    submit_bitmask   at the end of `schedule()`: start filling the mask rows of the samples that sample this
                     step, on a worker thread, while the forward pass runs (the library drops the GIL)
    grammar_bitmask  in `sample()`: the step's (N, W) mask, every row of an unconstrained sample all ones;
                     the sampler applies it to the logits first (`apply_token_bitmask`)
    then `update_from_output` advances each matcher by its sampled token, and a sample whose grammar is
    complete (`is_terminated`) finishes with finish_reason "stop".

A matcher lives with its sample, so nothing changes for the rest of the engine. Preemption by recompute keeps a
sequence's tokens, and so its matcher's state is still right when the sequence resumes: it recomputes K/V for
tokens the matcher has already accepted, and samples the next one. Prefix caching and streaming never touch it.

JSON, regex and Lark grammars compile with llguidance (`backend_guidance.py`); `choice` uses the matcher of
chapter 08, written by hand (`choice.py`).

Where this lives in vLLM: `vllm/v1/structured_output/__init__.py` (`StructuredOutputManager`), with the
request's side in `vllm/v1/structured_output/request.py` and the mask applied in the model runner.
"""

import functools
import json
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from transformers import PreTrainedTokenizerBase

from solutions.sampling_params import StructuredOutputsParams
from solutions.structured_output.backend_guidance import GuidanceBackend
from solutions.structured_output.backend_types import StructuredOutputGrammar
from solutions.structured_output.bitmask import allocate_token_bitmask, apply_token_bitmask
from solutions.structured_output.choice import ChoiceGrammar, TokenTexts

__all__ = ["StructuredOutputManager", "StructuredOutputGrammar", "apply_token_bitmask", "ChoiceGrammar", "TokenTexts"]

GRAMMAR_CACHE_SIZE = 256  # compiled constraints kept, least recently used dropped first


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and fills the token masks of each step."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, eos_token_id: int | None) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_id = tokenizer, vocab_size, eos_token_id
        self._compile = functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)(self._compile_uncached)
        self._executor: ThreadPoolExecutor | None = None  # started by the first constrained step
        self._pending: tuple[dict[int, int], torch.Tensor, Future[None]] | None = None

    # --- compiling, once per constraint ------------------------------------------------------------------------

    @functools.cached_property
    def backend(self) -> GuidanceBackend:
        return GuidanceBackend(self.tokenizer, self.vocab_size, self.eos_token_id)

    @functools.cached_property
    def token_texts(self) -> TokenTexts:
        return TokenTexts.from_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_id)

    def _compile_uncached(self, key: tuple[str, str]) -> str | list[str]:
        kind, spec = key
        params = StructuredOutputsParams(**{kind: json.loads(spec) if kind in ("choice", "json_object") else spec})
        return list(params.choice) if kind == "choice" else self.backend.compile_grammar(params)

    def grammar_init(self, params: StructuredOutputsParams, num_samples: int) -> list[StructuredOutputGrammar]:
        """One fresh grammar per sample of a request (ValueError if the constraint is not valid)."""
        if self.tokenizer is None:
            raise ValueError("SamplingParams.structured_outputs needs a tokenizer, and this model folder has none")
        compiled = self._compile(params.key)  # (kind, spec as text): equal constraints compile once
        if params.kind == "choice":
            return [ChoiceGrammar(compiled, self.token_texts) for _ in range(num_samples)]
        return [self.backend.new_grammar(compiled) for _ in range(num_samples)]

    # --- the masks of one step ---------------------------------------------------------------------------------

    def submit_bitmask(self, grammars: list[StructuredOutputGrammar]) -> None:
        """Start filling these grammars' mask rows on the worker thread; `grammar_bitmask` collects them."""
        self._wait()
        if not grammars:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bitmask")
        bitmask = allocate_token_bitmask(len(grammars), self.vocab_size)
        rows = {id(grammar): row for row, grammar in enumerate(grammars)}
        self._pending = rows, bitmask, self._executor.submit(_fill, grammars, bitmask)

    def grammar_bitmask(self, grammars: list[StructuredOutputGrammar | None]) -> torch.Tensor:
        """The (N, W) mask of a step's N sampled rows: row i from `grammars[i]`, all allowed where it is None.

        Rows submitted before the forward pass are copied from that work; any other grammar is filled now.
        """
        rows, filled = self._wait()
        bitmask = allocate_token_bitmask(len(grammars), self.vocab_size)
        for i, grammar in enumerate(grammars):
            if grammar is None:
                continue
            if id(grammar) in rows:
                bitmask[i] = filled[rows[id(grammar)]]
            else:
                grammar.fill_bitmask(bitmask, i)
        return bitmask

    def _wait(self) -> tuple[dict[int, int], torch.Tensor | None]:
        """Finish the submitted fill, if any, and hand over its rows (no grammar is touched by two threads)."""
        if self._pending is None:
            return {}, None
        rows, bitmask, future = self._pending
        self._pending = None
        future.result()
        return rows, bitmask


def _fill(grammars: list[StructuredOutputGrammar], bitmask: torch.Tensor) -> None:
    for row, grammar in enumerate(grammars):
        grammar.fill_bitmask(bitmask, row)

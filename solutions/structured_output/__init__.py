"""Structured output: every step, each constrained sample gets a mask of the tokens its grammar allows next.

    SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))   # or regex=, choice=, grammar=

The front end's processor has validated the constraint (`GuidanceBackend.validate_grammar`); the manager, in the
engine core, does the rest, in step order:
    grammar_init     at `add_request` (and at a fork): compile the constraint (cached by its text) into a fresh
                     matcher for one sample
    grammar_bitmask  before the forward pass, `submit_grammar_bitmask` fills the (N, W) mask of the step's
                     sampling rows on a worker thread (the library drops the GIL), all ones for an unconstrained
                     sample; the runner applies it to the logits before sampling (`apply_token_bitmask`)
    then `update_from_output` advances each matcher by its sampled token, and a sample whose grammar is complete
    (`is_terminated`) finishes with "stop" at once (vLLM allows only EOS then, ending it a step later).

A matcher lives with its sample: preemption by recompute keeps the tokens, so the matcher is still right when the
sequence resumes; prefix caching and streaming never touch it. JSON, regex and Lark grammars compile with
llguidance (`backend_guidance.py`); `choice` uses chapter 8's hand-written matcher (`choice.py`).

Where this lives in vLLM: `vllm/v1/structured_output/__init__.py` (`StructuredOutputManager`), with the
request's side in `vllm/v1/structured_output/request.py` and the mask applied in the model runner.
"""

import functools
import json
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

import torch
from transformers import PreTrainedTokenizerBase

from solutions.config import VllmConfig
from solutions.core.sched.output import SchedulerOutput, sampling_rows
from solutions.model.loader import load_tokenizer
from solutions.sampling_params import StructuredOutputsParams
from solutions.structured_output.backend_guidance import GuidanceBackend
from solutions.structured_output.backend_types import StructuredOutputGrammar
from solutions.structured_output.bitmask import allocate_token_bitmask, apply_token_bitmask
from solutions.structured_output.choice import ChoiceGrammar, TokenTexts

__all__ = [
    "StructuredOutputManager", "StructuredOutputGrammar", "submit_grammar_bitmask", "apply_token_bitmask",
    "ChoiceGrammar", "TokenTexts",
]

GRAMMAR_CACHE_SIZE = 256  # compiled constraints kept, least recently used dropped first


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and fills the token masks of each step. In the engine core it is
    made `from_config`, and loads the model's tokenizer at the first constrained request (as vLLM's manager
    loads its own in the core). `disable_any_whitespace`: the engine's option (`StructuredOutputsConfig`)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, eos_token_id: int | None,
        disable_any_whitespace: bool = False,
    ) -> None:
        self._tokenizer, self.vocab_size, self.eos_token_id = tokenizer, vocab_size, eos_token_id
        self.disable_any_whitespace = disable_any_whitespace
        self._model: str | None = None  # where to load the tokenizer from, when it is not given
        self._compile = functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)(self._compile_uncached)
        self._executor: MaskThread | None = None  # started by the first constrained step

    @classmethod
    def from_config(cls, vllm_config: VllmConfig) -> "StructuredOutputManager":
        model_config = vllm_config.model_config
        disable_any_whitespace = vllm_config.structured_outputs_config.disable_any_whitespace
        manager = cls(None, model_config.vocab_size, model_config.eos_token_id, disable_any_whitespace)
        manager._model = model_config.model
        return manager

    # --- compiling, once per constraint ------------------------------------------------------------------------

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None and self._model is not None:
            self._tokenizer = load_tokenizer(self._model)
        if self._tokenizer is None:
            raise ValueError("SamplingParams.structured_outputs needs a tokenizer, and this model folder has none")
        return self._tokenizer

    @functools.cached_property
    def backend(self) -> GuidanceBackend:
        return GuidanceBackend(self.tokenizer, self.vocab_size, self.eos_token_id, self.disable_any_whitespace)

    @functools.cached_property
    def token_texts(self) -> TokenTexts:
        return TokenTexts.from_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_id)

    def _compile_uncached(self, key: tuple[str, str, str | None]) -> str | list[str]:
        kind, spec, whitespace_pattern = key
        constraint = json.loads(spec) if kind in ("choice", "json_object") else spec
        params = StructuredOutputsParams(**{kind: constraint}, whitespace_pattern=whitespace_pattern)
        return list(params.choice) if kind == "choice" else self.backend.compile_grammar(params)

    def grammar_init(self, params: StructuredOutputsParams, num_samples: int) -> list[StructuredOutputGrammar]:
        """One fresh grammar per sample of a request (equal constraints compile once)."""
        compiled = self._compile(params.key)  # (kind, spec as text, whitespace_pattern)
        if params.kind == "choice":
            return [ChoiceGrammar(compiled, self.token_texts) for _ in range(num_samples)]
        return [self.backend.new_grammar(compiled) for _ in range(num_samples)]

    # --- the masks of one step ---------------------------------------------------------------------------------

    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> "Future[torch.Tensor] | None":
        """The step's mask, being filled on this manager's thread (`submit_grammar_bitmask`); None when no
        sampling row has a grammar."""
        if self._executor is None:
            self._executor = MaskThread()
        return submit_grammar_bitmask(scheduler_output, self._executor, self.vocab_size)

    def shutdown(self) -> None:
        """Stop the mask-filling thread, if one was started (the engine core's shutdown calls this)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class MaskThread(Executor):
    """One daemon thread that runs the mask fills in order. Not a `ThreadPoolExecutor`: its threads are joined
    when the interpreter exits, so a fill that never returns would keep the process alive for ever."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="bitmask", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as error:  # handed to whoever waits on the future
                    future.set_exception(error)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._jobs.put(None)
        if wait:
            self._thread.join()


def submit_grammar_bitmask(
    scheduler_output: SchedulerOutput, executor: Executor, vocab_size: int
) -> "Future[torch.Tensor] | None":
    """Start filling the step's (N, W) int32 mask on `executor` and return its future; None if no sampling row
    has a grammar.

    Row i belongs to the i-th sampling sequence of `sampling_rows(scheduler_output)` (a prompt chunk that is not
    its prompt's last samples nothing and gets no row; each sample forked this step gets its own), filled by
    that sequence's grammar, or left all ones (every token allowed) if it has none. The caller runs the forward
    pass meanwhile and waits on the future before sampling: until then no grammar is touched by another thread.
    """
    grammars = [seq.grammar for seq in sampling_rows(scheduler_output)[1]]
    if all(grammar is None for grammar in grammars):
        return None
    bitmask = allocate_token_bitmask(len(grammars), vocab_size)  # (N, W), every token allowed

    def fill() -> torch.Tensor:
        for row, grammar in enumerate(grammars):
            if grammar is not None:
                grammar.fill_bitmask(bitmask, row)
        return bitmask

    return executor.submit(fill)

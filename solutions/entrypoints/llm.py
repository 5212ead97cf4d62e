"""The offline entry point, shaped like vLLM's `LLM` (`vllm/entrypoints/llm.py`).

    llm = LLM(model="smollm2-135m")
    outs = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=32))
    outs[0].outputs[0].text
"""

import dataclasses
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from solutions.beam_search import BeamSearchOutput, BeamSearchParams
from solutions.engine.arg_utils import EngineArgs, engine_args_from_kwargs
from solutions.engine.llm_engine import LLMEngine
from solutions.exceptions import ParameterError
from solutions.model.loader import DEFAULT_MODEL
from solutions.outputs import RequestOutput
from solutions.sampling_params import RequestOutputKind, SamplingParams


def _as_prompt_list(prompts: str | list[int] | Seq[str | list[int]]) -> list[str | list[int]]:
    """One prompt (a string, or a list of token ids) or several, as a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


class LLM:
    """Load a model once; generate for batches of prompts through the engine (`self.llm_engine`).

    Every keyword is a field of `EngineArgs` (`solutions/engine/arg_utils.py`: its default, its check, its flag):
    `LLM(model, **kwargs)` is `LLMEngine.from_engine_args(EngineArgs(model, **kwargs))`.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: object) -> None:
        engine_args = engine_args_from_kwargs(EngineArgs, dict(kwargs, model=model))
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self.tokenizer = self.llm_engine.tokenizer
        self._request_counter = 0

    def generate(
        self, prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None, priority: Seq[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); outputs come back in prompt order.

        Every request is validated before any is queued, so one bad prompt raises ValueError and leaves the
        engine exactly as it was.
        """
        prompts = _as_prompt_list(prompts)
        sampling_params = SamplingParams() if sampling_params is None else sampling_params
        one = isinstance(sampling_params, SamplingParams)
        params = [sampling_params] * len(prompts) if one else list(sampling_params)
        priorities = [0] * len(prompts) if priority is None else list(priority)
        for name, given, wanted in (("sampling_params", params, "one or one per prompt"),
                                    ("priority", priorities, "one per prompt")):
            if len(given) != len(prompts):
                raise ParameterError(f"{name} has {len(given)} entries for {len(prompts)} prompts; give {wanted}", name)
        engine = self.llm_engine
        final_only = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        first = self._request_counter
        requests = [
            (str(first + i), prompt, p, prio)
            for i, (prompt, p, prio) in enumerate(zip(prompts, final_only, priorities, strict=True))
        ]
        engine.add_requests(requests)  # every request validated before any is queued
        self._request_counter += len(requests)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id, *_ in requests]

    def chat(
        self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (`[{"role": "user", "content": ...}, ...]`), formatted with the
        model's chat template."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError("chat needs a tokenizer with a chat template; this model has none, use generate")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: Seq[str | list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """The `params.beam_width` best continuations of each prompt, best first (one `BeamSearchOutput` each).

        Runs outside the scheduler, as vLLM's does, through the engine's `beam_search`: beams fork and free
        sequences that share blocks (see `solutions/beam_search.py`). The engine must be idle.
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        beams = self.llm_engine.beam_search(_as_prompt_list(prompts), params)
        for sequences in beams:
            for seq in sequences:
                if self.tokenizer is not None:
                    seq.text = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        return [BeamSearchOutput(sequences) for sequences in beams]

"""The offline front end: requests in, one step at a time, outputs back.

    engine = LLMEngine.from_engine_args(EngineArgs(model="smollm2-135m"))
    engine.add_request("r1", "Once upon a time", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for output in engine.step():   # what each request produced in this step
            ...

Three pieces, the same as the server's `AsyncLLM`:
    processor         validate and tokenise a request, once (`Processor.process_inputs`)
    engine_core       the engine core behind a client; here `InprocClient`, so `get_output()` runs one step
                      (`EngineCore.step`: schedule → execute → sample → update) in this process
    output_processor  detokenise, check stop strings, make each request's `RequestOutput`

The front end holds no scheduler, no model and no logits: only token ids cross from the core.

Where this lives in vLLM: `vllm/v1/engine/llm_engine.py` (`from_engine_args`, `add_request`, `step`,
`abort_request`).
"""

from collections.abc import Sequence as Seq

from solutions.beam_search import BeamSearchParams, BeamSearchSequence
from solutions.config import VllmConfig
from solutions.engine.arg_utils import EngineArgs
from solutions.engine.core_client import EngineCoreClient
from solutions.engine.output_processor import OutputProcessor
from solutions.engine.processor import Processor
from solutions.executor.abstract import Executor
from solutions.exceptions import ParameterError
from solutions.metrics.stats import EngineStats
from solutions.model.loader import load_tokenizer
from solutions.outputs import RequestOutput
from solutions.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, vllm_config: VllmConfig, executor_class: type[Executor]) -> None:
        self.vllm_config = vllm_config
        self.tokenizer = load_tokenizer(vllm_config.model_config.model)
        self.processor = Processor(vllm_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCoreClient.make_client("inproc", vllm_config, executor_class)
        self.stats = EngineStats()  # the stat logger: every step's SchedulerStats

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        vllm_config = engine_args.create_engine_config()
        return cls(vllm_config, Executor.get_class(vllm_config))

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, priority: int = 0
    ) -> None:
        """Validate, tokenise and queue a request (ParameterError, and nothing queued, if it is bad)."""
        self.add_requests([(request_id, prompt, SamplingParams() if params is None else params, priority)])

    def add_requests(self, requests: Seq[tuple[str, str | list[int], SamplingParams, int]]) -> None:
        """Queue several (request_id, prompt, params, priority) at once: all are validated before any is queued,
        so one bad request raises and leaves the engine exactly as it was."""
        processed = [self.processor.process_inputs(*request) for request in requests]
        self.output_processor.check_new_request_ids([request.request_id for _, request in processed])
        for prompt_text, request in processed:
            self.output_processor.add_request(prompt_text, request)
            self.engine_core.add_request(request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Finish requests now, whatever their state, and free every block they hold. Unknown ids raise
        ValueError before anything is aborted."""
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        unfinished = self.output_processor.request_states
        if unknown := [r for r in request_ids if r not in unfinished]:
            raise ParameterError(
                f"abort_request: unknown request ids {unknown}; unfinished requests: {sorted(unfinished)}",
                "request_id",
            )
        self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine-core step, its outputs turned into `RequestOutput`s (the new tokens and text of each)."""
        outputs = self.engine_core.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs)
        self.engine_core.abort_requests(processed.reqs_to_abort)  # a stop string ended them: free their blocks
        self.stats.record(outputs.scheduler_stats)
        return processed.request_outputs

    def beam_search(self, prompts: Seq[str | list[int]], params: BeamSearchParams) -> list[list[BeamSearchSequence]]:
        """The beams of each prompt, best first (text not filled in), run by the in-process engine core outside its
        scheduler. Each prompt is validated and tokenised as for `add_request` before anything runs."""
        limits = SamplingParams(max_tokens=params.max_tokens)
        token_ids = [
            self.processor.process_inputs(f"beam-{i}", prompt, limits)[1].prompt_token_ids
            for i, prompt in enumerate(prompts)
        ]
        return self.engine_core.beam_search(token_ids, params)

    def shutdown(self) -> None:
        """Release the engine's workers (tensor parallelism); the engine cannot step afterwards."""
        self.engine_core.shutdown()

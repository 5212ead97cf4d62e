"""The engine core: the scheduler, the model executor and the structured output manager, and the step that joins them.

    core = EngineCore(vllm_config, Executor.get_class(vllm_config))
    core.add_request(EngineCoreRequest("r1", [1, 2, 3], SamplingParams(max_tokens=8)))
    while core.has_unfinished_requests():
        outputs = core.step()            # EngineCoreOutputs: per sample, its new token ids; the step's stats

A step (`engine_step`, below) is schedule → execute → sample → update, each owned by one object:
    schedule     Scheduler.schedule()                which sequences compute how many tokens (and what is
                                                      preempted); advances their computed tokens, forks n > 1
    (meanwhile)  Scheduler.get_grammar_bitmask()     the constrained samples' token masks, filled on a thread
    execute      model_executor.execute_model()      one forward pass over the flattened batch (every rank)
    sample       model_executor.sample_tokens()      one token per sampling sequence, within its mask
    update       Scheduler.update_from_output()      append, check stops, free the finished; the step's outputs
    (post_step)  Scheduler.update_draft_token_ids()  speculative decoding: the drafts proposed after sampling

The core speaks token ids only: the front end (`LLMEngine`, `AsyncLLM`) tokenises before and detokenises after.
A server's core runs its own loop (`EngineCoreProc.run_busy_loop`, in a process or a thread), so the event loop
never waits for a forward pass: new requests join the very next step, aborts free their blocks before it. A
request the core refuses is answered with an error for that id alone (`EngineCoreProc.handle`; the front end
validates first); any other exception, in `step()` above all, is fatal: the core sends `EngineDead` with the
traceback and stops.

Where this lives in vLLM: `vllm/v1/engine/core.py` (`EngineCore.step`, `EngineCoreProc.run_busy_loop`).
"""

import itertools
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from solutions.beam_search import BeamSearchParams, BeamSearchSequence, run_beam_search
from solutions.config import VllmConfig
from solutions.core.sched.data_parallel_scheduler import DataParallelScheduler
from solutions.core.sched.scheduler import Scheduler
from solutions.core.sched.swapping_scheduler import scheduler_cls
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.engine import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
from solutions.executor.abstract import Executor
from solutions.structured_output import StructuredOutputManager

IDLE_POLL_SECONDS = 0.5  # how often an idle core checks that its front end is still alive


class EngineCore:
    """Owns the scheduler (and through it the KV cache manager), the model executor and the structured output
    manager; `step()` runs one engine step over them."""

    def __init__(self, vllm_config: VllmConfig, executor_class: type[Executor]) -> None:
        self.vllm_config = vllm_config
        self.model_executor = executor_class(vllm_config)
        self.structured_output_manager = StructuredOutputManager.from_config(vllm_config)
        cls = DataParallelScheduler if vllm_config.parallel_config.data_parallel else scheduler_cls(vllm_config)
        self.scheduler = cls.from_config(vllm_config, self.structured_output_manager)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()  # the order requests came in: priority ties, unseeded seeds

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated request as its first sample's sequence (its other samples fork from it once its
        prompt is computed): its parameters, a generator of its own, and its grammar travel with it."""
        params, arrival = request.sampling_params, next(self._arrivals)
        seq = Sequence(next(self._seq_ids), request.prompt_token_ids, priority=request.priority, arrival=arrival)
        seq.request_id, seq.sampling_params = request.request_id, params
        # Unseeded requests draw from the engine's seed; a seeded request's i-th sample uses seed + i (as vLLM).
        seq.seed = (
            self.vllm_config.model_config.seed * 1_000_003 + arrival * 1_009 if params.seed is None else params.seed
        )
        seq.generator = torch.Generator().manual_seed(seq.seed)
        if params.structured_outputs is not None:
            (seq.grammar,) = self.structured_output_manager.grammar_init(params.structured_outputs, 1)
        seq.fork_seq_ids = [next(self._seq_ids) for _ in range(params.n - 1)]  # forked once the prompt is in
        self.scheduler.add_request(seq)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish these requests now, whatever their state, freeing every block they hold (ids the core no longer
        has are ignored: they finished while the abort was on its way)."""
        self.scheduler.finish_requests(request_ids, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """One engine step (`engine_step`, looked up in this module when called, so a chapter can swap it), then
        `post_step`. With data parallelism, a replica that died in the step is dropped: its sequences are requeued
        on the others (the others' tokens of the step are in `outputs`)."""
        outputs = engine_step(self)
        for replica in self.model_executor.take_dead_replicas():
            self.scheduler.drop_replica(replica)
        self.post_step()
        return outputs

    def post_step(self) -> None:
        """Speculative decoding: hand the drafts proposed after this step's sampling to the scheduler, for the next
        step (vLLM: `EngineCore.post_step`). Nothing without speculation."""
        if self.vllm_config.speculative_config is not None:
            draft_token_ids = self.model_executor.take_draft_token_ids()
            if draft_token_ids is not None:
                self.scheduler.update_draft_token_ids(draft_token_ids)

    def beam_search(self, prompts: list[list[int]], params: BeamSearchParams) -> list[list[BeamSearchSequence]]:
        """The beams of each prompt, best first (text not filled in), run outside the scheduler, as vLLM's does,
        on this core's KV cache manager and model runner (`solutions/beam_search.py`). The core must be idle."""
        if self.has_unfinished_requests():
            raise ValueError("beam_search needs an idle engine: finish or abort the unfinished requests first")
        if self.vllm_config.parallel_config.data_parallel:
            raise ValueError("beam_search runs on one replica's runner in this process: use data_parallel_size=1")
        return run_beam_search(
            self.scheduler.kv_cache_manager, self.model_executor.model_runner, prompts, params,
            eos_token_id=self.vllm_config.model_config.eos_token_id,
            max_model_len=self.vllm_config.model_config.max_model_len, seq_ids=self._seq_ids,
        )

    def shutdown(self) -> None:
        self.model_executor.shutdown()
        self.structured_output_manager.shutdown()


class EngineParts(Protocol):
    """What one engine step reads of its core: an `EngineCore`, or an in-process client, which lends its core's."""

    @property
    def scheduler(self) -> Scheduler | DataParallelScheduler: ...

    @property
    def model_executor(self) -> Executor: ...


def engine_step(core: EngineParts) -> EngineCoreOutputs:
    """One engine step over one flattened batch: schedule → execute → sample → update."""
    start = time.perf_counter()
    scheduler_output = core.scheduler.schedule()
    grammar_output = core.scheduler.get_grammar_bitmask(scheduler_output)  # filled while the forward pass runs
    schedule_seconds = time.perf_counter() - start
    core.model_executor.execute_model(scheduler_output)
    model_output = core.model_executor.sample_tokens(grammar_output)
    return core.scheduler.update_from_output(scheduler_output, model_output, schedule_seconds)


# --- the busy loop ----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class EngineCoreReady:
    """The core's first message: the engine is built (the model loaded, the KV cache allocated)."""


@dataclass(slots=True)
class EngineDead:
    """The core has stopped for good: `step()` raised (the traceback is in `message`) or the process died."""

    message: str


InputMessage = tuple[EngineCoreRequestType, EngineCoreRequest | list[str] | None]
OutputMessage = EngineCoreReady | EngineCoreOutputs | EngineDead


class MessageQueue(Protocol):
    """What the loop needs of a queue: `queue.Queue` (thread) and `multiprocessing.Queue` (process) both fit."""

    def get(self, block: bool = True, timeout: float | None = None) -> object: ...

    def put(self, item: object) -> None: ...


class EngineCoreProc(EngineCore):
    """An engine core that serves a front end it only talks to through two queues."""

    def __init__(self, vllm_config: VllmConfig, executor_class: type[Executor]) -> None:
        super().__init__(vllm_config, executor_class)
        self._stats_changed = False  # an add or abort since the last message: the gauges are out of date

    def run_busy_loop(
        self, input_queue: MessageQueue, output_queue: MessageQueue, parent_alive: Callable[[], bool] = lambda: True
    ) -> None:
        """Serve the queues until SHUTDOWN, a fatal error, or (while idle) `parent_alive()` turning False."""
        try:
            run_busy_loop(self, input_queue, output_queue, parent_alive)  # the module's, looked up when called
        except Exception:  # in step() or anywhere else: the engine's state is unknown, so this is the end
            output_queue.put(EngineDead(f"the engine core failed:\n{traceback.format_exc()}"))

    def report_idle(self, output_queue: MessageQueue) -> None:
        """Idle, after an add or an abort: send the stats alone, so that the gauges (running, waiting, KV usage)
        do not keep showing the last step's state while nothing steps."""
        if self._stats_changed:
            self._stats_changed = False
            output_queue.put(EngineCoreOutputs([], self.scheduler.make_stats()))

    def step(self) -> EngineCoreOutputs:
        self._stats_changed = False
        return super().step()

    def handle(self, message: InputMessage, output_queue: MessageQueue) -> bool:
        """Apply one input message; False means stop the loop (SHUTDOWN)."""
        kind, payload = message
        if kind is EngineCoreRequestType.SHUTDOWN:
            return False
        self._stats_changed = True
        if kind is EngineCoreRequestType.ABORT:
            self.abort_requests(payload)
            return True
        try:
            self.add_request(payload)
        except ValueError as error:  # this request only: the engine is unchanged and keeps serving the others
            output_queue.put(EngineCoreOutputs([], None, errors={payload.request_id: str(error)}))
        return True


def run_busy_loop(
    core: EngineCoreProc, input_queue: MessageQueue, output_queue: MessageQueue, parent_alive: Callable[[], bool]
) -> None:
    """Serve the queues until SHUTDOWN or, while idle, `parent_alive()` turning False: block while idle, take
    every waiting message before each step, one `core.step()` and one output message per iteration."""
    while True:
        while not core.has_unfinished_requests():  # 1. idle: wait for work
            core.report_idle(output_queue)
            try:
                message = input_queue.get(timeout=IDLE_POLL_SECONDS)
            except queue.Empty:
                if not parent_alive():
                    return  # orphaned: nobody will ever send SHUTDOWN
                continue
            if not core.handle(message, output_queue):
                return
        while True:  # 2. drain what else has arrived, without blocking
            try:
                message = input_queue.get(block=False)
            except queue.Empty:
                break
            if not core.handle(message, output_queue):
                return
        if core.has_unfinished_requests():  # (unless everything was aborted)
            output_queue.put(core.step())  # 3. one step, one message

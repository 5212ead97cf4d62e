"""The engine core: `LLMEngine.step()` in a loop of its own, fed by an input queue, reporting on an output queue.

A server has two jobs that must not wait on each other. Its event loop accepts connections, parses requests and
streams tokens back; its engine runs forward passes, each tens of milliseconds on a CPU. If the event loop ran
`step()` itself, every client would stall for the whole forward pass — new requests could not even be accepted.
So the engine steps in a loop of its own, and the two sides only exchange messages:

    front end (AsyncLLM)  --ADD / ABORT / SHUTDOWN-->  input queue   -->  EngineCore.run_busy_loop
    front end (AsyncLLM)  <--one message per step---   output queue  <--  (outputs + SchedulerStats)

The loop (`run_busy_loop`, a function of this module that `EngineCore.run_busy_loop` guards), each iteration:
1. idle (no unfinished request): publish the stats if they changed, then block on the input queue;
2. take every message already waiting, without blocking: requests join the very next step (continuous batching
   across the process boundary), aborts free their blocks before it;
3. run one `engine.step()` and put ONE message with that step's DELTA `RequestOutput`s and its `SchedulerStats`.

Failures, in two tiers: a request the engine refuses (`add_request` raising ValueError — the front end validates
first, so this is a safety net) is answered with an error for that request id alone; any other exception — in
`step()` above all — leaves the engine in an unknown state, so it is fatal: the core sends `EngineDead` with the
traceback and stops.

Where this lives in vLLM: `vllm/v1/engine/core.py` (`EngineCore.step`, `EngineCoreProc.run_busy_loop`), the
message types in `vllm/v1/engine/__init__.py` (`EngineCoreRequestType`, `EngineCoreOutputs`). Unlike vLLM, our
engine detokenises and checks stop strings inside `step()` (its output processor), so that work runs in the core;
vLLM moves it to the front-end process.
"""

import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from solutions.engine.llm_engine import LLMEngine
from solutions.metrics.stats import SchedulerStats
from solutions.outputs import RequestOutput
from solutions.sampling_params import SamplingParams

IDLE_POLL_SECONDS = 0.5  # how often an idle core checks that its front end is still alive


class EngineCoreRequestType(Enum):
    ADD = "add"  # payload: an EngineCoreRequest
    ABORT = "abort"  # payload: list of request ids (unknown or finished ones are ignored)
    SHUTDOWN = "shutdown"  # payload: None


@dataclass(slots=True)
class EngineCoreRequest:
    """A request the front end has validated and tokenised: all the core needs to queue it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int


@dataclass(slots=True)
class EngineCoreReady:
    """The core's first message: the engine is built, and these are the facts the front end validates against."""

    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    eos_token_id: int | None
    seed: int
    scheduling_policy: str
    max_num_seqs: int

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "EngineCoreReady":
        return cls(
            engine.model.config.vocab_size, engine.max_model_len, engine.kv_cache_manager.num_blocks,
            engine.block_size, engine.model.config.eos_token_id, engine.processor.seed, engine.scheduler.policy.value,
            engine.scheduler.max_num_seqs,
        )


@dataclass(slots=True)
class EngineCoreOutputs:
    """One message from the core: a step's outputs and stats, or a refusal, or a stats report between steps."""

    outputs: list[RequestOutput]
    scheduler_stats: SchedulerStats | None
    errors: dict[str, str] = field(default_factory=dict)  # request id -> why the core refused to add it
    timestamp: float = field(default_factory=time.monotonic)  # when it was put on the queue (one clock per host)


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


class EngineCore:
    """Owns an `LLMEngine` and runs it for a front end it only talks to through two queues."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        cache_stats = engine.kv_cache_manager.prefix_cache_stats
        self._reported_queries, self._reported_hits = cache_stats.queries, cache_stats.hits  # counted so far
        self._stats_changed = False  # an add or abort since the last message: the gauges are out of date

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine.add_request(request.request_id, request.prompt_token_ids, request.params, request.priority)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort the ids that are still unfinished here; the rest finished while the abort was on its way."""
        live = [request_id for request_id in request_ids if request_id in self.engine.requests]
        if live:
            self.engine.abort_request(live)

    def step(self) -> EngineCoreOutputs:
        """One engine step, timed, with the stats it leaves behind. The core reports each step once and a server
        runs for days, so the engine's per-step history is dropped once read (it would grow without bound)."""
        start = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - start
        stats = self.engine.stats
        num_preempted = stats.steps[-1].num_preempted
        stats.steps.clear()
        stats.batch_sizes.clear()
        return EngineCoreOutputs(outputs, self.make_stats(seconds, num_preempted))

    def make_stats(self, step_seconds: float | None = None, num_preemptions: int = 0) -> SchedulerStats:
        """The engine's state now; prefix-cache lookups counted since the previous call."""
        engine, cache_stats = self.engine, self.engine.kv_cache_manager.prefix_cache_stats
        queries, hits = cache_stats.queries - self._reported_queries, cache_stats.hits - self._reported_hits
        self._reported_queries, self._reported_hits = cache_stats.queries, cache_stats.hits
        self._stats_changed = False
        manager = engine.kv_cache_manager
        return SchedulerStats(
            num_running=len(engine.scheduler.running), num_waiting=len(engine.scheduler.waiting),
            kv_cache_usage=manager.num_used_blocks / manager.num_blocks, prefix_cache_queries=queries,
            prefix_cache_hits=hits, num_preemptions=num_preemptions, step_seconds=step_seconds,
        )

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
            output_queue.put(EngineCoreOutputs([], self.make_stats()))

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
    core: EngineCore, input_queue: MessageQueue, output_queue: MessageQueue, parent_alive: Callable[[], bool]
) -> None:
    """Serve the queues until SHUTDOWN or, while idle, `parent_alive()` turning False: block while idle, take
    every waiting message before each step, one `core.step()` and one output message per iteration."""
    while True:
        while not core.engine.has_unfinished_requests():  # 1. idle: wait for work
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
        if core.engine.has_unfinished_requests():  # (unless everything was aborted)
            output_queue.put(core.step())  # 3. one step, one message

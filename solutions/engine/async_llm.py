"""`AsyncLLM`: the engine for a server — many callers at once, each streaming its own request's outputs.

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs("smollm2-135m"))   # the core starts in its own process
    async for output in llm.generate("Once upon a time", SamplingParams(max_tokens=32), "req-1"):
        print(output.outputs[0].text, end="")          # DELTA: only what is new since the last output
    llm.shutdown()

The path of one request:
1. `generate` asks `add_request` to validate and tokenise it here (`Processor`), so a bad request raises ValueError
   at the first `__anext__` and never reaches the core;
2. `add_request` registers it with the `OutputProcessor` and a `RequestOutputCollector` and sends it to the core
   (`EngineCoreClient`: a process or a thread);
3. one output thread reads the core's messages (one per step, token ids only), turns them into `RequestOutput`s
   (detokenising, stop strings), feeds the stat loggers, and hands each output to its collector on the caller's
   event loop (`loop.call_soon_threadsafe`). (vLLM reads them in an asyncio task, `output_handler`, its sockets
   being asyncio-aware; our `multiprocessing` queues block, hence a thread.)
4. the caller's `async for` ends after the output with `finished=True`, whose id is free again.

A collector holds one pending output: later DELTA outputs are merged into it, so a slow reader gets fewer, larger
outputs and the engine never waits. A caller that stops early (closes the generator, or is cancelled) aborts the
request in the generator's `finally`; if the core dies, every caller gets `EngineDeadError`.

Where this lives in vLLM: `vllm/v1/engine/async_llm.py` (`AsyncLLM.generate`, `output_handler`, `abort`) and
`vllm/v1/engine/output_processor.py` (`RequestOutputCollector`).
"""

import asyncio
import contextlib
import threading
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from solutions.config import VllmConfig
from solutions.engine import EngineCoreOutputs
from solutions.engine.arg_utils import AsyncEngineArgs
from solutions.engine.core import EngineDead
from solutions.engine.core_client import POLL_SECONDS, EngineCoreClient
from solutions.engine.output_processor import OutputProcessor
from solutions.engine.processor import Processor
from solutions.executor.abstract import Executor
from solutions.metrics.prometheus import PrometheusStatLogger
from solutions.metrics.stats import IterationStats, RequestStateStats, SchedulerStats
from solutions.model.loader import load_tokenizer
from solutions.outputs import CompletionOutput, FinishReason, RequestOutput
from solutions.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine core has stopped (crashed, killed, or shut down): no request can be served any more."""


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None: ...


class RequestOutputCollector:
    """One request's mailbox between the output thread and the caller: at most one pending output (later DELTA
    outputs are merged into it), or an error. `put`/`put_error` run on the event loop that `get` awaits on."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self._output is not None and self._output.finished:
            return  # e.g. an abort that crossed the request's last output: the last output stands
        self._output = output if self._output is None else merge_delta(self._output, output)
        self._ready.set()

    def put_error(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The pending output (outputs already received come before an error), waiting if there is none."""
        while self._output is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._output is None:
            raise self._error
        output, self._output = self._output, None
        return output


def merge_delta(pending: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Fold the DELTA output `new` into `pending` (not yet read): per sample, text, tokens and logprobs
    concatenated; the finish state, cumulative logprob and cached-token count are `new`'s."""
    by_index = {completion.index: completion for completion in pending.outputs}
    for completion in new.outputs:
        earlier = by_index.get(completion.index)
        if earlier is None:
            by_index[completion.index] = completion
            continue
        earlier.text += completion.text
        earlier.token_ids = earlier.token_ids + completion.token_ids
        if completion.logprobs is not None:
            earlier.logprobs = (earlier.logprobs or []) + completion.logprobs
        earlier.finish_reason, earlier.stop_reason = completion.finish_reason, completion.stop_reason
        earlier.cumulative_logprob = completion.cumulative_logprob
    pending.outputs = sorted(by_index.values(), key=lambda completion: completion.index)
    pending.finished, pending.num_cached_tokens = new.finished, new.num_cached_tokens
    return pending


@dataclass(slots=True)
class _LiveRequest:
    """What the front end keeps for a request until its caller has read its last output."""

    request_id: str
    prompt: str | None  # the text prompt, for an aborted request's last output
    prompt_token_ids: list[int]
    num_samples: int  # params.n
    collector: RequestOutputCollector
    stats: RequestStateStats


class AsyncLLM:
    """An engine for concurrent streaming callers: a processor and an output processor in this process, the engine
    core behind a client. `engine_core="process"` runs the core in a child process, `"thread"` in a thread of this
    one (see `solutions/engine/core_client.py` for what each costs). Use as a (async) context manager, or call
    `shutdown`."""

    def __init__(self, vllm_config: VllmConfig, executor_class: type[Executor], engine_core: str = "process") -> None:
        self.vllm_config = vllm_config
        self.model_name = vllm_config.model_config.model
        self.max_model_len = vllm_config.model_config.max_model_len
        self.tokenizer = load_tokenizer(self.model_name)
        self.processor = Processor(vllm_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCoreClient.make_client(engine_core, vllm_config, executor_class)
        self.stat_logger = PrometheusStatLogger(self.model_name, vllm_config.speculative_config)
        self.stat_loggers: list[StatLogger] = [self.stat_logger]  # each gets every message's stats
        self._requests: dict[str, _LiveRequest] = {}  # written by callers' loops, read by the output thread
        self._dead_reason: str | None = None
        self._stopping = threading.Event()
        self._output_thread = threading.Thread(target=self._run_output_handler, name="AsyncLLM-output", daemon=True)
        self._output_thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs) -> "AsyncLLM":
        vllm_config = engine_args.create_engine_config()
        return cls(vllm_config, Executor.get_class(vllm_config), engine_args.engine_core)

    # --- the callers' side (any event loop) ----------------------------------------------------------------------

    def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's DELTA outputs, ending after the one with `finished=True`.

        ValueError (nothing queued) for a bad request or a request_id still in use; EngineDeadError if the core
        is dead or dies meanwhile. Closing or cancelling the iterator early aborts the request in the core.
        """
        return generate(self, prompt, params, request_id, priority)  # the module's, looked up when called

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> RequestOutputCollector:
        """Validate and tokenise the request, register it, send it to the core; the collector its outputs will
        reach. ValueError (nothing registered, nothing sent) for a bad request or an id still in use;
        EngineDeadError if the core has stopped."""
        arrival_time = time.monotonic()
        self.raise_if_dead()
        prompt_text, request = self.processor.process_inputs(request_id, prompt, params, priority)
        self.output_processor.add_request(prompt_text, request)  # ValueError if the id is still in use
        collector = RequestOutputCollector(asyncio.get_running_loop())
        live = _LiveRequest(request_id, prompt_text, request.prompt_token_ids, params.n, collector,
                            RequestStateStats(arrival_time))
        self._requests[request_id] = live
        if self._dead_reason is not None:  # the core died between the check above and the registration
            self._forget(live)
            self.raise_if_dead()
        self.engine_core.add_request(request)
        return collector

    async def abort(self, request_id: str) -> None:
        """Abort a request (its `generate` then ends with a `finish_reason="abort"` output); an unknown or
        finished request_id is ignored, and nothing is sent to a core that has stopped."""
        live = self._requests.get(request_id)
        if live is None:
            return
        self._forget(live)
        samples = [CompletionOutput(i, "", [], FinishReason.ABORT) for i in range(live.num_samples)]
        aborted = RequestOutput(request_id, live.prompt, live.prompt_token_ids, samples, finished=True)
        self._deliver(live, live.collector.put, aborted)

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine core has stopped."""
        self.raise_if_dead()

    @property
    def errored(self) -> bool:
        return self._dead_reason is not None

    def raise_if_dead(self) -> None:
        """EngineDeadError, with why the core stopped, if it has (for code outside an event loop)."""
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    # --- the output thread -----------------------------------------------------------------------------------------

    def _run_output_handler(self) -> None:
        """Read the core's messages until it dies or we stop; a failure here is fatal too (callers would hang)."""
        try:
            while not self._stopping.is_set():
                message = self.engine_core.get_output(timeout=POLL_SECONDS)
                if isinstance(message, EngineDead):
                    self._fail_all(message.message)
                    return
                if message is not None:
                    self._process_outputs(message)
        except Exception:
            self._fail_all(f"the front end's output thread failed:\n{traceback.format_exc()}")

    def _process_outputs(self, message: EngineCoreOutputs) -> None:
        """Turn the message's outputs into `RequestOutput`s, record its stats, then hand each output (or refusal)
        to its request's collector."""
        now = time.monotonic()
        iteration = IterationStats(transfer_seconds=now - message.timestamp)
        processed = self.output_processor.process_outputs(message.outputs)
        if processed.reqs_to_abort:  # a stop string ended them: free their blocks in the core
            self.engine_core.abort_requests(processed.reqs_to_abort)
        delivered = []
        for output in processed.request_outputs:
            live = self._requests.get(output.request_id)
            if live is None:
                continue  # its caller left; the abort is on its way to the core
            iteration.update_from_output(output, live.stats, now)
            if output.finished:  # its id is free again once its caller can see the last output
                self._requests.pop(output.request_id, None)
            delivered.append((live, live.collector.put, output))
        for request_id, reason in message.errors.items():
            if (live := self._requests.pop(request_id, None)) is not None:
                self.output_processor.abort_requests([request_id])
                delivered.append((live, live.collector.put_error, ValueError(reason)))
        for logger in self.stat_loggers:  # first, so a caller that sees step k's output sees step k's gauges
            logger.record(message.scheduler_stats, iteration)
        for live, put, item in delivered:
            self._deliver(live, put, item)

    def _deliver(self, live: _LiveRequest, put: Any, item: object) -> None:
        try:
            live.collector.loop.call_soon_threadsafe(put, item)
        except RuntimeError:  # the caller's event loop is closed: nobody will read this request again
            self._forget(live)

    def _forget(self, live: _LiveRequest) -> None:
        """Drop a request that has not finished: from the registry, the output processor and (if it still runs)
        the core, which frees its blocks before its next step."""
        if self._requests.get(live.request_id) is not live:
            return  # already finished or forgotten
        self._requests.pop(live.request_id, None)
        self.output_processor.abort_requests([live.request_id])
        if self._dead_reason is None:
            self.engine_core.abort_requests([live.request_id])

    def _fail_all(self, reason: str) -> None:
        """The core is gone: every waiting caller raises EngineDeadError, and so will every later call."""
        self._dead_reason = reason  # set before reading the requests (see `generate`)
        for live in list(self._requests.values()):
            with contextlib.suppress(RuntimeError):  # that caller's event loop is closed: nobody is waiting there
                live.collector.loop.call_soon_threadsafe(live.collector.put_error, EngineDeadError(reason))

    # --- shutdown ----------------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the output thread and the engine core (its process exits and is joined). Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._output_thread.join()
        self.engine_core.shutdown()
        if self._dead_reason is None:
            self._fail_all("the engine was shut down")

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.shutdown()


async def generate(
    llm: AsyncLLM, prompt: str | list[int], params: SamplingParams, request_id: str, priority: int = 0
) -> AsyncIterator[RequestOutput]:
    """`AsyncLLM.generate`: submit the request, yield what its collector hands out until the finished output, and
    abort it if the caller leaves before that (closes the iterator, or its task is cancelled)."""
    collector = await llm.add_request(request_id, prompt, params, priority)  # raises: nothing to undo
    finished = False
    try:
        while not finished:
            output = await collector.get()  # EngineDeadError once the core has stopped
            finished = output.finished
            yield output
    finally:
        if not finished:  # closed or cancelled early, or an error ended the stream: free its blocks
            await llm.abort(request_id)

"""Plausible wrong answers to chapter 07's exercises; each must fail at least one test of its exercise.

Class exercises are mutated by subclassing the reference and overriding the method that goes wrong.
"""

import asyncio
import queue
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from solutions.engine.async_llm import AsyncLLM, RequestOutputCollector, merge_delta
from solutions.engine.core import IDLE_POLL_SECONDS, EngineCoreProc, MessageQueue
from solutions.entrypoints.openai.serving_engine import ClientDisconnected, wait_for_disconnect
from solutions.outputs import RequestOutput
from solutions.sampling_params import SamplingParams

T = TypeVar("T")

# --- run_busy_loop -------------------------------------------------------------------------------------------------


def _loop(core: EngineCoreProc, input_queue: MessageQueue, output_queue: MessageQueue,
          parent_alive: Callable[[], bool], *, drain_one: bool = False, report_idle: bool = True, block: bool = True,
          stop_when_busy: bool = True, watch_parent: bool = True, drain_while_busy: bool = True,
          swallow_step_errors: bool = False, stop_when_idle: bool = True, idle_timeout_ends: bool = False,
          parent_backwards: bool = False, wait_while_busy: bool = False) -> None:
    """The reference loop, with switches for what the mutants below get wrong."""
    while True:
        while not core.has_unfinished_requests():
            if report_idle:
                core.report_idle(output_queue)
            try:
                message = input_queue.get(timeout=IDLE_POLL_SECONDS) if block else input_queue.get(block=False)
            except queue.Empty:
                if idle_timeout_ends or (parent_backwards and parent_alive()):
                    return
                if watch_parent and not parent_backwards and not parent_alive():
                    return
                continue
            if not core.handle(message, output_queue) and stop_when_idle:
                return
        while drain_while_busy:
            try:
                if wait_while_busy:
                    message = input_queue.get(timeout=IDLE_POLL_SECONDS)
                else:
                    message = input_queue.get(block=False)
            except queue.Empty:
                break
            if not core.handle(message, output_queue) and stop_when_busy:
                return
            if drain_one:
                break
        if core.has_unfinished_requests():
            try:
                output_queue.put(core.step())
            except Exception:
                if not swallow_step_errors:
                    raise


def run_busy_loop_one_message_per_step(core: EngineCoreProc, input_queue: MessageQueue, output_queue: MessageQueue,
                                       parent_alive: Callable[[], bool]) -> None:
    """Takes at most one waiting message before each step: requests that arrived together join over several steps."""
    _loop(core, input_queue, output_queue, parent_alive, drain_one=True)


def run_busy_loop_never_reports_idle(core: EngineCoreProc, input_queue: MessageQueue, output_queue: MessageQueue,
                                     parent_alive: Callable[[], bool]) -> None:
    """Sends stats only with a step: after an abort the gauges keep the last step's running requests and blocks."""
    _loop(core, input_queue, output_queue, parent_alive, report_idle=False)


def run_busy_loop_polls_while_idle(core: EngineCoreProc, input_queue: MessageQueue, output_queue: MessageQueue,
                                   parent_alive: Callable[[], bool]) -> None:
    """Asks the input queue without waiting, over and over, while idle: a core spinning on a CPU it needs."""
    _loop(core, input_queue, output_queue, parent_alive, block=False)


def run_busy_loop_finishes_the_batch_before_stopping(core: EngineCoreProc, input_queue: MessageQueue,
                                                     output_queue: MessageQueue,
                                                     parent_alive: Callable[[], bool]) -> None:
    """Notices SHUTDOWN only once idle: a shutdown waits for every running request to finish."""
    _loop(core, input_queue, output_queue, parent_alive, stop_when_busy=False)


def run_busy_loop_outlives_its_front_end(core: EngineCoreProc, input_queue: MessageQueue, output_queue: MessageQueue,
                                        parent_alive: Callable[[], bool]) -> None:
    """Never asks whether the front end is alive: an orphaned core waits for a SHUTDOWN nobody will send."""
    _loop(core, input_queue, output_queue, parent_alive, watch_parent=False)


def run_busy_loop_reads_only_while_idle(core: EngineCoreProc, input_queue: MessageQueue, output_queue: MessageQueue,
                                        parent_alive: Callable[[], bool]) -> None:
    """Steps until the batch is done before reading the queue again: a request that arrives while others run waits
    for all of them, and so do aborts and SHUTDOWN."""
    _loop(core, input_queue, output_queue, parent_alive, drain_while_busy=False)


def run_busy_loop_survives_a_failing_step(core: EngineCoreProc, input_queue: MessageQueue, output_queue: MessageQueue,
                                          parent_alive: Callable[[], bool]) -> None:
    """Catches a step's exception to keep serving the other requests (HANG): the broken request fails every step
    after, the loop spins, and no caller ever hears that the engine is dead."""
    _loop(core, input_queue, output_queue, parent_alive, swallow_step_errors=True)


def run_busy_loop_stops_at_the_first_idle_timeout(core: EngineCoreProc, input_queue: MessageQueue,
                                                  output_queue: MessageQueue,
                                                  parent_alive: Callable[[], bool]) -> None:
    """Returns when the idle wait times out, whatever `parent_alive()` says: a core idle for IDLE_POLL_SECONDS
    exits, and the next request reaches nobody."""
    _loop(core, input_queue, output_queue, parent_alive, idle_timeout_ends=True)


def run_busy_loop_asks_parent_alive_backwards(core: EngineCoreProc, input_queue: MessageQueue,
                                              output_queue: MessageQueue, parent_alive: Callable[[], bool]) -> None:
    """Returns at an idle timeout when `parent_alive()` is True (the test inverted): a live front end loses its core
    the first time it is idle, and an orphaned core waits for ever."""
    _loop(core, input_queue, output_queue, parent_alive, parent_backwards=True)


def run_busy_loop_waits_for_more_while_busy(core: EngineCoreProc, input_queue: MessageQueue,
                                            output_queue: MessageQueue, parent_alive: Callable[[], bool]) -> None:
    """Drains with the idle wait's `get(timeout=IDLE_POLL_SECONDS)` instead of `get(block=False)`: every step waits
    half a second for a message that may never come."""
    _loop(core, input_queue, output_queue, parent_alive, wait_while_busy=True)


def run_busy_loop_ignores_shutdown_while_idle(core: EngineCoreProc, input_queue: MessageQueue,
                                              output_queue: MessageQueue, parent_alive: Callable[[], bool]) -> None:
    """Stops on SHUTDOWN only while busy (the idle wait drops `handle`'s False): an idle core never shuts down."""
    _loop(core, input_queue, output_queue, parent_alive, stop_when_idle=False)


# --- RequestOutputCollector ----------------------------------------------------------------------------------------


class CollectorKeepsTheNewest(RequestOutputCollector):
    """A new output replaces the one the reader has not taken yet: tokens are lost when the reader is slow."""

    def put(self, output: RequestOutput) -> None:
        self._output = output
        self._ready.set()


class CollectorNeverTakes(RequestOutputCollector):
    """Hands out the pending output without taking it: the reader gets the same tokens again and again."""

    async def get(self) -> RequestOutput:
        while self._output is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._output is None:
            raise self._error
        return self._output


class CollectorErrorFirst(RequestOutputCollector):
    """Raises a pending error even while an output that arrived before it waits to be read."""

    async def get(self) -> RequestOutput:
        while self._output is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._error is not None:
            raise self._error
        output, self._output = self._output, None
        return output


class CollectorNeverWakes(RequestOutputCollector):
    """Stores the output but never signals it: a reader already waiting sleeps through it."""

    def put(self, output: RequestOutput) -> None:
        self._output = output if self._output is None else merge_delta(self._output, output)


class CollectorNeverClearsTheEvent(RequestOutputCollector):
    """Sets the event in `put` but never clears it (HANG): once one output has been read, `get` with nothing
    pending goes round its loop for ever without waiting, and the event loop it runs on stops."""

    async def get(self) -> RequestOutput:
        while self._output is None and self._error is None:
            await self._ready.wait()
        if self._output is None:
            raise self._error
        output, self._output = self._output, None
        return output


class CollectorMergesByPosition(RequestOutputCollector):
    """Merges a new output into the pending one itself, sample by sample in list order, text and tokens only:
    with n > 1 a step lists only the samples that moved, so samples get each other's tokens, and logprobs are lost."""

    def put(self, output: RequestOutput) -> None:
        if self._output is None:
            self._output = output
        else:
            for earlier, completion in zip(self._output.outputs, output.outputs):
                earlier.text += completion.text
                earlier.token_ids = earlier.token_ids + completion.token_ids
                earlier.finish_reason = completion.finish_reason
            self._output.finished = output.finished
        self._ready.set()


class CollectorMergesIntoAFinishedOutput(RequestOutputCollector):
    """Merges whatever comes into the pending output, even one already finished: an abort that crosses the last
    output turns a complete answer's finish reason into "abort"."""

    def put(self, output: RequestOutput) -> None:
        self._output = output if self._output is None else merge_delta(self._output, output)
        self._ready.set()


class CollectorGuardsOnlyWhatWasTaken(RequestOutputCollector):
    """Ignores outputs only once its reader has taken the finished one: an abort that crosses a finished output
    still waiting to be read is merged into it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._finished_taken = False

    def put(self, output: RequestOutput) -> None:
        if self._finished_taken:
            return
        self._output = output if self._output is None else merge_delta(self._output, output)
        self._ready.set()

    async def get(self) -> RequestOutput:
        output = await super().get()
        self._finished_taken = output.finished
        return output


class CollectorErrorNeverWakes(RequestOutputCollector):
    """Stores the error but never sets the event: a reader already waiting when the engine dies waits for ever."""

    def put_error(self, error: BaseException) -> None:
        self._error = error


class CollectorWaitsOnlyForOutputs(RequestOutputCollector):
    """Waits while there is no output, whether or not an error came: the error is never raised, and a reader whose
    engine died waits for ever."""

    async def get(self) -> RequestOutput:
        while self._output is None:
            self._ready.clear()
            await self._ready.wait()
        output, self._output = self._output, None
        return output


# --- generate ------------------------------------------------------------------------------------------------------


async def generate_never_aborts(llm: AsyncLLM, prompt: str | list[int], params: SamplingParams, request_id: str,
                                priority: int = 0) -> AsyncIterator[RequestOutput]:
    """Streams the outputs but never aborts: a caller that leaves early leaves its request running to the end."""
    collector = await llm.add_request(request_id, prompt, params, priority)
    finished = False
    while not finished:
        output = await collector.get()
        finished = output.finished
        yield output


async def generate_aborts_only_when_cancelled(llm: AsyncLLM, prompt: str | list[int], params: SamplingParams,
                                              request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
    """Aborts on CancelledError only: a caller that closes the stream (GeneratorExit at the `yield`, what a server
    does when a streaming client leaves) leaves its request running."""
    collector = await llm.add_request(request_id, prompt, params, priority)
    finished = False
    try:
        while not finished:
            output = await collector.get()
            finished = output.finished
            yield output
    except asyncio.CancelledError:
        await llm.abort(request_id)
        raise


async def generate_aborts_only_when_closed(llm: AsyncLLM, prompt: str | list[int], params: SamplingParams,
                                           request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
    """Aborts on GeneratorExit only: a caller whose task is cancelled (CancelledError at the `await`) leaves its
    request running."""
    collector = await llm.add_request(request_id, prompt, params, priority)
    finished = False
    try:
        while not finished:
            output = await collector.get()
            finished = output.finished
            yield output
    except GeneratorExit:
        await llm.abort(request_id)
        raise


async def generate_always_aborts(llm: AsyncLLM, prompt: str | list[int], params: SamplingParams, request_id: str,
                                 priority: int = 0) -> AsyncIterator[RequestOutput]:
    """Aborts in `finally` whether or not the request finished: a late close aborts whatever request has taken the
    id since."""
    collector = await llm.add_request(request_id, prompt, params, priority)
    finished = False
    try:
        while not finished:
            output = await collector.get()
            finished = output.finished
            yield output
    finally:
        await llm.abort(request_id)


async def generate_marks_finished_after_the_yield(llm: AsyncLLM, prompt: str | list[int], params: SamplingParams,
                                                  request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
    """Notes `finished` only after the caller comes back for more: a caller that stops at the finished output
    closes a stream that still thinks its request runs, and it is aborted (or whatever request has the id now)."""
    collector = await llm.add_request(request_id, prompt, params, priority)
    finished = False
    try:
        while not finished:
            output = await collector.get()
            yield output
            finished = output.finished
    finally:
        if not finished:
            await llm.abort(request_id)


async def generate_swallows_errors(llm: AsyncLLM, prompt: str | list[int], params: SamplingParams, request_id: str,
                                   priority: int = 0) -> AsyncIterator[RequestOutput]:
    """Catches what the collector raises and ends the stream quietly: when the core dies the caller sees a short
    answer, not EngineDeadError."""
    collector = await llm.add_request(request_id, prompt, params, priority)
    finished = False
    try:
        while not finished:
            output = await collector.get()
            finished = output.finished
            yield output
    except Exception:
        return
    finally:
        if not finished:
            await llm.abort(request_id)


async def generate_ignores_finished(llm: AsyncLLM, prompt: str | list[int], params: SamplingParams, request_id: str,
                                    priority: int = 0) -> AsyncIterator[RequestOutput]:
    """Never looks at `finished` (HANG): after the last output it waits on the collector for ever."""
    collector = await llm.add_request(request_id, prompt, params, priority)
    finished = False
    try:
        while True:
            output = await collector.get()
            finished = finished or output.finished
            yield output
    finally:
        if not finished:
            await llm.abort(request_id)


async def generate_aborts_a_refused_submit(llm: AsyncLLM, prompt: str | list[int], params: SamplingParams,
                                           request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
    """Submits inside the `try`: a request refused for an id still in use is "aborted", and the abort hits the
    request that holds the id."""
    finished = False
    try:
        collector = await llm.add_request(request_id, prompt, params, priority)
        while not finished:
            output = await collector.get()
            finished = output.finished
            yield output
    finally:
        if not finished:
            await llm.abort(request_id)


async def generate_swallows_cancellation(llm: AsyncLLM, prompt: str | list[int], params: SamplingParams,
                                         request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
    """Aborts on CancelledError but then ends the stream quietly instead of re-raising: the cancelled caller's task
    carries on as if the answer were complete."""
    collector = await llm.add_request(request_id, prompt, params, priority)
    finished = False
    try:
        while not finished:
            output = await collector.get()
            finished = output.finished
            yield output
    except asyncio.CancelledError:
        await llm.abort(request_id)
        finished = True
        return
    finally:
        if not finished:
            await llm.abort(request_id)


async def generate_aborts_only_in_the_core(llm: AsyncLLM, prompt: str | list[int], params: SamplingParams,
                                           request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
    """Aborts through `llm.engine_core.abort_requests` instead of `llm.abort`: the core frees the blocks, but the
    front end never forgets the request, so its id stays in use and a new request under it is refused."""
    collector = await llm.add_request(request_id, prompt, params, priority)
    finished = False
    try:
        while not finished:
            output = await collector.get()
            finished = output.finished
            yield output
    finally:
        if not finished:
            llm.engine_core.abort_requests([request_id])


async def generate_never_awaits_the_abort(llm: AsyncLLM, prompt: str | list[int], params: SamplingParams,
                                          request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
    """Calls `llm.abort(request_id)` without `await`: that only makes a coroutine, which never runs, so nothing is
    aborted (Python warns "coroutine ... was never awaited")."""
    collector = await llm.add_request(request_id, prompt, params, priority)
    finished = False
    try:
        while not finished:
            output = await collector.get()
            finished = output.finished
            yield output
    finally:
        if not finished:
            llm.abort(request_id).close()  # (closed here only to keep the test run free of the warning)


# --- until_disconnected --------------------------------------------------------------------------------------------


async def until_disconnected_never_cancels(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]) -> T:
    """Raises ClientDisconnected when the client leaves, but leaves the work running: the request is never aborted."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        raise ClientDisconnected
    watcher.cancel()
    return task.result()


async def until_disconnected_any_message(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]) -> T:
    """Takes any message on the connection for a disconnect (a body chunk too)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(receive())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


async def until_disconnected_leaves_the_watcher(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]) -> T:
    """Returns the work's result but never cancels the task waiting for a disconnect: one leaks per request."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        task.cancel()
        await asyncio.wait((task,))
        raise ClientDisconnected
    return task.result()


async def until_disconnected_cancels_without_waiting(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]) -> T:
    """Cancels the work and raises at once, before the cancellation has run: the abort has not happened yet."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not task.done():
        task.cancel()
        raise ClientDisconnected
    return task.result()


async def until_disconnected_awaits_the_cancelled_watcher(receive: Callable[[], Awaitable[dict]],
                                                          work: Awaitable[T]) -> T:
    """Cancels the watcher and then awaits it, which raises CancelledError: a client that stays gets no answer."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        task.cancel()
        await asyncio.wait((task,))
        raise ClientDisconnected
    watcher.cancel()
    await watcher
    return task.result()


async def until_disconnected_keeps_the_watcher_when_the_work_fails(receive: Callable[[], Awaitable[dict]],
                                                                   work: Awaitable[T]) -> T:
    """Takes the work's result before cancelling the watcher: when the work raises, the watcher is left waiting on
    the connection (one task leaked per failed request)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        task.cancel()
        await asyncio.wait((task,))
        raise ClientDisconnected
    result = task.result()
    watcher.cancel()
    return result


async def until_disconnected_orphans_its_tasks_when_cancelled(receive: Callable[[], Awaitable[dict]],
                                                              work: Awaitable[T]) -> T:
    """Cleans up only on its own paths (no `finally`): when its caller is cancelled, the work and the watcher run
    on, and the request the work iterates is never aborted."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait((task,))
        raise ClientDisconnected
    return task.result()

MUTANTS = {
    "run_busy_loop_one_message_per_step": {"run_busy_loop": run_busy_loop_one_message_per_step},
    "run_busy_loop_never_reports_idle": {"run_busy_loop": run_busy_loop_never_reports_idle},
    "run_busy_loop_polls_while_idle": {"run_busy_loop": run_busy_loop_polls_while_idle},
    "run_busy_loop_finishes_the_batch_before_stopping": {
        "run_busy_loop": run_busy_loop_finishes_the_batch_before_stopping,
    },
    "run_busy_loop_outlives_its_front_end": {"run_busy_loop": run_busy_loop_outlives_its_front_end},
    "run_busy_loop_reads_only_while_idle": {"run_busy_loop": run_busy_loop_reads_only_while_idle},
    "run_busy_loop_survives_a_failing_step": {"run_busy_loop": run_busy_loop_survives_a_failing_step},
    "run_busy_loop_stops_at_the_first_idle_timeout": {"run_busy_loop": run_busy_loop_stops_at_the_first_idle_timeout},
    "run_busy_loop_asks_parent_alive_backwards": {"run_busy_loop": run_busy_loop_asks_parent_alive_backwards},
    "run_busy_loop_waits_for_more_while_busy": {"run_busy_loop": run_busy_loop_waits_for_more_while_busy},
    "run_busy_loop_ignores_shutdown_while_idle": {"run_busy_loop": run_busy_loop_ignores_shutdown_while_idle},
    "collector_keeps_the_newest": {"RequestOutputCollector": CollectorKeepsTheNewest},
    "collector_never_takes": {"RequestOutputCollector": CollectorNeverTakes},
    "collector_error_first": {"RequestOutputCollector": CollectorErrorFirst},
    "collector_never_wakes": {"RequestOutputCollector": CollectorNeverWakes},
    "collector_never_clears_the_event": {"RequestOutputCollector": CollectorNeverClearsTheEvent},
    "collector_merges_by_position": {"RequestOutputCollector": CollectorMergesByPosition},
    "collector_merges_into_a_finished_output": {"RequestOutputCollector": CollectorMergesIntoAFinishedOutput},
    "collector_guards_only_what_was_taken": {"RequestOutputCollector": CollectorGuardsOnlyWhatWasTaken},
    "collector_error_never_wakes": {"RequestOutputCollector": CollectorErrorNeverWakes},
    "collector_waits_only_for_outputs": {"RequestOutputCollector": CollectorWaitsOnlyForOutputs},
    "generate_never_aborts": {"generate": generate_never_aborts},
    "generate_aborts_only_when_cancelled": {"generate": generate_aborts_only_when_cancelled},
    "generate_aborts_only_when_closed": {"generate": generate_aborts_only_when_closed},
    "generate_always_aborts": {"generate": generate_always_aborts},
    "generate_marks_finished_after_the_yield": {"generate": generate_marks_finished_after_the_yield},
    "generate_swallows_errors": {"generate": generate_swallows_errors},
    "generate_ignores_finished": {"generate": generate_ignores_finished},
    "generate_aborts_a_refused_submit": {"generate": generate_aborts_a_refused_submit},
    "generate_swallows_cancellation": {"generate": generate_swallows_cancellation},
    "generate_aborts_only_in_the_core": {"generate": generate_aborts_only_in_the_core},
    "generate_never_awaits_the_abort": {"generate": generate_never_awaits_the_abort},
    "until_disconnected_never_cancels": {"until_disconnected": until_disconnected_never_cancels},
    "until_disconnected_any_message": {"until_disconnected": until_disconnected_any_message},
    "until_disconnected_leaves_the_watcher": {"until_disconnected": until_disconnected_leaves_the_watcher},
    "until_disconnected_cancels_without_waiting": {"until_disconnected": until_disconnected_cancels_without_waiting},
    "until_disconnected_awaits_the_cancelled_watcher": {
        "until_disconnected": until_disconnected_awaits_the_cancelled_watcher,
    },
    "until_disconnected_keeps_the_watcher_when_the_work_fails": {
        "until_disconnected": until_disconnected_keeps_the_watcher_when_the_work_fails,
    },
    "until_disconnected_orphans_its_tasks_when_cancelled": {
        "until_disconnected": until_disconnected_orphans_its_tasks_when_cancelled,
    },
}

# For every exercise, a mutant that makes the capstone (a live server on SmolLM2, streamed and whole requests, two
# clients that hang up) fail: the capstone really runs each exercise.
CAPSTONE_MUTANTS = {
    "run_busy_loop": "run_busy_loop_never_reports_idle",
    "RequestOutputCollector": "collector_never_wakes",
    "generate": "generate_never_aborts",
    "until_disconnected": "until_disconnected_never_cancels",
}

# The statements each exercise's question is about, as `ast.unparse` writes them (a compound statement by its
# header). Hint 2 may show none of them, and nothing under chapters/ may state them (tests/test_hints.py): they
# live here, beside the wrong answers, because a learner reads the chapter's test file.
DECISIVE = {
    "run_busy_loop": [
        'while not core.has_unfinished_requests():',
        'message = input_queue.get(block=False)',
    ],
    "RequestOutputCollector": [
        'if self._output is not None and self._output.finished:',
        'self._output = output if self._output is None else merge_delta(self._output, output)',
    ],
    "generate": [
        'finished = output.finished',
        'if not finished:',
        'await llm.abort(request_id)',
    ],
    "until_disconnected": [
        'await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)',
        'task.cancel()',
    ],
}

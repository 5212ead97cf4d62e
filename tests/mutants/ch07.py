"""Plausible wrong answers to chapter 07's exercises; each must fail at least one test of its exercise.

Class exercises are mutated by subclassing the reference and overriding the method that goes wrong.
"""

import asyncio
import queue
from collections.abc import Awaitable, Callable
from typing import TypeVar

import numpy as np

from benchmarks.serving import RequestTimeline, normalized_latency, serving_metrics, summary
from solutions.engine.async_llm import RequestOutputCollector
from solutions.engine.async_llm import merge_delta as reference_merge_delta
from solutions.engine.core import IDLE_POLL_SECONDS, EngineCoreProc, MessageQueue
from solutions.entrypoints.openai.serving_engine import ClientDisconnected, wait_for_disconnect
from solutions.outputs import RequestOutput

T = TypeVar("T")

# --- run_busy_loop -------------------------------------------------------------------------------------------------


def _loop(core: EngineCoreProc, input_queue: MessageQueue, output_queue: MessageQueue,
          parent_alive: Callable[[], bool], *, drain_one: bool = False, report_idle: bool = True, block: bool = True,
          stop_when_busy: bool = True, watch_parent: bool = True) -> None:
    """The reference loop, with switches for what the mutants below get wrong."""
    while True:
        while not core.has_unfinished_requests():
            if report_idle:
                core.report_idle(output_queue)
            try:
                message = input_queue.get(timeout=IDLE_POLL_SECONDS) if block else input_queue.get(block=False)
            except queue.Empty:
                if watch_parent and not parent_alive():
                    return
                continue
            if not core.handle(message, output_queue):
                return
        while True:
            try:
                message = input_queue.get(block=False)
            except queue.Empty:
                break
            if not core.handle(message, output_queue) and stop_when_busy:
                return
            if drain_one:
                break
        if core.has_unfinished_requests():
            output_queue.put(core.step())


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


# --- merge_delta ---------------------------------------------------------------------------------------------------


def merge_delta_keeps_the_newest(pending: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Replaces the pending output with the new one: the tokens the reader had not taken are lost."""
    return new


def merge_delta_by_position(pending: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Pairs the samples by their position in the lists, not by their index."""
    for earlier, completion in zip(pending.outputs, new.outputs):
        earlier.text += completion.text
        earlier.token_ids = earlier.token_ids + completion.token_ids
        if completion.logprobs is not None:
            earlier.logprobs = (earlier.logprobs or []) + completion.logprobs
        earlier.finish_reason, earlier.stop_reason = completion.finish_reason, completion.stop_reason
        earlier.cumulative_logprob = completion.cumulative_logprob
    pending.finished, pending.num_cached_tokens = new.finished, new.num_cached_tokens
    return pending


def merge_delta_keeps_the_first_finish(pending: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Concatenates the samples but keeps the pending output's request-level state (finished, cached tokens)."""
    finished, cached = pending.finished, pending.num_cached_tokens
    merged = reference_merge_delta(pending, new)
    merged.finished, merged.num_cached_tokens = finished, cached
    return merged


def merge_delta_drops_logprobs(pending: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Concatenates text and tokens but keeps only the newer output's logprobs."""
    logprobs = {c.index: c.logprobs for c in new.outputs}
    merged = reference_merge_delta(pending, new)
    for completion in merged.outputs:
        if logprobs.get(completion.index) is not None:
            completion.logprobs = logprobs[completion.index]
    return merged


# --- RequestOutputCollector ----------------------------------------------------------------------------------------


class CollectorKeepsTheNewest(RequestOutputCollector):
    """A new output replaces the one the reader has not taken yet: tokens are lost when the reader is slow."""

    def put(self, output: RequestOutput) -> None:
        self._output = output
        self._ready.set()


class CollectorNeverClears(RequestOutputCollector):
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
        self._output = output if self._output is None else reference_merge_delta(self._output, output)


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


# --- serving_metrics -----------------------------------------------------------------------------------------------


def serving_metrics_tpot_over_every_token(timelines: list[RequestTimeline], duration: float) -> dict:
    """Divides the time after the first token by all the output tokens, not by the ones after the first."""
    metrics = serving_metrics(timelines, duration)
    done = [t for t in timelines if t.error is None]
    metrics["tpot_s"] = summary([(t.e2e - t.ttft) / t.output_tokens for t in done if t.output_tokens > 1])
    return metrics


def serving_metrics_itl_from_the_send(timelines: list[RequestTimeline], duration: float) -> dict:
    """Measures inter-token latencies from the request's send time, so the first one is the TTFT."""
    metrics = serving_metrics(timelines, duration)
    done = [t for t in timelines if t.error is None]
    metrics["itl_s"] = summary([gap for t in done for gap in np.diff([t.sent, *t.chunk_times]).tolist()])
    return metrics


def serving_metrics_counts_failures(timelines: list[RequestTimeline], duration: float) -> dict:
    """Counts failed requests as completed in the request throughput."""
    metrics = serving_metrics(timelines, duration)
    metrics["request_throughput"] = len(timelines) / duration
    return metrics


def serving_metrics_p99_is_the_max(timelines: list[RequestTimeline], duration: float) -> dict:
    """Takes the slowest value for the 99th percentile (no interpolation between the two largest)."""
    metrics = serving_metrics(timelines, duration)
    done = [t for t in timelines if t.error is None]
    for key, values in (("ttft_s", [t.ttft for t in done]), ("e2e_s", [t.e2e for t in done]),
                        ("itl_s", [gap for t in done for gap in t.itls]),
                        ("tpot_s", [tpot for t in done if (tpot := t.tpot) is not None])):
        if values:
            metrics[key] = dict(metrics[key], p99=float(max(values)))
    metrics["normalized_latency_s_per_token"] = normalized_latency(done)
    return metrics


MUTANTS = {
    "run_busy_loop_one_message_per_step": {"run_busy_loop": run_busy_loop_one_message_per_step},
    "run_busy_loop_never_reports_idle": {"run_busy_loop": run_busy_loop_never_reports_idle},
    "run_busy_loop_polls_while_idle": {"run_busy_loop": run_busy_loop_polls_while_idle},
    "run_busy_loop_finishes_the_batch_before_stopping": {
        "run_busy_loop": run_busy_loop_finishes_the_batch_before_stopping,
    },
    "run_busy_loop_outlives_its_front_end": {"run_busy_loop": run_busy_loop_outlives_its_front_end},
    "merge_delta_keeps_the_newest": {"merge_delta": merge_delta_keeps_the_newest},
    "merge_delta_by_position": {"merge_delta": merge_delta_by_position},
    "merge_delta_keeps_the_first_finish": {"merge_delta": merge_delta_keeps_the_first_finish},
    "merge_delta_drops_logprobs": {"merge_delta": merge_delta_drops_logprobs},
    "collector_keeps_the_newest": {"RequestOutputCollector": CollectorKeepsTheNewest},
    "collector_never_clears": {"RequestOutputCollector": CollectorNeverClears},
    "collector_error_first": {"RequestOutputCollector": CollectorErrorFirst},
    "collector_never_wakes": {"RequestOutputCollector": CollectorNeverWakes},
    "until_disconnected_never_cancels": {"until_disconnected": until_disconnected_never_cancels},
    "until_disconnected_any_message": {"until_disconnected": until_disconnected_any_message},
    "until_disconnected_leaves_the_watcher": {"until_disconnected": until_disconnected_leaves_the_watcher},
    "until_disconnected_cancels_without_waiting": {"until_disconnected": until_disconnected_cancels_without_waiting},
    "serving_metrics_tpot_over_every_token": {"serving_metrics": serving_metrics_tpot_over_every_token},
    "serving_metrics_itl_from_the_send": {"serving_metrics": serving_metrics_itl_from_the_send},
    "serving_metrics_counts_failures": {"serving_metrics": serving_metrics_counts_failures},
    "serving_metrics_p99_is_the_max": {"serving_metrics": serving_metrics_p99_is_the_max},
}

# For every exercise, a mutant that makes the capstone (a live server on SmolLM2, streamed and whole requests, two
# clients that hang up, the serving metrics of the streamed ones) fail: the capstone really runs each exercise.
CAPSTONE_MUTANTS = {
    "run_busy_loop": "run_busy_loop_never_reports_idle",
    "merge_delta": "merge_delta_keeps_the_newest",
    "RequestOutputCollector": "collector_never_wakes",
    "until_disconnected": "until_disconnected_never_cancels",
    "serving_metrics": "serving_metrics_tpot_over_every_token",
}

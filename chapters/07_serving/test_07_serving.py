"""Grading tests for chapter 07 — serving.

Each test grades one exercise (`@pytest.mark.exercise`). The oracles are independent of the code under test: the
offline `LLM.generate` of the same requests (for the engine core loop and the front end's `generate`), outputs
written out by hand (for the collector), what an ASGI server really sends (for disconnects), and Hugging Face's
greedy tokens (for the capstone, a live server on SmolLM2).

No test can hang: every thread a test starts is a daemon whose join is bounded (`grading.waits`), and every event
loop runs under a deadline, so a loop that never returns, a `get` that spins or a stream that never ends fails in
seconds, saying which wait never returned and what usually causes it.
"""

import asyncio
import functools
import queue
import threading
import time
import urllib.request
from contextlib import contextmanager

import pytest

from grading import ExerciseError, exercising, expect_equal
from grading.capstone import CAPSTONE_PROMPTS, smollm2, smollm2_greedy, swap_in
from grading.tiny_models import tiny_checkpoint
from grading.waits import hang_message, join_or_fail, run_bounded
from solutions import LLM, SamplingParams
from solutions.engine import async_llm, core
from solutions.engine.arg_utils import EngineArgs
from solutions.entrypoints.openai import serving_engine
from solutions.executor.abstract import Executor
from solutions.outputs import CompletionOutput, FinishReason, Logprob, RequestOutput

REFERENCE = {
    "run_busy_loop": core.run_busy_loop,
    "RequestOutputCollector": async_llm.RequestOutputCollector,
    "generate": async_llm.generate,
    "until_disconnected": serving_engine.until_disconnected,
}

pytestmark = pytest.mark.timeout(60)


def run(coroutine, *, what: str, likely: str, timeout: float = 10.0):
    """`asyncio.run(coroutine)` on a daemon thread of its own (`check()` runs these tests inside a notebook, whose
    event loop is already running in this thread), under a deadline: a coroutine still waiting after `timeout`
    is cancelled, and one that never yields to its event loop (a spinning `get`) is stopped a little later."""

    async def bounded():
        try:
            return await asyncio.wait_for(coroutine, timeout)
        except TimeoutError:
            raise ExerciseError(hang_message(what, timeout, likely)) from None

    return run_bounded(lambda: asyncio.run(bounded()), timeout + 2, what=what, likely=likely)


# --- run_busy_loop -------------------------------------------------------------------------------------------------

GREEDY = dict(temperature=0.0, ignore_eos=True)


@functools.cache
def tiny_llm() -> LLM:
    return LLM(model=str(tiny_checkpoint("llama-gqa")), block_size=4, max_model_len=256)


def tiny_core() -> core.EngineCoreProc:
    """A fresh engine core on the tiny model, as a front end would start it: EngineArgs -> VllmConfig -> core."""
    config = EngineArgs(
        model=str(tiny_checkpoint("llama-gqa")), block_size=4, num_kv_blocks=64, max_num_seqs=8,
        max_num_batched_tokens=64, max_model_len=256, long_prefill_token_threshold=64,
    ).create_engine_config()
    return core.EngineCoreProc(config, Executor.get_class(config))


def offline(prompt: list[int], max_tokens: int) -> list[int]:
    """The reference answer: `LLM.generate`, one request alone."""
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    return tiny_llm().generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def add(request_id: str, prompt: list[int], max_tokens: int) -> tuple:
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    return core.EngineCoreRequestType.ADD, core.EngineCoreRequest(request_id, prompt, params, 0)


SHUTDOWN = (core.EngineCoreRequestType.SHUTDOWN, None)


class LoopUnderTest:
    """`impl.run_busy_loop` on a fresh engine core (tiny model), in a thread, fed and read through two queues."""

    def __init__(self, impl, messages=(), parent_alive=lambda: True, input_queue: queue.Queue | None = None) -> None:
        self.core = tiny_core()
        self.input_queue, self.output_queue = input_queue or queue.Queue(), queue.Queue()
        for message in messages:
            self.input_queue.put(message)
        self.error: BaseException | None = None

        def target() -> None:
            try:
                impl.run_busy_loop(self.core, self.input_queue, self.output_queue, parent_alive)
            except BaseException as error:  # reported by `stop`/`messages`, against the exercise
                self.error = error

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def check(self, inputs: str) -> None:
        if self.error is not None:
            with exercising("run_busy_loop", inputs):
                raise self.error

    def messages_until(self, done, inputs: str, timeout: float = 30.0) -> list:
        """Read output messages until `done(messages)`; the loop must keep producing them."""
        messages, deadline = [], time.monotonic() + timeout
        while not done(messages):
            self.check(inputs)
            try:
                messages.append(self.output_queue.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"on input {inputs}: no output message for {timeout:.0f} s; got so far "
                                     f"{len(messages)} messages") from None
        return messages

    def stop(self, inputs: str, timeout: float = 5.0) -> None:
        self.input_queue.put(SHUTDOWN)
        join_or_fail(self.thread, timeout, what=f"your run_busy_loop after SHUTDOWN (on input {inputs})",
                     likely="SHUTDOWN is only noticed while idle, or the loop never reads the queue while busy")
        self.check(inputs)


def step_messages(messages: list) -> list:
    """The messages that carry a step's outputs (not the stats-only ones an idle core sends)."""
    return [m for m in messages if isinstance(m, core.EngineCoreOutputs) and m.outputs]


def tokens_by_request(messages: list) -> dict[str, list[int]]:
    """The token ids each request got, over the messages (the core speaks token ids: one EngineCoreOutput per
    sample per step)."""
    tokens: dict[str, list[int]] = {}
    for message in step_messages(messages):
        for output in message.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def finished(*request_ids: str):
    def done(messages: list) -> bool:
        ended = {o.request_id for m in step_messages(messages) for o in m.outputs if o.finish_reason is not None}
        return ended >= set(request_ids)

    return done


@pytest.mark.exercise("run_busy_loop")
def test_run_busy_loop_serves_requests_with_one_message_per_step(impl):
    prompts = {"a": [5, 6, 7], "b": list(range(20, 31))}
    inputs = "two requests queued before the loop starts: 3- and 11-token prompts, 4 greedy tokens each"
    loop = LoopUnderTest(impl, [add(r, p, 4) for r, p in prompts.items()])
    messages = loop.messages_until(finished("a", "b"), inputs)
    loop.stop(inputs)
    expect_equal(tokens_by_request(messages), {r: offline(p, 4) for r, p in prompts.items()},
                 inputs=f"{inputs}; tokens per request (oracle: LLM.generate)")
    expect_equal([sorted(o.request_id for o in m.outputs) for m in step_messages(messages)], [["a", "b"]] * 4,
                 inputs=f"{inputs}; request ids in each step's message (both admitted at the first step, one message "
                 "per step)")


@pytest.mark.exercise("run_busy_loop")
def test_run_busy_loop_takes_every_waiting_message_before_a_step(impl):
    inputs = "a long request running; then three requests put on the input queue at once"
    loop = LoopUnderTest(impl, [add("long", list(range(40, 50)), 30)])
    loop.messages_until(lambda m: len(step_messages(m)) >= 1, inputs)
    for i in range(3):
        loop.input_queue.put(add(f"new{i}", [60 + i, 61, 62], 2))
    messages = loop.messages_until(finished("new0", "new1", "new2"), inputs)
    loop.stop(inputs)
    first = next(m for m in step_messages(messages) if any(o.request_id.startswith("new") for o in m.outputs))
    new_ids = sorted(o.request_id for o in first.outputs if o.request_id.startswith("new"))
    expect_equal(new_ids, ["new0", "new1", "new2"],
                 inputs=f"{inputs}; the new requests in the first step that serves any of them (all must join it)")
    expect_equal(any(o.request_id == "long" and o.finish_reason is None for o in first.outputs), True,
                 inputs=f"{inputs}; the long request still runs in that step (requests that arrive while a step "
                 "runs join the next step, not the first step after the batch has drained)")


@pytest.mark.exercise("run_busy_loop")
def test_run_busy_loop_aborts_before_the_next_step_and_reports_the_idle_gauges(impl):
    inputs = "one request of 60 tokens running; ABORT it after its first output"
    loop = LoopUnderTest(impl, [add("r", list(range(10, 20)), 60)])
    loop.messages_until(lambda m: len(step_messages(m)) >= 1, inputs)
    loop.input_queue.put((core.EngineCoreRequestType.ABORT, ["r"]))

    def idle_report(messages: list) -> bool:
        last = messages[-1] if messages else None
        return isinstance(last, core.EngineCoreOutputs) and not last.outputs and last.scheduler_stats is not None

    messages = loop.messages_until(idle_report, inputs, timeout=3.0)
    loop.stop(inputs)
    stats = messages[-1].scheduler_stats
    expect_equal((stats.num_running, stats.num_waiting, stats.kv_cache_usage), (0, 0, 0.0),
                 inputs=f"{inputs}; (running, waiting, KV usage) in the stats the idle core sends")
    expect_equal(len(tokens_by_request(messages).get("r", [])) < 59, True,
                 inputs=f"{inputs}; the aborted request stopped early (no step may run it after the ABORT is read)")


@pytest.mark.exercise("run_busy_loop")
def test_run_busy_loop_stops_at_shutdown_even_while_busy(impl):
    inputs = "one request of 200 tokens running; SHUTDOWN after its first output"
    loop = LoopUnderTest(impl, [add("r", list(range(10, 20)), 200)])
    loop.messages_until(lambda m: len(step_messages(m)) >= 1, inputs)
    loop.stop(inputs)  # raises unless the loop returns within 5 s
    expect_equal(loop.core.has_unfinished_requests(), True, inputs=f"{inputs}; the request is left unfinished")


@pytest.mark.exercise("run_busy_loop")
def test_run_busy_loop_lets_a_failing_step_raise(impl):
    loop = LoopUnderTest(impl, [add("ok", list(range(10, 20)), 60)])
    vocab = loop.core.vllm_config.model_config.vocab_size
    inputs = (f"a request running, then one whose prompt holds token id {vocab + 5} (the vocabulary has {vocab}; "
              "it slipped past validation): the step that computes it raises IndexError")
    loop.messages_until(lambda m: len(step_messages(m)) >= 1, inputs)
    loop.input_queue.put(add("poison", [vocab + 5], 4))
    join_or_fail(loop.thread, 5, what=f"your run_busy_loop after a step raised (on input {inputs})",
                 likely="the loop catches the step's exception and carries on: nobody tells the front end, whose "
                 "callers then wait for ever (EngineCoreProc.run_busy_loop turns the exception into EngineDead)")
    if isinstance(loop.error, ExerciseError):
        raise loop.error  # a stub, or a failure in your code before the step
    expect_equal(type(loop.error).__name__, "IndexError",
                 inputs=f"{inputs}; what your run_busy_loop raised (the step's own exception must reach its caller)")


class CountingQueue(queue.Queue):
    """An input queue that counts the calls made on it (the instrument of the idle test: a loop that polls makes
    thousands a second however little CPU a busy machine leaves it, a loop that waits makes one per wait)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def get(self, block: bool = True, timeout: float | None = None):  # get_nowait comes here too
        self.calls += 1
        return super().get(block, timeout)

    def empty(self) -> bool:
        self.calls += 1
        return super().empty()

    def qsize(self) -> int:
        self.calls += 1
        return super().qsize()


@pytest.mark.exercise("run_busy_loop")
def test_run_busy_loop_blocks_while_idle(impl):
    inputs = "no request for half a second"
    loop = LoopUnderTest(impl, input_queue=CountingQueue())
    time.sleep(0.1)
    cpu, calls = time.process_time(), loop.input_queue.calls
    time.sleep(0.5)
    cpu, calls = time.process_time() - cpu, loop.input_queue.calls - calls
    loop.stop(inputs)
    expect_equal((calls <= 20, cpu < 0.2), (True, True),
                 inputs=f"{inputs}; (at most 20 calls on the input queue, under 0.2 s of CPU) in those 0.5 s: your "
                 f"loop made {calls} calls and the process used {cpu:.2f} s of CPU. An idle loop must wait on the "
                 "input queue (get with a timeout), not poll it")


@pytest.mark.exercise("run_busy_loop")
def test_run_busy_loop_returns_when_the_front_end_is_gone(impl):
    inputs = ("idle, and parent_alive() turns False (the idle wait is at most "
              f"IDLE_POLL_SECONDS={core.IDLE_POLL_SECONDS})")
    gone = threading.Event()
    loop = LoopUnderTest(impl, parent_alive=lambda: not gone.is_set())
    time.sleep(0.1)
    gone.set()
    join_or_fail(loop.thread, 4 * core.IDLE_POLL_SECONDS + 1, what=f"your run_busy_loop (on input {inputs})",
                 likely="the idle wait never asks parent_alive(), so an orphaned core waits for a SHUTDOWN nobody "
                 "will send")
    loop.check(inputs)


@pytest.mark.exercise("run_busy_loop")
def test_run_busy_loop_stays_up_while_idle_as_long_as_the_front_end_lives(impl):
    idle = 3 * core.IDLE_POLL_SECONDS + 0.2
    inputs = (f"no request for {idle:g} s (the idle wait of IDLE_POLL_SECONDS={core.IDLE_POLL_SECONDS} times out "
              "three times; parent_alive() stays True), then a request of 4 greedy tokens")
    loop = LoopUnderTest(impl)
    time.sleep(idle)
    loop.check(inputs)
    expect_equal(loop.thread.is_alive(), True, inputs=f"{inputs}; your loop still running when the request comes "
                 "(a timed-out idle wait only means: ask parent_alive(); the loop ends when it says False, and "
                 "otherwise waits again)")
    loop.input_queue.put(add("r", [5, 6, 7], 4))
    messages = loop.messages_until(finished("r"), inputs)
    loop.stop(inputs)
    expect_equal(tokens_by_request(messages), {"r": offline([5, 6, 7], 4)},
                 inputs=f"{inputs}; tokens of the request (oracle: LLM.generate)")


@pytest.mark.exercise("run_busy_loop")
def test_run_busy_loop_does_not_wait_on_the_queue_while_busy(impl):
    inputs = (f"one request of 16 greedy tokens, nothing else on the input queue (a step of the tiny model takes "
              f"milliseconds; the idle wait is IDLE_POLL_SECONDS={core.IDLE_POLL_SECONDS})")
    loop = LoopUnderTest(impl, [add("r", list(range(10, 20)), 16)])
    arrivals, deadline = [], time.monotonic() + 60
    while not arrivals or arrivals[-1][1] is None:
        loop.check(inputs)
        try:
            message = loop.output_queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"on input {inputs}: the request did not finish within 60 s; got {len(arrivals)} "
                                 "step messages") from None
        if step_messages([message]):
            arrivals.append((time.monotonic(), message.outputs[0].finish_reason))
    loop.stop(inputs)
    gaps = sorted(later[0] - earlier[0] for earlier, later in zip(arrivals, arrivals[1:]))
    median = gaps[len(gaps) // 2]
    expect_equal(median < core.IDLE_POLL_SECONDS / 2, True,
                 inputs=f"{inputs}; the median time between two step messages is {median:.2f} s: while busy, take "
                 "what is already waiting with get(block=False) and step at once (a get with a timeout waits that "
                 "long before every step when nothing comes)")


# --- RequestOutputCollector -------------------------------------------------------------------------------------------


def delta(*samples: tuple, finished: bool = False, cached: int = 0) -> RequestOutput:
    """A DELTA output: samples given as (index, text, token_ids[, finish_reason[, logprobs, cumulative]])."""
    outputs = []
    for index, text, token_ids, *rest in samples:
        reason = rest[0] if rest else None
        logprobs, cumulative = (rest[1], rest[2]) if len(rest) > 1 else (None, None)
        outputs.append(CompletionOutput(index, text, list(token_ids), reason, None, cumulative, logprobs))
    return RequestOutput("r", "a prompt", [1, 2, 3], outputs, finished, cached)


def completions(output: RequestOutput) -> list[tuple]:
    return [(c.index, c.text, c.token_ids, c.finish_reason) for c in output.outputs]


async def get_within(collector, seconds: float):
    """`collector.get()`, or the string "waiting" if it has not returned after `seconds`."""
    try:
        return await asyncio.wait_for(collector.get(), seconds)
    except asyncio.TimeoutError:
        return "waiting"


COLLECTOR_GET = dict(what="your RequestOutputCollector.get", timeout=2.0,
                     likely="the event is set but never cleared, so `get` goes round its loop without ever waiting "
                     "(clear it before waiting again, or when the output is taken)")


@pytest.mark.exercise("RequestOutputCollector")
def test_collector_get_waits_for_a_put(impl):
    inputs = "a collector: get() before any put, then put(' Once')"

    async def scenario():
        with exercising("RequestOutputCollector", inputs):
            collector = impl.RequestOutputCollector(asyncio.get_running_loop())
            early = await get_within(collector, 0.1)
            asyncio.get_running_loop().call_later(0.05, collector.put, delta((0, " Once", [11])))
            late = await get_within(collector, 2.0)
        return early, late

    early, late = run(scenario(), **COLLECTOR_GET)
    expect_equal(early, "waiting", inputs=f"{inputs}; get() with nothing put")
    expect_equal(completions(late) if late != "waiting" else late, [(0, " Once", [11], None)],
                 inputs=f"{inputs}; get() after the put")


@pytest.mark.exercise("RequestOutputCollector")
def test_collector_merges_outputs_its_reader_has_not_taken(impl):
    inputs = "three puts (' Once' [11], ' upon' [12], ' a' [13]) before one get, then a second get"

    async def scenario():
        with exercising("RequestOutputCollector", inputs):
            collector = impl.RequestOutputCollector(asyncio.get_running_loop())
            for text, token in ((" Once", 11), (" upon", 12), (" a", 13)):
                collector.put(delta((0, text, [token])))
            first = await get_within(collector, 2.0)
            second = await get_within(collector, 0.1)
        return first, second

    first, second = run(scenario(), **COLLECTOR_GET)
    expect_equal(completions(first) if first != "waiting" else first, [(0, " Once upon a", [11, 12, 13], None)],
                 inputs=f"{inputs}; the first get (one merged output: nothing lost, nothing queued without bound)")
    expect_equal(second, "waiting", inputs=f"{inputs}; the second get (the output was taken)")


@pytest.mark.exercise("RequestOutputCollector")
def test_collector_hands_out_outputs_before_an_error(impl):
    inputs = "put(' Once'), then put_error(RuntimeError('engine died')); two gets"

    async def scenario():
        with exercising("RequestOutputCollector", inputs):
            collector = impl.RequestOutputCollector(asyncio.get_running_loop())
            collector.put(delta((0, " Once", [11])))
            collector.put_error(RuntimeError("engine died"))
            first = await get_within(collector, 2.0)
            try:
                second = await get_within(collector, 2.0)
            except RuntimeError as error:
                second = f"raised {error}"
        return first, second

    first, second = run(scenario(), **COLLECTOR_GET)
    expect_equal(completions(first) if isinstance(first, RequestOutput) else first, [(0, " Once", [11], None)],
                 inputs=f"{inputs}; the first get (the output that arrived before the error)")
    expect_equal(second, "raised engine died", inputs=f"{inputs}; the second get")


@pytest.mark.exercise("RequestOutputCollector")
def test_collector_waits_again_once_its_output_was_taken(impl):
    inputs = "put(' Once'), get, then a get with nothing pending, and put(' upon') 0.05 s later"

    async def scenario():
        with exercising("RequestOutputCollector", inputs):
            collector = impl.RequestOutputCollector(asyncio.get_running_loop())
            collector.put(delta((0, " Once", [11])))
            first = await get_within(collector, 2.0)
            asyncio.get_running_loop().call_later(0.05, collector.put, delta((0, " upon", [12])))
            second = await get_within(collector, 2.0)
        return [completions(o) if isinstance(o, RequestOutput) else o for o in (first, second)]

    expect_equal(run(scenario(), **COLLECTOR_GET), [[(0, " Once", [11], None)], [(0, " upon", [12], None)]],
                 inputs=f"{inputs}; the two gets (the second must wait for the put, then return it)")


@pytest.mark.exercise("RequestOutputCollector")
def test_collector_merges_parallel_samples_by_index_with_their_logprobs(impl):
    inputs = ("n=2, logprobs on: put sample 1 'b' [21], then samples 0 'a' [11] and 1 'c' [22] (a step's output lists "
              "only the samples that moved), then sample 0 'x' [12] finished, before one get")
    lp = {11: [{11: Logprob(-0.5, 1)}], 12: [{12: Logprob(-0.25, 1)}], 21: [{21: Logprob(-1.0, 1)}],
          22: [{22: Logprob(-2.0, 1)}]}

    async def scenario():
        with exercising("RequestOutputCollector", inputs):
            collector = impl.RequestOutputCollector(asyncio.get_running_loop())
            collector.put(delta((1, "b", [21], None, lp[21], -1.0)))
            collector.put(delta((0, "a", [11], None, lp[11], -0.5), (1, "c", [22], None, lp[22], -3.0)))
            collector.put(delta((0, "x", [12], FinishReason.LENGTH, lp[12], -0.75)))
            return await get_within(collector, 2.0)

    merged = run(scenario(), **COLLECTOR_GET)
    expect_equal(completions(merged) if isinstance(merged, RequestOutput) else merged,
                 [(0, "ax", [11, 12], FinishReason.LENGTH), (1, "bc", [21, 22], None)],
                 inputs=f"{inputs}; the samples of the one output get returns (merge_delta folds them by index)")
    expect_equal([[list(entry) for entry in c.logprobs] for c in merged.outputs], [[[11], [12]], [[21], [22]]],
                 inputs=f"{inputs}; each sample's logprobs, one entry per token")


@pytest.mark.exercise("RequestOutputCollector")
def test_collector_wakes_a_waiting_reader_when_the_error_comes(impl):
    inputs = "get() waiting with nothing put; put_error(RuntimeError('engine died')) 0.05 s later"

    async def scenario():
        with exercising("RequestOutputCollector", inputs):
            collector = impl.RequestOutputCollector(asyncio.get_running_loop())
            asyncio.get_running_loop().call_later(0.05, collector.put_error, RuntimeError("engine died"))
            try:
                return await get_within(collector, 2.0)
            except RuntimeError as error:
                return f"raised {error}"

    got = run(scenario(), **COLLECTOR_GET)
    expect_equal(got if isinstance(got, str) else f"returned {got}", "raised engine died",
                 inputs=f"{inputs}; what the waiting get did within 2 s (put_error must wake it, as put does, and get "
                 "must stop waiting when an error is there, not only when an output is)")


@pytest.mark.exercise("RequestOutputCollector")
def test_collector_keeps_a_finished_output_when_an_abort_crosses_it(impl):
    inputs = ("put(' Once' [11]), put(' upon' [12], finish_reason length, finished=True), then an abort's output "
              "(finish_reason abort, finished=True: it crossed the request's last output) before one get")

    async def scenario():
        with exercising("RequestOutputCollector", inputs):
            collector = impl.RequestOutputCollector(asyncio.get_running_loop())
            collector.put(delta((0, " Once", [11])))
            collector.put(delta((0, " upon", [12], FinishReason.LENGTH), finished=True))
            collector.put(delta((0, "", [], FinishReason.ABORT), finished=True))
            return await get_within(collector, 2.0)

    got = run(scenario(), **COLLECTOR_GET)
    expect_equal((completions(got), got.finished) if isinstance(got, RequestOutput) else got,
                 ([(0, " Once upon", [11, 12], FinishReason.LENGTH)], True),
                 inputs=f"{inputs}; (samples, finished) of the output get returns (the request had finished: its "
                 "last output stands, and an output put after a finished one is dropped, not merged)")


# --- generate ------------------------------------------------------------------------------------------------------

LONG = SamplingParams(max_tokens=200, **GREEDY)  # long enough that finishing it would show in the counters


@contextmanager
def tiny_async_llm():
    """A real `AsyncLLM` on the tiny model, its engine core (the reference loop) in a thread of this process."""
    config = EngineArgs(model=str(tiny_checkpoint("llama-gqa")), block_size=4, num_kv_blocks=128, max_num_seqs=8,
                        max_model_len=256).create_engine_config()
    llm = async_llm.AsyncLLM(config, Executor.get_class(config), engine_core="thread")
    try:
        yield llm
    finally:
        llm.shutdown()


def generated_tokens(llm) -> float:
    """The front end's `vllm:generation_tokens` counter: tokens of the requests it still delivers."""
    return sum(sample.value for metric in llm.stat_logger.registry.collect() for sample in metric.samples
               if sample.name == "vllm:generation_tokens_total")


async def until_idle(llm, seconds: float = 20.0) -> None:
    """Wait until the core has no unfinished request (an aborted one leaves before the core's next step)."""
    deadline = time.monotonic() + seconds
    while llm.engine_core.has_unfinished_requests() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


AFTER_FINISHED_SECONDS = 2.0  # for a stream to end once its finished output is out


async def read_all(stream) -> list[RequestOutput]:
    """Every output of `stream`; an ExerciseError if it does not end within seconds of its finished output."""
    outputs: list[RequestOutput] = []
    while True:
        ended = bool(outputs) and outputs[-1].finished
        try:
            outputs.append(await asyncio.wait_for(anext(stream), AFTER_FINISHED_SECONDS if ended else 20.0))
        except StopAsyncIteration:
            return outputs
        except TimeoutError:
            if not ended:
                raise
            raise ExerciseError(hang_message("your generate, after the output with finished=True",
                                             AFTER_FINISHED_SECONDS, GENERATE_ENDS["likely"])) from None


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [token for output in outputs for token in output.outputs[0].token_ids]


GENERATE_ENDS = dict(what="your generate", likely="the loop does not stop after the output with finished=True, so "
                     "it waits on the collector for an output that never comes")


@pytest.mark.exercise("generate")
def test_generate_streams_until_the_finished_output(impl):
    prompts = {"a": [5, 6, 7], "b": list(range(20, 31))}
    inputs = "two requests at once (3- and 11-token prompts, 6 greedy tokens each), each read to its end"

    async def scenario():
        with tiny_async_llm() as llm, exercising("generate", inputs):
            params = SamplingParams(max_tokens=6, **GREEDY)
            return await asyncio.gather(*(read_all(impl.generate(llm, p, params, r)) for r, p in prompts.items()))

    streams = run(scenario(), **GENERATE_ENDS, timeout=30)
    for (request_id, prompt), outputs in zip(prompts.items(), streams, strict=True):
        expect_equal(tokens_of(outputs), offline(prompt, 6),
                     inputs=f"{inputs}; the tokens request {request_id!r} streamed (oracle: LLM.generate)")
        expect_equal([o.finished for o in outputs], [False] * (len(outputs) - 1) + [True],
                     inputs=f"{inputs}; `finished` of each output request {request_id!r} streamed")


@pytest.mark.exercise("generate")
def test_generate_aborts_when_the_caller_closes_the_stream(impl):
    inputs = f"a greedy request of {LONG.max_tokens} tokens; the caller reads one output and closes the stream"

    async def scenario():
        with tiny_async_llm() as llm, exercising("generate", inputs):
            stream = impl.generate(llm, list(range(10, 20)), LONG, "closed")
            await anext(stream)
            await stream.aclose()  # what leaving an `async for` early does, and what a server does on disconnect
            await until_idle(llm)
            return generated_tokens(llm)

    generated = run(scenario(), what="your generate", timeout=40,
                    likely="the request is not aborted, so the core runs it to its end")
    expect_equal(generated < LONG.max_tokens / 2, True,
                 inputs=f"{inputs}; tokens generated ({generated:.0f}): the request must be aborted (in the "
                 "`finally` of generate: closing the stream raises GeneratorExit at its `yield`)")


@pytest.mark.exercise("generate")
def test_generate_aborts_when_the_callers_task_is_cancelled(impl):
    inputs = (f"a greedy request of {LONG.max_tokens} tokens read by a task; the task is cancelled after its first "
              "output (what a server does when the client goes away)")

    async def scenario():
        with tiny_async_llm() as llm, exercising("generate", inputs):
            started = asyncio.Event()

            async def consume():
                async for _ in impl.generate(llm, list(range(10, 20)), LONG, "cancelled"):
                    started.set()

            task = asyncio.create_task(consume())
            waiter = asyncio.ensure_future(started.wait())
            await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if task.done():
                task.result()  # the stream failed before its first output: that error is the answer
                return "the stream ended before its first output", generated_tokens(llm)
            task.cancel()
            outcome = "cancelled"
            try:
                await task
                outcome = "the task ended normally"
            except asyncio.CancelledError:
                pass
            await until_idle(llm)
            return outcome, generated_tokens(llm)

    outcome, generated = run(scenario(), what="your generate", timeout=40,
                             likely="the request is not aborted, so the core runs it to its end")
    expect_equal(outcome, "cancelled", inputs=f"{inputs}; how the cancelled task ended (let CancelledError through)")
    expect_equal(generated < LONG.max_tokens / 2, True,
                 inputs=f"{inputs}; tokens generated ({generated:.0f}): the request must be aborted (CancelledError "
                 "arrives at the `await` on the collector; a `finally` sees it)")


@pytest.mark.exercise("generate")
def test_generate_cancelled_mid_stream_aborts_and_frees_the_request_id(impl):
    inputs = (f"a greedy request 'mid' of {LONG.max_tokens} tokens read by a task; the task is cancelled after its "
              "third output; then a new request of 6 greedy tokens under the same id 'mid'")

    async def scenario():
        with tiny_async_llm() as llm, exercising("generate", inputs):
            seen, third = [], asyncio.Event()

            async def consume():
                async for output in impl.generate(llm, list(range(10, 20)), LONG, "mid"):
                    seen.append(output)
                    if len(seen) == 3:
                        third.set()

            task = asyncio.create_task(consume())
            waiter = asyncio.ensure_future(third.wait())
            await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if task.done():
                task.result()  # the stream failed before its third output: that error is the answer
                return f"the stream ended after {len(seen)} outputs", generated_tokens(llm), "not tried"
            task.cancel()
            outcome = "cancelled"
            try:
                await task
                outcome = "the task ended normally"
            except asyncio.CancelledError:
                pass
            await until_idle(llm)
            generated = generated_tokens(llm)
            try:
                again = tokens_of(await read_all(impl.generate(llm, [5, 6, 7], SamplingParams(max_tokens=6, **GREEDY),
                                                               "mid")))
            except ValueError as error:
                again = f"ValueError: {error}"
            return outcome, generated, again

    outcome, generated, again = run(scenario(), **GENERATE_ENDS, timeout=40)
    expect_equal(outcome, "cancelled", inputs=f"{inputs}; how the cancelled task ended (abort, then let "
                 "CancelledError through: a task that ends normally looks like a complete answer)")
    expect_equal(generated < LONG.max_tokens / 2, True,
                 inputs=f"{inputs}; tokens generated ({generated:.0f}): the request must be aborted (await "
                 "llm.abort(request_id) in the `finally`)")
    expect_equal(again, offline([5, 6, 7], 6),
                 inputs=f"{inputs}; the new request's tokens (oracle: LLM.generate): the abort must go through "
                 "llm.abort, which also makes the front end forget the request, so its id is free again")


@pytest.mark.exercise("generate")
def test_generate_never_aborts_a_finished_request(impl):
    inputs = ("request 'r' (4 tokens) read up to its finished output and left there (the stream is not exhausted); "
              f"a new request with the same id 'r' ({LONG.max_tokens} tokens, long enough to be running when the "
              "old stream closes) starts; then the old stream is closed")

    async def scenario():
        with tiny_async_llm() as llm, exercising("generate", inputs):
            old = impl.generate(llm, [5, 6, 7], SamplingParams(max_tokens=4, **GREEDY), "r")
            async for output in old:
                if output.finished:
                    break  # the caller has everything; the generator is still suspended at its `yield`
            new = impl.generate(llm, list(range(20, 31)), LONG, "r")
            first = await anext(new)
            await old.aclose()  # the old request is finished: nothing may be aborted now
            rest = await read_all(new)
            return [first, *rest]

    outputs = run(scenario(), **GENERATE_ENDS, timeout=30)
    expected = offline(list(range(20, 31)), LONG.max_tokens), FinishReason.LENGTH
    expect_equal((tokens_of(outputs), outputs[-1].outputs[0].finish_reason), expected,
                 inputs=f"{inputs}; the new request's tokens and finish reason (an abort sent for the finished "
                 "request would hit the new one: abort only a request that has not finished)")


@pytest.mark.exercise("generate")
def test_generate_refuses_a_duplicate_id_without_touching_the_first(impl):
    inputs = "request 'dup' (16 tokens) streaming; a second request with the id 'dup' is submitted meanwhile"

    async def scenario():
        with tiny_async_llm() as llm, exercising("generate", inputs):
            first = impl.generate(llm, list(range(20, 31)), SamplingParams(max_tokens=16, **GREEDY), "dup")
            outputs = [await anext(first)]
            try:
                await read_all(impl.generate(llm, [5, 6, 7], SamplingParams(max_tokens=4, **GREEDY), "dup"))
                refused = "accepted"
            except ValueError as error:
                refused = "ValueError" if "request_id" in str(error) else f"ValueError: {error}"
            outputs += await read_all(first)
            return refused, outputs

    refused, outputs = run(scenario(), **GENERATE_ENDS, timeout=30)
    expect_equal(refused, "ValueError", inputs=f"{inputs}; the second request (refused by add_request, naming the id)")
    expect_equal((tokens_of(outputs), outputs[-1].outputs[0].finish_reason),
                 (offline(list(range(20, 31)), 16), FinishReason.LENGTH),
                 inputs=f"{inputs}; the first request's tokens and finish reason (a refused submit has nothing to "
                 "abort: start the `try` after add_request, or the first request's abort is sent in its name)")


@pytest.mark.exercise("generate")
def test_generate_raises_engine_dead_when_the_core_dies(impl):
    inputs = (f"a greedy request of {LONG.max_tokens} tokens streaming; then a request whose prompt holds a token "
              "outside the vocabulary reaches the core directly (past the front end's checks), so the next step "
              "raises and the core dies; then a new request")

    async def scenario():
        with tiny_async_llm() as llm, exercising("generate", inputs):
            stream = impl.generate(llm, list(range(10, 20)), LONG, "victim")
            await anext(stream)
            vocab = llm.vllm_config.model_config.vocab_size
            llm.engine_core.add_request(core.EngineCoreRequest("poison", [vocab + 5], LONG, 0))
            try:
                await read_all(stream)
                during = "the stream ended without an error"
            except async_llm.EngineDeadError:
                during = "EngineDeadError"
            try:
                await read_all(impl.generate(llm, [5, 6, 7], SamplingParams(max_tokens=4, **GREEDY), "later"))
                after = "served"
            except async_llm.EngineDeadError:
                after = "EngineDeadError"
            return during, after

    during, after = run(scenario(), what="your generate", timeout=30,
                        likely="the stream does not end when the core dies (EngineDeadError swallowed)")
    expect_equal(during, "EngineDeadError", inputs=f"{inputs}; what the waiting caller got (let the collector's "
                 "EngineDeadError through: a stream that just stops looks like a finished answer)")
    expect_equal(after, "EngineDeadError", inputs=f"{inputs}; what the request after the death got")


# --- until_disconnected --------------------------------------------------------------------------------------------


class Connection:
    """An ASGI `receive` channel as a server hands it to an app: the messages a client's connection produces."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue = asyncio.Queue()

    async def receive(self) -> dict:
        return await self.messages.get()

    def send_body_chunk(self) -> None:
        self.messages.put_nowait({"type": "http.request", "body": b"", "more_body": False})

    def disconnect(self) -> None:
        self.messages.put_nowait({"type": "http.disconnect"})


UNTIL = dict(what="your until_disconnected", likely="the work is awaited to its end although the client left, or the "
             "watcher is awaited after the work finished")


async def slow_work(seconds: float, log: list) -> str:
    try:
        await asyncio.sleep(seconds)
        log.append("done")
        return "the response"
    except asyncio.CancelledError:
        log.append("cancelled")
        raise


@pytest.mark.exercise("until_disconnected")
def test_until_disconnected_returns_the_work_when_the_client_stays(impl):
    inputs = "work that takes 0.05 s; the client stays connected"

    async def scenario():
        log, connection, before = [], Connection(), asyncio.all_tasks()
        result = await impl.until_disconnected(connection.receive, slow_work(0.05, log))
        await asyncio.sleep(0.02)  # a cancelled task finishes at its next turn
        left = [t for t in asyncio.all_tasks() - before if not t.done()]
        return result, log, len(left)

    result, log, left = run(scenario(), **UNTIL)
    expect_equal((result, log), ("the response", ["done"]), inputs=f"{inputs}; (result, what the work did)")
    expect_equal(left, 0, inputs=f"{inputs}; tasks still running afterwards (the watcher must be cancelled)")


@pytest.mark.exercise("until_disconnected")
def test_until_disconnected_cancels_the_work_when_the_client_leaves(impl):
    inputs = "work that would take 5 s; the client disconnects after 0.05 s"

    async def scenario():
        log, connection = [], Connection()
        asyncio.get_running_loop().call_later(0.05, connection.disconnect)
        start = time.monotonic()
        try:
            outcome = await impl.until_disconnected(connection.receive, slow_work(5.0, log))
        except serving_engine.ClientDisconnected:
            outcome = "ClientDisconnected"
        return outcome, list(log), time.monotonic() - start

    outcome, log, seconds = run(scenario(), **UNTIL)
    expect_equal(outcome, "ClientDisconnected", inputs=f"{inputs}; what until_disconnected returned or raised")
    expect_equal(log, ["cancelled"], inputs=f"{inputs}; what the work did by the time until_disconnected returned")
    expect_equal(seconds < 2.0, True, inputs=f"{inputs}; returned after {seconds:.2f} s (the disconnect was at 0.05 s)")


@pytest.mark.exercise("until_disconnected")
def test_until_disconnected_ignores_other_messages(impl):
    inputs = "work that takes 0.2 s; the connection delivers a body chunk (http.request) first, no disconnect"

    async def scenario():
        log, connection = [], Connection()
        connection.send_body_chunk()
        try:
            result = await impl.until_disconnected(connection.receive, slow_work(0.2, log))
        except serving_engine.ClientDisconnected:
            result = "ClientDisconnected"
        return result, log

    expect_equal(run(scenario(), **UNTIL), ("the response", ["done"]), inputs=f"{inputs}; (result, what the work did)")


@pytest.mark.exercise("until_disconnected")
def test_until_disconnected_passes_the_works_error_on(impl):
    inputs = "work that raises ValueError('bad prompt'); the client stays"

    async def failing():
        await asyncio.sleep(0.01)
        raise ValueError("bad prompt")

    async def scenario():
        before = asyncio.all_tasks()
        try:
            await impl.until_disconnected(Connection().receive, failing())
            outcome = "returned"
        except ValueError as error:
            outcome = f"ValueError: {error}"
        except serving_engine.ClientDisconnected:
            outcome = "ClientDisconnected"
        await asyncio.sleep(0.02)  # a cancelled task finishes at its next turn
        return outcome, len([t for t in asyncio.all_tasks() - before if not t.done()])

    outcome, left = run(scenario(), **UNTIL)
    expect_equal(outcome, "ValueError: bad prompt", inputs=f"{inputs}; what until_disconnected raised")
    expect_equal(left, 0, inputs=f"{inputs}; tasks still running afterwards (the watcher must be cancelled however "
                 "the work ends, its error included: a `finally`)")


@pytest.mark.exercise("until_disconnected")
def test_until_disconnected_cancels_the_work_when_its_own_caller_is_cancelled(impl):
    inputs = ("work that would take 5 s; the client stays, but the task awaiting until_disconnected is cancelled "
              "after 0.05 s (the server shutting down)")

    async def scenario():
        log, connection, before = [], Connection(), asyncio.all_tasks()
        caller = asyncio.ensure_future(impl.until_disconnected(connection.receive, slow_work(5.0, log)))
        await asyncio.sleep(0.05)
        caller.cancel()
        try:
            await caller
            outcome = "returned"
        except asyncio.CancelledError:
            outcome = "cancelled"
        except serving_engine.ClientDisconnected:
            outcome = "ClientDisconnected"
        what_the_work_did = list(log)
        await asyncio.sleep(0.02)  # a cancelled task finishes at its next turn
        return outcome, what_the_work_did, len([t for t in asyncio.all_tasks() - before if not t.done()])

    outcome, log, left = run(scenario(), **UNTIL)
    expect_equal((outcome, log), ("cancelled", ["cancelled"]), inputs=f"{inputs}; (how the caller's task ended, "
                 "what the work did by then): cancelling the caller must cancel the work too, and wait for it "
                 "(cancel in a `finally`), or the request the work iterates is never aborted")
    expect_equal(left, 0, inputs=f"{inputs}; tasks still running afterwards (the work and the watcher)")


# --- capstone: a live server on SmolLM2, on all of your pieces -----------------------------------------------------

CAPSTONE_TOKENS = 12
CAPSTONE_STREAMED = [0, 1, 2, 3, 4, 5]  # indices into CAPSTONE_PROMPTS, streamed at once
CAPSTONE_WHOLE = 6  # answered as one response (the server merges its outputs)
CAPSTONE_ENGINE = dict(max_model_len=512, max_num_seqs=16, num_kv_blocks=256, block_size=16)
LONG_PROMPT = 1  # a short prompt ("Once upon a time"): room for LONG_TOKENS in max_model_len
LONG_TOKENS = 480  # the requests whose clients leave, long enough that finishing them would show in the counters


def metric(base_url: str, name: str) -> float:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{")]
    return sum(values)


async def capstone_clients(base_url: str) -> dict:
    """Six streamed greedy requests, one whole one and one whole request whose client hangs up, at once; then,
    alone, a streamed request whose client hangs up mid-stream."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", max_retries=0, timeout=20)
    greedy = dict(model="smollm2-135m", temperature=0.0, max_tokens=CAPSTONE_TOKENS, extra_body={"ignore_eos": True})

    async def streamed(i: int) -> str:
        text = ""
        async for chunk in await client.completions.create(prompt=CAPSTONE_PROMPTS[i], stream=True, **greedy):
            if chunk.choices:
                text += chunk.choices[0].text
        return text

    async def whole(i: int) -> str:
        return (await client.completions.create(prompt=CAPSTONE_PROMPTS[i], **greedy)).choices[0].text

    async def leaves_mid_stream() -> None:
        stream = await client.completions.create(prompt=CAPSTONE_PROMPTS[LONG_PROMPT], stream=True,
                                                 model="smollm2-135m", max_tokens=LONG_TOKENS,
                                                 extra_body={"ignore_eos": True})
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.close()

    async def leaves_before_the_answer() -> None:
        impatient = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", max_retries=0, timeout=0.5)
        try:
            await impatient.completions.create(prompt=CAPSTONE_PROMPTS[LONG_PROMPT], model="smollm2-135m",
                                               max_tokens=LONG_TOKENS, extra_body={"ignore_eos": True})
        except openai.APITimeoutError:
            pass
        await impatient.close()

    results = await asyncio.gather(*(streamed(i) for i in CAPSTONE_STREAMED), whole(CAPSTONE_WHOLE),
                                   leaves_before_the_answer())
    await leaves_mid_stream()  # alone, last: after its abort the core is idle, and only its idle report says so
    await client.close()
    return dict(streamed=results[: len(CAPSTONE_STREAMED)], whole=results[len(CAPSTONE_STREAMED)])


@pytest.mark.exercise("capstone")
@pytest.mark.timeout(240)
def test_capstone_a_live_server_on_your_pieces_serves_hugging_faces_tokens(impl):
    from solutions.entrypoints.openai.api_server import serve_in_background

    _, tokenizer = smollm2()
    inputs = (f"a live server (SmolLM2-135M, engine core in a thread, {CAPSTONE_ENGINE}); streamed greedy completions "
              f"of CAPSTONE_PROMPTS {CAPSTONE_STREAMED} and a whole one of prompt {CAPSTONE_WHOLE}, {CAPSTONE_TOKENS} "
              f"tokens each, at once; two clients of {LONG_TOKENS}-token requests hang up (one mid-stream, one "
              "before its whole response)")
    with swap_in(impl, REFERENCE):  # your loop, collector, generate and disconnect handling, in the server
        with serve_in_background("smollm2-135m", engine_core="thread", **CAPSTONE_ENGINE) as server:
            results = run(capstone_clients(server.base_url), timeout=180, what="the capstone's clients",
                          likely="a stream that never ends (generate or the collector), or a core loop that stopped")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (metric(server.base_url, "vllm:num_requests_running") > 0
                                                    or metric(server.base_url, "vllm:kv_cache_usage_perc") > 0):
                time.sleep(0.2)
            running = metric(server.base_url, "vllm:num_requests_running")
            usage = metric(server.base_url, "vllm:kv_cache_usage_perc")
            generated = metric(server.base_url, "vllm:generation_tokens_total")
    for text, i in zip(results["streamed"], CAPSTONE_STREAMED, strict=True):
        want = tokenizer.decode(smollm2_greedy(i, CAPSTONE_TOKENS), skip_special_tokens=True)
        expect_equal(text, want, inputs=f"{inputs}; streamed text of prompt {i} (oracle: Hugging Face greedy, decoded)")
    want = tokenizer.decode(smollm2_greedy(CAPSTONE_WHOLE, CAPSTONE_TOKENS), skip_special_tokens=True)
    expect_equal(results["whole"], want, inputs=f"{inputs}; whole response of prompt {CAPSTONE_WHOLE}")
    expect_equal((running, usage), (0.0, 0.0), inputs=f"{inputs}; (running requests, KV cache usage) 10 s after the "
                 "clients hung up: their requests must be aborted and their blocks freed")
    served = CAPSTONE_TOKENS * (len(CAPSTONE_STREAMED) + 1)
    expect_equal(generated < served + LONG_TOKENS, True, inputs=f"{inputs}; tokens generated ({generated:.0f}): the "
                 f"two requests whose clients left must stop long before their {LONG_TOKENS} tokens")

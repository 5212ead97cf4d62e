"""Grading tests for chapter 07 — serving.

Each test grades one exercise (`@pytest.mark.exercise`). The oracles are independent of the code under test: the
offline `LLM.generate` of the same requests (for the engine core loop), outputs and timelines written out by hand
(for merging, the collector and the metrics), what an ASGI server really sends (for disconnects), and Hugging
Face's greedy tokens (for the capstone, a live server on SmolLM2).
"""

import asyncio
import functools
import queue
import threading
import time
import urllib.request

import pytest

from grading import exercising, expect_equal
from grading.capstone import CAPSTONE_PROMPTS, smollm2, smollm2_greedy, swap_in
from grading.tiny_models import tiny_checkpoint
from benchmarks import serving as serving_benchmark
from solutions import LLM, SamplingParams
from solutions.engine import async_llm, core
from solutions.engine.arg_utils import EngineArgs
from solutions.entrypoints.openai import serving_engine
from solutions.executor.abstract import Executor
from solutions.outputs import CompletionOutput, FinishReason, Logprob, RequestOutput

REFERENCE = {
    "run_busy_loop": core.run_busy_loop,
    "merge_delta": async_llm.merge_delta,
    "RequestOutputCollector": async_llm.RequestOutputCollector,
    "until_disconnected": serving_engine.until_disconnected,
    "serving_metrics": serving_benchmark.serving_metrics,
}

pytestmark = pytest.mark.timeout(60)


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

    def __init__(self, impl, messages=(), parent_alive=lambda: True) -> None:
        self.core = tiny_core()
        self.input_queue, self.output_queue = queue.Queue(), queue.Queue()
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
        self.thread.join(timeout)
        self.check(inputs)
        if self.thread.is_alive():
            raise AssertionError(f"on input {inputs}: run_busy_loop did not return within {timeout} s of SHUTDOWN")


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
def test_run_busy_loop_blocks_while_idle(impl):
    inputs = "no request for half a second"
    loop = LoopUnderTest(impl)
    time.sleep(0.1)
    cpu = time.process_time()
    time.sleep(0.5)
    cpu = time.process_time() - cpu
    loop.stop(inputs)
    expect_equal(cpu < 0.2, True, inputs=f"{inputs}; the process used {cpu:.2f} s of CPU in 0.5 s: an idle loop must "
                 "wait on the input queue (get with a timeout), not poll it")


@pytest.mark.exercise("run_busy_loop")
def test_run_busy_loop_returns_when_the_front_end_is_gone(impl):
    inputs = ("idle, and parent_alive() turns False (the idle wait is at most "
              f"IDLE_POLL_SECONDS={core.IDLE_POLL_SECONDS})")
    gone = threading.Event()
    loop = LoopUnderTest(impl, parent_alive=lambda: not gone.is_set())
    time.sleep(0.1)
    gone.set()
    loop.thread.join(4 * core.IDLE_POLL_SECONDS + 1)
    loop.check(inputs)
    expect_equal(loop.thread.is_alive(), False, inputs=f"{inputs}; the loop still runs with no front end to serve")


# --- merge_delta ---------------------------------------------------------------------------------------------------


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


@pytest.mark.exercise("merge_delta")
def test_merge_delta_concatenates_one_sample(impl):
    inputs = "pending: ' Once' [11]; new: ' upon a' [12, 13], finished with 'length'"
    new = delta((0, " upon a", [12, 13], FinishReason.LENGTH), finished=True)
    merged = impl.merge_delta(delta((0, " Once", [11])), new)
    expect_equal(completions(merged), [(0, " Once upon a", [11, 12, 13], FinishReason.LENGTH)],
                 inputs=f"{inputs}; samples")
    expect_equal(merged.finished, True, inputs=f"{inputs}; finished (the newer output's)")


@pytest.mark.exercise("merge_delta")
def test_merge_delta_matches_samples_by_index(impl):
    inputs = "n=3: pending has samples 2 and 0; new has samples 0 and 1 (a sample moves only when it has a token)"
    pending = delta((2, "c", [3]), (0, "a", [1]))
    merged = impl.merge_delta(pending, delta((0, "A", [10]), (1, "B", [20], FinishReason.STOP)))
    expect_equal(completions(merged),
                 [(0, "aA", [1, 10], None), (1, "B", [20], FinishReason.STOP), (2, "c", [3], None)],
                 inputs=f"{inputs}; samples, by index")


@pytest.mark.exercise("merge_delta")
def test_merge_delta_keeps_every_logprob(impl):
    first = [{11: Logprob(-0.5, 1)}]
    second = [{12: Logprob(-0.25, 1)}, {13: Logprob(-1.0, 2)}]
    inputs = "logprobs: pending has one token's, new has two (cumulative -0.5, then -1.75)"
    new = delta((0, "yz", [12, 13], None, second, -1.75), cached=2)
    merged = impl.merge_delta(delta((0, "x", [11], None, first, -0.5)), new)
    sample = merged.outputs[0]
    expect_equal([list(entry) for entry in sample.logprobs], [[11], [12], [13]], inputs=f"{inputs}; logprobs per token")
    expect_equal(sample.cumulative_logprob, -1.75, inputs=f"{inputs}; cumulative_logprob (the newer output's)")
    expect_equal(merged.num_cached_tokens, 2, inputs=f"{inputs}; num_cached_tokens (the newer output's)")


# --- RequestOutputCollector ----------------------------------------------------------------------------------------


def run(coroutine, timeout: float = 10.0):
    """`asyncio.run` in a thread of its own: `check()` runs these tests inside a notebook, whose event loop is
    already running in this thread."""
    result: dict = {}

    def target() -> None:
        try:
            result["value"] = asyncio.run(asyncio.wait_for(coroutine, timeout))
        except BaseException as error:  # re-raised in the caller's thread
            result["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


async def get_within(collector, seconds: float):
    """`collector.get()`, or the string "waiting" if it has not returned after `seconds`."""
    try:
        return await asyncio.wait_for(collector.get(), seconds)
    except asyncio.TimeoutError:
        return "waiting"


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

    early, late = run(scenario())
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

    first, second = run(scenario())
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

    first, second = run(scenario())
    expect_equal(completions(first) if isinstance(first, RequestOutput) else first, [(0, " Once", [11], None)],
                 inputs=f"{inputs}; the first get (the output that arrived before the error)")
    expect_equal(second, "raised engine died", inputs=f"{inputs}; the second get")


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

    result, log, left = run(scenario())
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

    outcome, log, seconds = run(scenario())
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

    expect_equal(run(scenario()), ("the response", ["done"]), inputs=f"{inputs}; (result, what the work did)")


@pytest.mark.exercise("until_disconnected")
def test_until_disconnected_passes_the_works_error_on(impl):
    inputs = "work that raises ValueError('bad prompt'); the client stays"

    async def failing():
        await asyncio.sleep(0.01)
        raise ValueError("bad prompt")

    async def scenario():
        try:
            await impl.until_disconnected(Connection().receive, failing())
        except ValueError as error:
            return f"ValueError: {error}"
        except serving_engine.ClientDisconnected:
            return "ClientDisconnected"
        return "returned"

    expect_equal(run(scenario()), "ValueError: bad prompt", inputs=f"{inputs}; what until_disconnected raised")


# --- serving_metrics -----------------------------------------------------------------------------------------------

Timeline = serving_benchmark.RequestTimeline


def hand_made_timelines() -> list:
    """Two streamed requests and a failed one (seconds):
    A: sent 0.0, chunks at 0.5, 0.6, 0.8, ends 0.8, 3 tokens → TTFT 0.5, TPOT (0.8-0.5)/2 = 0.15, ITLs 0.1, 0.2, e2e 0.8
    B: sent 1.0, chunks at 1.2, 2.0,      ends 2.0, 2 tokens → TTFT 0.2, TPOT (1.0-0.2)/1 = 0.8,  ITL 0.8,      e2e 1.0
    C: sent 1.5, failed at 1.6."""
    return [
        Timeline(sent=0.0, chunk_times=[0.5, 0.6, 0.8], end=0.8, output_tokens=3),
        Timeline(sent=1.0, chunk_times=[1.2, 2.0], end=2.0, output_tokens=2),
        Timeline(sent=1.5, end=1.6, error="the stream carried no tokens"),
    ]


def rounded(stats: dict) -> dict:
    return {key: round(value, 6) for key, value in stats.items()}


@pytest.mark.exercise("serving_metrics")
def test_serving_metrics_latencies(impl):
    inputs = "hand-made timelines (see hand_made_timelines): A and B completed, C failed; duration 2.0 s"
    metrics = impl.serving_metrics(hand_made_timelines(), 2.0)
    expect_equal(rounded(metrics["ttft_s"]), {"mean": 0.35, "p50": 0.35, "p99": 0.497}, inputs=f"{inputs}; ttft_s")
    expect_equal(rounded(metrics["tpot_s"]), {"mean": 0.475, "p50": 0.475, "p99": 0.7935}, inputs=f"{inputs}; tpot_s")
    expect_equal(rounded(metrics["e2e_s"]), {"mean": 0.9, "p50": 0.9, "p99": 0.998}, inputs=f"{inputs}; e2e_s")


@pytest.mark.exercise("serving_metrics")
def test_serving_metrics_inter_token_latencies_are_gaps_between_chunks(impl):
    inputs = "hand-made timelines: ITLs 0.1, 0.2 (A) and 0.8 (B)"
    metrics = impl.serving_metrics(hand_made_timelines(), 2.0)
    expect_equal(rounded(metrics["itl_s"]), {"mean": 0.366667, "p50": 0.2, "p99": 0.788}, inputs=f"{inputs}; itl_s")


@pytest.mark.exercise("serving_metrics")
def test_serving_metrics_counts_and_throughput(impl):
    inputs = "hand-made timelines: 2 completed (5 output tokens), 1 failed, duration 2.0 s"
    metrics = impl.serving_metrics(hand_made_timelines(), 2.0)
    got = {k: round(metrics[k], 6) for k in ("completed", "failed", "request_throughput", "output_throughput")}
    expect_equal(got, {"completed": 2, "failed": 1, "request_throughput": 1.0, "output_throughput": 2.5}, inputs=inputs)
    expect_equal(round(metrics["normalized_latency_s_per_token"], 6), round((0.8 / 3 + 1.0 / 2) / 2, 6),
                 inputs=f"{inputs}; normalized_latency_s_per_token (mean of e2e / output tokens)")


@pytest.mark.exercise("serving_metrics")
def test_serving_metrics_skips_tpot_for_a_one_token_request(impl):
    inputs = "A from hand_made_timelines and D: sent 0, one chunk at 0.3, 1 token"
    timelines = [hand_made_timelines()[0], Timeline(sent=0.0, chunk_times=[0.3], end=0.3, output_tokens=1)]
    metrics = impl.serving_metrics(timelines, 1.0)
    expect_equal(rounded(metrics["tpot_s"]), {"mean": 0.15, "p50": 0.15, "p99": 0.15},
                 inputs=f"{inputs}; tpot_s (a single token has no time per output token after the first)")


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

    async def streamed(i: int):
        timeline = serving_benchmark.RequestTimeline(sent=time.perf_counter())
        text = ""
        async for chunk in await client.completions.create(prompt=CAPSTONE_PROMPTS[i], stream=True,
                                                           stream_options={"include_usage": True}, **greedy):
            if chunk.choices:
                timeline.chunk_times.append(time.perf_counter())
                text += chunk.choices[0].text
            if chunk.usage is not None:
                timeline.output_tokens = chunk.usage.completion_tokens
        timeline.end = time.perf_counter()
        return text, timeline

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
    with swap_in(impl, REFERENCE) as mine:  # your loop, merge, collector and disconnect handling, in the server
        with serve_in_background("smollm2-135m", engine_core="thread", **CAPSTONE_ENGINE) as server:
            results = run(capstone_clients(server.base_url), timeout=180)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (metric(server.base_url, "vllm:num_requests_running") > 0
                                                    or metric(server.base_url, "vllm:kv_cache_usage_perc") > 0):
                time.sleep(0.2)
            running = metric(server.base_url, "vllm:num_requests_running")
            usage = metric(server.base_url, "vllm:kv_cache_usage_perc")
            generated = metric(server.base_url, "vllm:generation_tokens_total")
        timelines = [timeline for _, timeline in results["streamed"]]
        metrics = mine.serving_metrics(timelines, max(t.end for t in timelines) - min(t.sent for t in timelines))
    for (text, _), i in zip(results["streamed"], CAPSTONE_STREAMED, strict=True):
        want = tokenizer.decode(smollm2_greedy(i, CAPSTONE_TOKENS), skip_special_tokens=True)
        expect_equal(text, want, inputs=f"{inputs}; streamed text of prompt {i} (oracle: Hugging Face greedy, decoded)")
    want = tokenizer.decode(smollm2_greedy(CAPSTONE_WHOLE, CAPSTONE_TOKENS), skip_special_tokens=True)
    expect_equal(results["whole"], want, inputs=f"{inputs}; whole response of prompt {CAPSTONE_WHOLE}")
    expect_equal((running, usage), (0.0, 0.0), inputs=f"{inputs}; (running requests, KV cache usage) 10 s after the "
                 "clients hung up: their requests must be aborted and their blocks freed")
    served = CAPSTONE_TOKENS * (len(CAPSTONE_STREAMED) + 1)
    expect_equal(generated < served + LONG_TOKENS, True, inputs=f"{inputs}; tokens generated ({generated:.0f}): the "
                 f"two requests whose clients left must stop long before their {LONG_TOKENS} tokens")
    ttft = sorted(t.chunk_times[0] - t.sent for t in timelines)
    tpot = sorted((t.end - t.chunk_times[0]) / (t.output_tokens - 1) for t in timelines)
    expect_equal((metrics["completed"], round(metrics["ttft_s"]["p50"], 9), round(metrics["tpot_s"]["p50"], 9)),
                 (len(timelines), round((ttft[2] + ttft[3]) / 2, 9), round((tpot[2] + tpot[3]) / 2, 9)),
                 inputs=f"{inputs}; your serving_metrics on the six streamed timelines: (completed, TTFT p50, "
                 "TPOT p50)")

"""`AsyncLLM` over a real engine core, in a process and in a thread: greedy streams equal `LLM.generate`'s,
concurrent callers, DELTA outputs, abort when a caller leaves (blocks back to zero), bad requests refused without
disturbing the others, a dead core reaching every waiting caller, and a clean shutdown."""

import asyncio
import multiprocessing
import os
import signal
import time

import pytest

from grading.tiny_models import tiny_checkpoint
from solutions import LLM, FinishReason, SamplingParams
from solutions.engine.arg_utils import AsyncEngineArgs, engine_args_from_kwargs
from solutions.engine.async_llm import AsyncLLM, EngineDeadError
from solutions.exceptions import ParameterError

MODEL = str(tiny_checkpoint("llama-gqa"))  # vocab 256, no tokenizer: prompts are token ids
ENGINE_ARGS = dict(block_size=4, max_model_len=512, max_num_seqs=16, seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)  # still running when its caller leaves
PROMPTS = [[(7 * i + j) % 256 for j in range(3 + 5 * i)] for i in range(16)]  # 3 to 78 tokens
TIMEOUT = 20.0  # seconds for any one scenario: nothing may hang


@pytest.fixture(scope="module")
def oracle() -> list[list[int]]:
    """`LLM.generate`'s greedy tokens for PROMPTS, with the same engine options."""
    outputs = LLM(MODEL, **ENGINE_ARGS).generate(PROMPTS, GREEDY, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


@pytest.fixture(scope="module", params=["process", "thread"])
def llm(request):
    with start(request.param) as engine:
        yield engine


def start(engine_core: str) -> AsyncLLM:
    return AsyncLLM.from_engine_args(AsyncEngineArgs(model=MODEL, engine_core=engine_core, **ENGINE_ARGS))


def run(coroutine):
    async def with_timeout():
        async with asyncio.timeout(TIMEOUT):
            return await coroutine

    return asyncio.run(with_timeout())


async def collect(llm: AsyncLLM, prompt: list[int], params: SamplingParams, request_id: str):
    return [output async for output in llm.generate(prompt, params, request_id)]


def metric(llm: AsyncLLM, name: str) -> float:
    return llm.stat_logger.registry.get_sample_value(name, {"model_name": MODEL})


def wait_for_idle_engine(llm: AsyncLLM) -> None:
    """Poll the gauges (the core reports between steps too) until nothing runs and no block is used."""
    deadline = time.monotonic() + 5.0
    while metric(llm, "vllm:num_requests_running") or metric(llm, "vllm:kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "the aborted request still holds blocks"
        time.sleep(0.02)


def test_engine_options_are_checked_before_anything_starts():
    with pytest.raises(ParameterError, match="engine_core must be one of \\('process', 'thread'\\)") as refused:
        AsyncEngineArgs(model=MODEL, engine_core="fork")
    assert refused.value.parameter == "engine_core"
    with pytest.raises(ParameterError, match="unknown engine options \\['max_seqs'\\]") as refused:
        engine_args_from_kwargs(AsyncEngineArgs, dict(model=MODEL, max_seqs=4))
    assert refused.value.parameter == "max_seqs"
    with pytest.raises(TypeError, match="max_seqs"):
        AsyncEngineArgs(model=MODEL, max_seqs=4)


def test_greedy_streams_equal_llm_generate_and_deltas_concatenate(llm, oracle):
    async def main():
        return await asyncio.gather(*(collect(llm, PROMPTS[i], GREEDY, f"greedy-{i}") for i in range(4)))

    for i, outputs in enumerate(run(main())):
        assert [output.finished for output in outputs] == [False] * (len(outputs) - 1) + [True]
        tokens = [t for output in outputs for t in output.outputs[0].token_ids]
        assert tokens == oracle[i]  # each DELTA carries only new tokens, so they concatenate to the completion
        assert outputs[-1].outputs[0].finish_reason is FinishReason.LENGTH
        assert outputs[-1].prompt_token_ids == PROMPTS[i]


def test_sixteen_concurrent_requests_all_finish_and_are_counted(llm, oracle):
    before = {name: metric(llm, name) for name in (
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count")}

    async def main():
        return await asyncio.gather(*(collect(llm, p, GREEDY, f"many-{i}") for i, p in enumerate(PROMPTS)))

    results = run(main())
    assert [[t for o in outputs for t in o.outputs[0].token_ids] for outputs in results] == oracle
    assert metric(llm, "vllm:prompt_tokens_total") - before["vllm:prompt_tokens_total"] == sum(map(len, PROMPTS))
    generated = metric(llm, "vllm:generation_tokens_total") - before["vllm:generation_tokens_total"]
    assert generated == len(PROMPTS) * GREEDY.max_tokens
    ttft = "vllm:time_to_first_token_seconds_count"
    assert metric(llm, ttft) - before[ttft] == len(PROMPTS)
    wait_for_idle_engine(llm)


def test_closing_the_generator_aborts_the_request_and_frees_its_blocks(llm, oracle):
    async def main():
        stream = llm.generate(PROMPTS[5], LONG, "closed")
        await anext(stream)
        await anext(stream)
        assert metric(llm, "vllm:kv_cache_usage_perc") > 0  # step k's output comes after step k's stats
        await stream.aclose()

    run(main())
    wait_for_idle_engine(llm)
    assert run(collect(llm, PROMPTS[0], GREEDY, "closed"))[-1].finished  # the id is free again


def test_cancelling_the_callers_task_aborts_the_request(llm):
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in llm.generate(PROMPTS[6], LONG, "cancelled"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()  # what a server does when the client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    wait_for_idle_engine(llm)


def test_abort_from_outside_ends_the_stream_with_finish_reason_abort(llm):
    async def main():
        stream = llm.generate(PROMPTS[7], LONG, "aborted")
        await anext(stream)
        await llm.abort("aborted")
        await llm.abort("never-existed")  # unknown ids are ignored
        return [output async for output in stream]

    rest = run(main())
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason is FinishReason.ABORT
    assert sum(len(o.outputs[0].token_ids) for o in rest) < LONG.max_tokens
    wait_for_idle_engine(llm)


def test_bad_requests_raise_value_error_and_the_others_still_finish(llm, oracle):
    async def main():
        good = [asyncio.create_task(collect(llm, PROMPTS[i], GREEDY, f"good-{i}")) for i in range(3)]
        refusals = []  # each a ParameterError (a ValueError) naming its field, for the server's `param`
        with pytest.raises(ParameterError, match="prompt_token_ids") as refused:
            await collect(llm, [1, 2, 999], GREEDY, "bad-token")
        refusals.append(refused.value.parameter)
        with pytest.raises(ParameterError, match="max_model_len=512") as refused:
            await collect(llm, [1] * 600, GREEDY, "too-long")
        refusals.append(refused.value.parameter)
        in_flight = llm.generate(PROMPTS[3], LONG, "in-flight")
        await anext(in_flight)
        with pytest.raises(ParameterError, match="already in use") as refused:
            await collect(llm, PROMPTS[0], GREEDY, "in-flight")
        refusals.append(refused.value.parameter)
        await in_flight.aclose()
        with pytest.raises(ParameterError, match="priority") as refused:
            await anext(llm.generate(PROMPTS[0], GREEDY, "prioritised", priority=1))
        refusals.append(refused.value.parameter)
        assert refusals == ["prompt", "prompt", "request_id", "priority"]
        return await asyncio.gather(*good)

    results = run(main())
    assert [[t for o in outputs for t in o.outputs[0].token_ids] for outputs in results] == oracle[:3]


def test_a_killed_core_process_reaches_every_waiting_caller():
    engine = start("process")

    async def main():
        streams = [engine.generate(PROMPTS[i], LONG, f"doomed-{i}") for i in range(3)]
        for stream in streams:
            await anext(stream)
        os.kill(engine.engine_core.process.pid, signal.SIGKILL)
        start = time.monotonic()
        for stream in streams:
            with pytest.raises(EngineDeadError, match="died without a word"):
                async for _ in stream:
                    pass
        assert time.monotonic() - start < 5.0
        with pytest.raises(EngineDeadError):  # later calls fail at once
            await anext(engine.generate(PROMPTS[0], GREEDY, "after"))
        with pytest.raises(EngineDeadError):
            await engine.check_health()

    try:
        run(main())
        assert engine.errored
    finally:
        engine.shutdown()


def test_an_exception_in_step_is_fatal_and_carries_its_traceback():
    engine = start("thread")
    engine.engine_core.model_executor.model_runner = None  # the next forward pass raises AttributeError

    async def main():
        with pytest.raises(EngineDeadError, match="AttributeError"):
            await collect(engine, PROMPTS[0], GREEDY, "crash")

    try:
        run(main())
        assert engine.errored and not engine.engine_core.thread.is_alive()
    finally:
        engine.shutdown()


def test_shutdown_leaves_no_live_child_process():
    with start("process") as engine:
        assert run(collect(engine, PROMPTS[0], GREEDY, "last"))[-1].finished
        process = engine.engine_core.process
        assert process.is_alive()
    assert not process.is_alive() and process.exitcode == 0
    assert process not in multiprocessing.active_children()
    engine.shutdown()  # idempotent
    with pytest.raises(EngineDeadError, match="shut down"):
        run(collect(engine, PROMPTS[0], GREEDY, "too-late"))

"""What both endpoints share: the model check, the prompt's limits, the engine's errors by field, the client
going away, and streaming over server-sent events.

A request's life in the server: the body is parsed into a pydantic request (a bad type or a missing field is a
400 naming it); the prompt is tokenised here, so `max_tokens` can default to the room left in the context (a
larger `max_tokens` is a 400, in vLLM's words); the request becomes `SamplingParams` (a bad value is a 400 naming
the request's field); `AsyncLLM.generate` streams DELTA outputs (what the front end times for the latency
metrics), which the endpoint forwards as SSE chunks (`stream: true`) or merges into one response. A list of
prompts is one engine request each, all checked before any is queued, their outputs merged as they come
(`merge_outputs`); the engine's refusal of one aborts the others. The engine names a request by the id this server
gave it, which the client never saw: `without_request_id` drops it.

One request never holds up the others: what can take long (rendering the chat template, tokenising) runs in a
worker thread, and the body itself is capped (api_server.py). A client that goes away must not keep its blocks:
a streamed response is cancelled by Starlette on `http.disconnect` (`ClosingStreamingResponse`), a whole one
races the work against the disconnect (`until_disconnected`); both close `AsyncLLM.generate`, which aborts it.

Where this lives in vLLM: `vllm/entrypoints/openai/engine/serving.py` (`OpenAIServing`) and
`vllm/entrypoints/utils.py` (`with_cancellation`, `listen_for_disconnect`).
"""

import asyncio
import dataclasses
import functools
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from http import HTTPStatus
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from solutions.engine.async_llm import AsyncLLM, EngineDeadError, merge_delta
from solutions.exceptions import ParameterError
from solutions.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, RequestError, SamplingFields, UsageInfo
from solutions.outputs import CompletionOutput, Logprob, RequestOutput
from solutions.sampling_params import SamplingParams

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready; the request has been aborted."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client closes the connection: ASGI's `receive` (the request's message channel; the body
    has been read, so the next message is that) gives `{"type": "http.disconnect"}`."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, unless the client disconnects first (`receive`, the request's ASGI channel, says so): then
    cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # cancelling the task that iterates `generate` aborts the request in the engine
            await asyncio.wait((task,))
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that closes its event generator and the engine's outputs when it ends, however it
    ends: finished, or cancelled because the client disconnected — so the request is aborted now, not whenever
    the generators are garbage-collected. (`outputs` is closed on its own too: a generator cancelled before its
    first item never runs its `finally`.)"""

    def __init__(self, events: AsyncGenerator[str, None], outputs: AsyncGenerator[RequestOutput, None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.outputs = outputs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.outputs.aclose()


def sse_event(payload: BaseModel | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {payload if isinstance(payload, str) else payload.model_dump_json()}\n\n"


SSE_DONE = sse_event("[DONE]")  # OpenAI's end-of-stream marker


async def sse_events(
    firsts: Sequence[RequestOutput], outputs: AsyncIterator[tuple[int, RequestOutput]],
    events: Callable[[int, RequestOutput, UsageInfo | None], list[str]], usage_event: Callable[[UsageInfo], str] | None,
    continuous_usage: bool = False, opening: Sequence[str] = (),
) -> AsyncGenerator[str, None]:
    """A streamed response's events: `opening`, then `events(i, output, usage)` for each prompt's first output
    (`firsts[i]`) and every later `(i, output)`, then (if asked) `usage_event(usage)` with the counts summed over
    the prompts, then `data: [DONE]`. Each endpoint says how one output looks; `usage` is prompt i's token counts
    so far with `continuous_usage` (vLLM's `continuous_usage_stats`), else None."""
    for event in opening:
        yield event
    num_prompt = [len(first.prompt_token_ids) for first in firsts]
    num_generated = [0] * len(firsts)

    def output_events(i: int, output: RequestOutput) -> list[str]:
        num_generated[i] += sum(len(completion.token_ids) for completion in output.outputs)
        return events(i, output, usage_of(num_prompt[i], num_generated[i]) if continuous_usage else None)

    for i, first in enumerate(firsts):
        for event in output_events(i, first):
            yield event
    async for i, output in outputs:
        for event in output_events(i, output):
            yield event
    if usage_event is not None:
        yield usage_event(usage_of(sum(num_prompt), sum(num_generated)))
    yield SSE_DONE


async def merge_outputs(
    generators: Sequence[AsyncGenerator[RequestOutput, None]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """The outputs of several requests as they come, each as `(index in generators, output)` (vLLM's
    `merge_async_iterators`). Closing this closes them all, which aborts those still running; an error from one
    ends it (and so, closed, all of them)."""
    if len(generators) == 1:  # one prompt: no tasks between the client and the engine's outputs
        try:
            async for output in generators[0]:
                yield 0, output
        finally:
            await generators[0].aclose()
        return
    pending = {asyncio.ensure_future(anext(generator)): i for i, generator in enumerate(generators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue  # request i has finished
                pending[asyncio.ensure_future(anext(generators[i]))] = i
                yield i, output
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)  # a generator being advanced cannot be closed
        for generator in generators:
            await generator.aclose()


async def engine_errors_as_events(events: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    """`events`, but if the engine dies mid-stream (the 200 is already sent) the error goes out as a last event."""
    try:
        async for event in events:
            yield event
    except EngineDeadError as error:
        yield sse_event(error_response(f"the engine died: {error}", HTTPStatus.INTERNAL_SERVER_ERROR))
        yield SSE_DONE
    finally:
        await events.aclose()


def without_request_id(message: str, request_id: str) -> str:
    """An engine message as the client reads it: the engine names the request by the id this server made up for it
    ("prompt of request 'cmpl-…' has…"), which means nothing to the client; the message is about its request."""
    return message.replace(f" of request {request_id!r}", "").replace(f"request {request_id!r}", "the request")


def usage_of(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
    total = num_prompt_tokens + num_completion_tokens
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens, total_tokens=total)


def finish_reason_of(completion: CompletionOutput) -> str | None:
    return None if completion.finish_reason is None else completion.finish_reason.value


def token_text(logprob: Logprob, token_id: int) -> str:
    """A token as logprobs show it: its text, or `token_id:<id>` (vLLM's form) when there is no tokenizer."""
    return f"token_id:{token_id}" if logprob.decoded_token is None else logprob.decoded_token


ERROR_TYPES = {  # the exception OpenAI's client raises for each status
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


def error_response(message: str, status: HTTPStatus, param: str | None = None) -> ErrorResponse:
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""
    error_type = ERROR_TYPES.get(status, "APIError")
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=status))


class OpenAIServing(ABC):
    """The endpoints' common steps, around one `AsyncLLM`. A subclass says how its outputs look: `response`
    (a whole one) and `stream_events` (SSE chunks); `prompt_field` names the request field the prompt came from
    ("prompt", or "messages" for chat), for error messages; `request_id_prefix` is OpenAI's ("cmpl", "chatcmpl").
    """

    prompt_field: str
    request_id_prefix: str

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len

    def check_model(self, request: SamplingFields) -> None:
        """An unknown `model` is a 404, as OpenAI answers; no `model` means the one this server serves."""
        if request.model is not None and request.model != self.model_name:
            raise RequestError(f"The model `{request.model}` does not exist; this server serves `{self.model_name}`",
                               param="model", status=HTTPStatus.NOT_FOUND)

    async def prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        """The prompt as token ids, tokenised as `LLM.generate` does, in a worker thread; a text too long to fit
        is refused without tokenising it (`Processor.tokenize`). Token ids are checked by the processor later."""
        if not isinstance(prompt, str):
            vocab_size = self.engine.processor.vocab_size
            if (bad := next((t for t in prompt if not 0 <= t < vocab_size), None)) is not None:
                raise RequestError(f"{self.prompt_field}: token id {bad} is out of vocabulary (this model's token ids "
                                   f"lie in [0, {vocab_size}))", self.prompt_field)
            return prompt
        if self.tokenizer is None:
            raise RequestError(f"{self.prompt_field} must be token ids: this model has no tokenizer", self.prompt_field)
        try:
            return await asyncio.to_thread(self.engine.processor.tokenize, prompt)
        except ParameterError as error:
            renamed = self.prompt_field != error.parameter
            raise RequestError(f"{self.prompt_field}: {error}" if renamed else str(error), self.prompt_field) from error

    def sampling_params(self, request: SamplingFields, prompt_token_ids: list[int]) -> SamplingParams:
        """The request's sampling parameters; an absent max_tokens fills the context (the processor refuses a
        prompt that leaves no room). A max_tokens that would run past `max_model_len` is refused, as vLLM's
        server refuses it, rather than cut short: the prompt has n tokens, so at most `max_model_len - n` fit."""
        num_prompt_tokens, max_tokens = len(prompt_token_ids), request.requested_max_tokens()
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is not None and 0 < room < max_tokens:  # no room at all: the prompt is what is too long
            raise RequestError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
                f"length is {self.max_model_len} tokens and your request has {num_prompt_tokens} input tokens "
                f"({max_tokens} > {self.max_model_len} - {num_prompt_tokens}).",
                param=request.request_field("max_tokens"),
            )
        return request.to_sampling_params(default_max_tokens=max(1, room))

    async def outputs(
        self, request: SamplingFields, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """`AsyncLLM.generate`, with the engine's ValueError (raised before anything is queued) as a RequestError
        naming the request's field; closing this generator closes `generate`, which aborts the request."""
        generator = self.engine.generate(prompt_token_ids, params, request_id)
        try:
            async for output in generator:
                yield output
        except ParameterError as error:  # the engine's field, mapped onto this request's
            param = self.prompt_field if error.parameter == "prompt" else request.request_field(error.parameter)
            # The message names the request's field too: prefixed where the engine calls it otherwise (chat's
            # "messages" for the prompt, "max_completion_tokens"; "StructuredOutputsParams.json" for any of them).
            renamed = param != error.parameter or error.parameter == "structured_outputs"
            message = without_request_id(str(error), request_id)
            raise RequestError(f"{param}: {message}" if renamed else message, param=param) from error
        except ValueError as error:  # the engine core refused it (a safety net: the processor checks first)
            raise RequestError(without_request_id(str(error), request_id)) from error
        finally:
            await generator.aclose()

    async def generate_response(
        self, request: SamplingFields, prompts: Sequence[str | list[int]], raw_request: Request
    ) -> Response:
        """Run the request's prompts through the engine, one engine request each, and answer: SSE chunks if it
        asked to stream, else one JSON. Every prompt is tokenised and its parameters checked before any reaches
        the engine; if the engine refuses one, the others are aborted. A prompt given as text is the `prompt` of
        its first (or merged) output (as vLLM's)."""
        prompt_token_ids = [await self.prompt_token_ids(prompt) for prompt in prompts]
        params = [self.sampling_params(request, token_ids) for token_ids in prompt_token_ids]
        request_id, created = f"{self.request_id_prefix}-{uuid.uuid4().hex}", int(time.time())
        # one prompt: the request's id; several: vLLM's `<id>-<prompt index>`
        engine_ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        generators = [
            self.outputs(request, token_ids, one_params, engine_id)
            for token_ids, one_params, engine_id in zip(prompt_token_ids, params, engine_ids, strict=True)
        ]
        texts = [prompt if isinstance(prompt, str) else None for prompt in prompts]
        if request.stream:
            firsts = await self.first_outputs(generators, raw_request)
            firsts = [dataclasses.replace(first, prompt=text) for first, text in zip(firsts, texts, strict=True)]
            outputs = merge_outputs(generators)
            events = self.stream_events(request, request_id, created, firsts, outputs)
            return ClosingStreamingResponse(engine_errors_as_events(events), outputs)
        finals = await self.all_outputs(generators, raw_request)
        finals = [dataclasses.replace(final, prompt=text) for final, text in zip(finals, texts, strict=True)]
        return JSONResponse(self.response(request, request_id, created, finals).model_dump(mode="json"))

    @abstractmethod
    def response(
        self, request: SamplingFields, request_id: str, created: int, finals: list[RequestOutput]
    ) -> BaseModel:
        """The whole response, from each prompt's merged outputs."""

    @abstractmethod
    def stream_events(
        self, request: SamplingFields, request_id: str, created: int, firsts: list[RequestOutput],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncGenerator[str, None]:
        """The SSE events for each prompt's first output and every later `(prompt index, output)`, then (if
        asked) usage, then `[DONE]`."""

    async def first_outputs(
        self, generators: Sequence[AsyncGenerator[RequestOutput, None]], raw_request: Request
    ) -> list[RequestOutput]:
        """Wait for a streamed request's first output of every prompt before answering 200, so a request the
        engine refuses still gets its 400 (and the prompts it accepted, their abort; a client that leaves
        meanwhile, its abort)."""

        async def firsts() -> list[RequestOutput]:
            results = await asyncio.gather(*(anext(generator) for generator in generators), return_exceptions=True)
            if (error := next((r for r in results if isinstance(r, BaseException)), None)) is not None:
                raise error
            return results

        try:
            return await until_disconnected(raw_request.receive, firsts())
        except BaseException:
            for generator in generators:
                await generator.aclose()
            raise

    async def all_outputs(
        self, generators: Sequence[AsyncGenerator[RequestOutput, None]], raw_request: Request
    ) -> list[RequestOutput]:
        """A whole response's outputs, merged per prompt; all aborted if the engine refuses one of them or the
        client disconnects first."""

        async def collect(generator: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
            return functools.reduce(merge_delta, [output async for output in generator])

        async def collect_all() -> list[RequestOutput]:
            tasks = [asyncio.ensure_future(collect(generator)) for generator in generators]
            try:
                return list(await asyncio.gather(*tasks))
            finally:  # one failed (or all are cancelled): stop the others before their generators are closed
                for task in tasks:
                    task.cancel()
                await asyncio.wait(tasks)

        try:
            return await until_disconnected(raw_request.receive, collect_all())
        finally:
            for generator in generators:
                await generator.aclose()

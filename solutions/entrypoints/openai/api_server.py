"""The FastAPI app in front of an `AsyncLLM`, and ways to run it: `run_server` (the command line's) and
`serve_in_background` (a live server on a free port for tests and benchmarks).

    POST /v1/completions        serving_completion.py     GET /v1/models   the one model served
    POST /v1/chat/completions   serving_chat.py           GET /health      200, or 503 once the engine is dead
    POST /tokenize, /detokenize serving_tokenization.py   GET /metrics     Prometheus text (solutions/metrics/)

One event loop serves every client: a handler only awaits, and the forward passes run in the engine core's own
process or thread. A request body over `MAX_REQUEST_BODY_BYTES` is refused before it is read (by its
Content-Length) or as soon as it passes the limit. Every refusal has OpenAI's error shape: 400 for a bad request
(pydantic's 422 included, the failing field as `param`), 404 for an unknown model, 413 for a body too large, 500
if the engine died.

Where this lives in vLLM: `vllm/entrypoints/openai/api_server.py` (`build_app`, `run_server`).
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from solutions.engine.arg_utils import AsyncEngineArgs, engine_args_from_kwargs
from solutions.engine.async_llm import AsyncLLM, EngineDeadError
from solutions.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ModelCard, ModelList, RequestError, TokenizeRequest,
)
from solutions.entrypoints.openai.serving_chat import OpenAIServingChat
from solutions.entrypoints.openai.serving_completion import OpenAIServingCompletion
from solutions.entrypoints.openai.serving_engine import ClientDisconnected, error_response
from solutions.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from solutions.model.loader import DEFAULT_MODEL

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client left first": logged, never seen by anyone
# The largest request body read. A prompt of max_model_len tokens is at most max_model_len × 81 characters
# (Processor.tokenize's bound), a few MB even for long contexts and JSON's escapes; vLLM sets no limit.
MAX_REQUEST_BODY_BYTES = 32 * 2**20


def error_json(message: str, status: HTTPStatus, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_response(message, status, param).model_dump(), status_code=status)


def validation_error_json(error: RequestValidationError) -> JSONResponse:
    """Pydantic's refusal as OpenAI's 400: `param` is the top-level field, the message says what was wrong."""
    problems, param = [], None
    for problem in error.errors():
        if problem["type"] == "json_invalid":  # its location is a character position, not a field
            return error_json(f"the request body is not valid JSON: {problem['ctx']['error']}", HTTPStatus.BAD_REQUEST)
        location = [str(part) for part in problem["loc"][1:]] if problem["loc"][:1] == ("body",) else []
        if param is None:
            param = location[0] if location else None
        elif location[:1] != [param]:
            continue  # report the first field only, with all its problems (each branch of a union has one)
        # a validator's ValueError reads "Value error, <message>": keep the message
        message = str(problem["ctx"]["error"]) if problem["type"] == "value_error" else problem["msg"]
        problems.append(f"{'.'.join(location) or 'request body'}: {message}")
    return error_json("; ".join(problems), HTTPStatus.BAD_REQUEST, param)


class RequestBodyLimit:
    """ASGI middleware: a 413 for a request body over `max_bytes`, at once if its Content-Length says so (the body
    is not read), else as soon as the bytes read pass the limit (a chunked body). (Starlette's own limit answers
    in plain text; this answers in OpenAI's error shape.)"""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def too_large(self) -> HTTPException:
        message = f"the request body is larger than this server's limit of {self.max_bytes} bytes"
        return HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, message)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await error_json(self.too_large().detail, HTTPStatus.REQUEST_ENTITY_TOO_LARGE)(scope, receive, send)
            return
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise self.too_large()  # FastAPI re-raises it from the body's parsing: on_http_error answers
            return message

        await self.app(scope, receive_within_limit, send)


def build_app(engine: AsyncLLM, max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="paged-attention-from-scratch: OpenAI-compatible server")
    app.add_middleware(RequestBodyLimit, max_bytes=max_request_body_bytes)
    completions, chat = OpenAIServingCompletion(engine), OpenAIServingChat(engine)
    tokenization = OpenAIServingTokenization(engine)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> Response:
        return JSONResponse((await tokenization.tokenize(request)).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Response:
        return JSONResponse((await tokenization.detokenize(request)).model_dump())

    @app.get("/v1/models")
    async def show_models() -> Response:
        models = ModelList(data=[ModelCard(id=engine.model_name, max_model_len=engine.max_model_len)])
        return JSONResponse(models.model_dump())

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except EngineDeadError as error:
            return error_json(f"the engine is dead: {error}", HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=HTTPStatus.OK)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.stat_logger.render(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error_json(error)

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, error: RequestError) -> JSONResponse:
        return error_json(str(error), error.status, error.param)

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return error_json(f"the engine died: {error}", HTTPStatus.INTERNAL_SERVER_ERROR)

    @app.exception_handler(ClientDisconnected)
    async def on_client_disconnected(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(HTTPException)
    async def on_http_error(_: Request, error: HTTPException) -> JSONResponse:
        return error_json(str(error.detail), HTTPStatus(error.status_code))

    return app


def run_server(
    engine_args: AsyncEngineArgs, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> None:
    """Serve until SIGINT or SIGTERM (uvicorn finishes the open requests), then shut the engine core down."""
    with AsyncLLM.from_engine_args(engine_args) as engine:
        uvicorn.run(build_app(engine), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


# ---- a server in the background, for tests and benchmarks ----


def _free_socket(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock


def wait_until_healthy(base_url: str, timeout: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Poll `/health` until it answers 200; RuntimeError if `alive()` turns False or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the server at {base_url} stopped before it became healthy")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{base_url}/health", timeout=1) as response:
                if response.status == HTTPStatus.OK:
                    return
        time.sleep(0.05)
    raise RuntimeError(f"the server at {base_url} was not healthy after {timeout:.0f} s")


@dataclass
class BackgroundServer:
    """A running server: `base_url` ("http://127.0.0.1:PORT"; the OpenAI client wants `base_url + "/v1"`),
    `engine` (the `AsyncLLM`, in a thread server only) and `stop()`."""

    base_url: str
    stop: Callable[[], None]
    engine: AsyncLLM | None = None


@contextlib.contextmanager
def serve_in_background(
    model: str = DEFAULT_MODEL, *, host: str = "127.0.0.1", engine_core: str = "process",
    in_subprocess: bool = False, startup_timeout: float = 300.0, **llm_kwargs: Any,
) -> Iterator[BackgroundServer]:
    """Start a server on a free port of `host`, wait until `/health` is OK, yield it, stop it on exit.

    By default uvicorn runs in a thread of this process, with its own event loop (the engine core in its own
    process, or a thread: `engine_core`). `in_subprocess=True` runs `python -m solutions.serve` instead, so
    the server's event loop does not share this process's interpreter lock with the clients — what a load
    benchmark wants. `llm_kwargs` are the engine's options (`EngineArgs` fields).
    """
    engine_args = engine_args_from_kwargs(AsyncEngineArgs, dict(llm_kwargs, model=model, engine_core=engine_core))
    serve = _serve_in_subprocess if in_subprocess else _serve_in_thread
    with serve(engine_args, host, startup_timeout) as server:
        yield server


@contextlib.contextmanager
def _serve_in_thread(engine_args: AsyncEngineArgs, host: str, startup_timeout: float) -> Iterator[BackgroundServer]:
    with AsyncLLM.from_engine_args(engine_args) as engine:
        sock = _free_socket(host)
        config = uvicorn.Config(build_app(engine), log_level="warning", timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), name="api-server", daemon=True)
        thread.start()

        def stop() -> None:
            server.should_exit = True
            thread.join(timeout=30)
            sock.close()

        base_url = f"http://{host}:{sock.getsockname()[1]}"
        try:
            try:
                wait_until_healthy(base_url, startup_timeout, alive=lambda: thread.is_alive() and not engine.errored)
            except RuntimeError:
                engine.raise_if_dead()  # the core died while starting: say why
                raise
            yield BackgroundServer(base_url, stop, engine)
        finally:
            stop()


@contextlib.contextmanager
def _serve_in_subprocess(engine_args: AsyncEngineArgs, host: str, startup_timeout: float) -> Iterator[BackgroundServer]:
    with _free_socket(host) as sock:  # a port free now; released just before the server binds it
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "solutions.serve", "--host", host, "--port", str(port), "--log-level", "warning",
               *engine_args.to_cli_args()]
    process = subprocess.Popen(command, env=dict(os.environ, HF_HUB_OFFLINE="1"))

    def stop() -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # as Ctrl-C: uvicorn closes, then the engine core is shut down
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    base_url = f"http://{host}:{port}"
    try:
        wait_until_healthy(base_url, startup_timeout, alive=lambda: process.poll() is None)
        yield BackgroundServer(base_url, stop)
    finally:
        stop()

"""The front end's handle on the engine core, wherever the core runs: `InprocClient` (called directly, as
`LLMEngine` offline does), `MPClient` (its own process) or `ThreadClient` (a thread of this process). They answer
the same verbs, so a front end never knows which it has.

Why a process by default: a thread shares the interpreter lock with the server's event loop, so the core's Python
work (scheduling, batch metadata, sampling, stop checks) and the loop's (JSON, SSE chunks) take turns; only the
matmuls release the lock. A process shares nothing but two queues, at the cost of pickling every message. With
SmolLM2 (fp32, 32 streaming callers, ~64 prompt and 64 output tokens each; `python -m benchmarks.engine_core` on a
2-core AMD EPYC, 2026-11-23) the process served 1.19× the thread's tokens/s (a step: 181 ms against 242 ms).

The child is started with "spawn" (forking a process that has started threads can deadlock the child), so it
builds its own `EngineCoreProc` from the same `VllmConfig` in a top-level function (`run_engine_core`). (vLLM forks
by default, `VLLM_WORKER_MULTIPROC_METHOD`, and spawns once CUDA is initialised.) A child that dies without a word
(killed, out of memory, a segfault) is noticed by `MPClient.get_output`, which checks `process.is_alive()` between
short waits.

Where this lives in vLLM: `vllm/v1/engine/core_client.py` (`EngineCoreClient.make_client`, `MPClient`,
`InprocClient`); vLLM's queues are ZeroMQ sockets with msgpack, ours `multiprocessing` queues with pickle.
"""

import contextlib
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import traceback
import weakref
from abc import ABC, abstractmethod
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from solutions.config import VllmConfig
from solutions.engine import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
from solutions.engine.core import EngineCore, EngineCoreProc, EngineCoreReady, EngineDead, OutputMessage
from solutions.executor.abstract import Executor

if TYPE_CHECKING:  # the front ends hold a client, never the core's parts: these are names for the hints only
    from solutions.beam_search import BeamSearchParams, BeamSearchSequence
    from solutions.core.sched.data_parallel_scheduler import DataParallelScheduler
    from solutions.core.sched.scheduler import Scheduler
    from solutions.structured_output import StructuredOutputManager

STARTUP_TIMEOUT_SECONDS = 300.0  # building the engine: imports, loading weights (the first SmolLM2 load converts it)
POLL_SECONDS = 0.1  # the longest a reader waits before checking that the core is still alive
SHUTDOWN_TIMEOUT_SECONDS = 10.0  # for the core to finish its current step and exit before it is terminated


class EngineCoreClient(ABC):
    """Send requests to the engine core, read its messages back. Where the core runs in this process (`InprocClient`,
    `ThreadClient`), the client also lends its parts — `scheduler`, `model_executor`, `structured_output_manager`,
    `has_unfinished_requests()` — to the tests, the grader, the benchmarks and `python -m solutions` (never to a front
    end): the core's own objects, changed by its thread under `ThreadClient`; `MPClient` raises instead."""

    engine_core: EngineCore | None = None  # the core itself where it runs in this process; None in `MPClient`

    @staticmethod
    def make_client(engine_core: str, vllm_config: VllmConfig, executor_class: type[Executor]) -> "EngineCoreClient":
        """The client for `engine_core`: "inproc" (offline), "process" or "thread" (a server's busy loop)."""
        clients = {"inproc": InprocClient, "process": MPClient, "thread": ThreadClient}
        return clients[engine_core](vllm_config, executor_class)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send((EngineCoreRequestType.ADD, request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send((EngineCoreRequestType.ABORT, list(request_ids)))

    @abstractmethod
    def get_output(self, timeout: float) -> OutputMessage | None:
        """The core's next message, waiting at most `timeout` seconds (None if none came); `EngineDead` once the
        core has stopped, whether it said so or died silently."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the core and release its queues (and process). Idempotent."""

    @abstractmethod
    def _send(self, message: tuple) -> None: ...

    # --- the core's parts, where it runs in this process ----------------------------------------------------------

    @property
    def scheduler(self) -> "Scheduler | DataParallelScheduler":
        """The core's scheduler (and through it `kv_cache_manager`, `requests`, `waiting`, `running`)."""
        return self._core_in_this_process("scheduler").scheduler

    @property
    def model_executor(self) -> Executor:
        """The core's executor (and through it `model_runner`, or `workers` with several ranks or replicas)."""
        return self._core_in_this_process("model_executor").model_executor

    @property
    def structured_output_manager(self) -> "StructuredOutputManager":
        """The core's grammars and their token masks."""
        return self._core_in_this_process("structured_output_manager").structured_output_manager

    def has_unfinished_requests(self) -> bool:
        """Whether the core's scheduler still holds an unfinished request (`LLMEngine`'s answer is its front end's)."""
        return self._core_in_this_process("has_unfinished_requests()").has_unfinished_requests()

    def beam_search(self, prompts: list[list[int]], params: "BeamSearchParams") -> "list[list[BeamSearchSequence]]":
        """The core's beam search over these token-id prompts (it runs outside the scheduler: the core must be idle)."""
        return self._core_in_this_process("beam_search()").beam_search(prompts, params)

    def _core_in_this_process(self, what: str) -> EngineCore:
        if self.engine_core is None:
            raise RuntimeError(
                f"{type(self).__name__}.{what}: the engine core runs in another process, so its parts are not here; "
                'build the engine with engine_core="thread" (or use the offline LLMEngine) to read them'
            )
        return self.engine_core


# --- the core called directly ------------------------------------------------------------------------------------


class InprocClient(EngineCoreClient):
    """The engine core in this process, stepped by the caller: `get_output` runs one step (offline `LLMEngine`)."""

    def __init__(self, vllm_config: VllmConfig, executor_class: type[Executor]) -> None:
        self.engine_core = EngineCore(vllm_config, executor_class)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self, timeout: float = 0.0) -> EngineCoreOutputs:
        return self.engine_core.step()

    def shutdown(self) -> None:
        self.engine_core.shutdown()

    def _send(self, message: tuple) -> None:
        raise RuntimeError("the in-process client calls the engine core directly")

# --- the core in its own process --------------------------------------------------------------------------------


def run_engine_core(
    vllm_config: VllmConfig, executor_class: type[Executor], input_queue: Any, output_queue: Any
) -> None:
    """The child process's entry point: build the engine core, say READY (or why not), run the busy loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the front end decides
    try:
        engine_core = EngineCoreProc(vllm_config, executor_class)
    except Exception as error:  # sent back whole, so the caller sees the ValueError naming its field
        output_queue.put(error if _picklable(error) else RuntimeError(traceback.format_exc()))
        return
    output_queue.put(EngineCoreReady())
    parent = multiprocessing.parent_process()
    engine_core.run_busy_loop(input_queue, output_queue, parent_alive=parent.is_alive)
    # Leave without the interpreter's teardown: the core owns nothing that needs finalising once its last messages
    # are flushed, and unloading torch's modules would add a second or more to every shutdown.
    output_queue.close()
    output_queue.join_thread()
    os._exit(0)


def _picklable(error: BaseException) -> bool:
    try:
        pickle.dumps(error)
    except Exception:
        return False
    return True


def _stop_process(process: BaseProcess, input_queue: Any, output_queue: Any) -> None:
    """Ask the core to exit, then insist; close both queues. Kept outside the client so `weakref.finalize` can
    call it at interpreter exit without keeping the client alive."""
    if process.is_alive():
        input_queue.put((EngineCoreRequestType.SHUTDOWN, None))
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_SECONDS
        while process.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):  # keep reading: an exiting child blocks until its output is read
                output_queue.get(timeout=POLL_SECONDS)
        process.join(POLL_SECONDS)
    if process.is_alive():
        process.terminate()
        process.join(SHUTDOWN_TIMEOUT_SECONDS)
    if process.is_alive():
        process.kill()
        process.join()
    input_queue.cancel_join_thread()  # the reader is gone: do not wait to flush what it will never read
    input_queue.close()
    output_queue.close()


class MPClient(EngineCoreClient):
    """The engine core in a child process (multiprocessing, "spawn"), two `multiprocessing.Queue`s between."""

    def __init__(self, vllm_config: VllmConfig, executor_class: type[Executor]) -> None:
        context = multiprocessing.get_context("spawn")
        self.input_queue, self.output_queue = context.Queue(), context.Queue()
        self.process = context.Process(
            target=run_engine_core, args=(vllm_config, executor_class, self.input_queue, self.output_queue),
            name="EngineCore", daemon=False,  # a daemon may not start processes, and the core starts the executor's
        )  # workers (tensor or data parallelism); the finalizer below stops it when this process exits
        self.process.start()
        self._finalizer = weakref.finalize(self, _stop_process, self.process, self.input_queue, self.output_queue)
        first = self.get_output(STARTUP_TIMEOUT_SECONDS)
        if not isinstance(first, EngineCoreReady):
            self.shutdown()
            if isinstance(first, BaseException):
                raise first
            reason = first.message if isinstance(first, EngineDead) else "no READY message in time"
            raise RuntimeError(f"the engine core process did not start: {reason}")

    def get_output(self, timeout: float) -> OutputMessage | BaseException | None:
        waited = 0.0
        while True:
            try:
                return self.output_queue.get(timeout=max(0.0, min(POLL_SECONDS, timeout - waited)))
            except queue.Empty:
                waited += POLL_SECONDS
            if not self.process.is_alive():
                try:  # it may have said something just before it died
                    return self.output_queue.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    exitcode = self.process.exitcode
                    return EngineDead(f"the engine core process died without a word (exit code {exitcode})")
            if waited >= timeout:
                return None

    def shutdown(self) -> None:
        self._finalizer()

    def _send(self, message: tuple) -> None:
        if self._finalizer.alive:
            self.input_queue.put(message)


# --- the core in a thread of this process ------------------------------------------------------------------------


class ThreadClient(EngineCoreClient):
    """The engine core in a daemon thread of this process, two `queue.Queue`s between (nothing is pickled)."""

    def __init__(self, vllm_config: VllmConfig, executor_class: type[Executor]) -> None:
        self.engine_core = EngineCoreProc(vllm_config, executor_class)
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self.engine_core.run_busy_loop, name="EngineCore", daemon=True,
                                       args=(self.input_queue, self.output_queue))
        self.thread.start()

    def get_output(self, timeout: float) -> OutputMessage | None:
        try:
            return self.output_queue.get(timeout=timeout)
        except queue.Empty:
            if self.thread.is_alive():
                return None
        try:
            return self.output_queue.get(block=False)
        except queue.Empty:
            return EngineDead("the engine core thread has exited")

    def shutdown(self) -> None:
        if self.thread.is_alive():
            self.input_queue.put((EngineCoreRequestType.SHUTDOWN, None))
            self.thread.join(SHUTDOWN_TIMEOUT_SECONDS)
        self.engine_core.shutdown()

    def _send(self, message: tuple) -> None:
        self.input_queue.put(message)

"""Worker processes: how an executor starts, pins, sizes, feeds, waits for and stops the processes that run the
model — tensor-parallel ranks 1..N-1 (`MultiprocExecutor`) and data-parallel replicas (`DataParallelExecutor`) alike.

    workers = start_workers(vllm_config, body, args_of, num_workers, first=1)  # each: pinned, sized, then body(...)
    gather(workers, READY_TIMEOUT_SECONDS)                                        # every one built its runner
    worker.send_step(scheduler_output)    # this worker's part of a step, as deltas (`solutions/worker/cached_requests`)
    shutdown_workers(workers)                                                     # None, a bounded join, then kill

The engine's end of each pipe (`WorkerProc`) keeps what the worker has been sent (`StepEncoder`); the worker's end
(`WorkerChannel`) keeps its copies of its sequences (`CachedRequests`). A worker says `ready` once its runner is
built; one whose code raises sends its traceback; one that dies closes its pipe. Every wait is bounded (`gather`):
a silent worker is killed and named.

On the CPU, worker i of n is pinned to the i-th slice of this process's CPUs and runs `worker_threads` torch
threads (`cpu_threads`, else its CPUs within its share of a cgroup quota). A forked worker runs one thread: GNU
OpenMP's pool does not survive a fork (a forked child starting 2 threads hangs). On GPUs worker i has its own device.

Where this lives in vLLM: `vllm/v1/executor/multiproc_executor.py` (`WorkerProc`: `make_worker_process`, its ready
pipe, `worker_busy_loop`; the executor's `collective_rpc` with a timeout; `shutdown`) and
`vllm/v1/worker/cpu_worker.py` (one OpenMP thread bound per core of the worker's slice).
"""

import contextlib
import math
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from solutions.config import VllmConfig
from solutions.core.sched.output import SchedulerOutput
from solutions.worker.cached_requests import CachedRequests, StepDelta, StepEncoder
from solutions.worker.cpu_threads import cpu_quota, usable_cpus

READY_TIMEOUT_SECONDS = 600.0  # to load the model (and compile, with the inductor backend)
SHUTDOWN_TIMEOUT_SECONDS = 10.0  # a worker told to stop that has not ended by then is killed


def worker_cpus(index: int, num_workers: int) -> set[int] | None:
    """Worker `index`'s slice of this process's CPUs (None where the platform has no affinity): an equal share
    each, or one CPU shared round-robin when there are fewer CPUs than workers."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = usable_cpus()
    share = len(cpus) // num_workers
    return {cpus[index % len(cpus)]} if share == 0 else set(cpus[index * share : (index + 1) * share])


def worker_threads(cpus: set[int] | None, num_workers: int, cpu_threads: int | None, start_method: str) -> int:
    """The torch threads of one of `num_workers` workers on `cpus`: one if forked, else `cpu_threads` if set, else
    its CPUs within its share of the cgroup quota (`cpu.max`), at least one."""
    if start_method == "fork":
        return 1
    if cpu_threads:
        return cpu_threads
    num_cpus = len(cpus) if cpus else max(1, len(usable_cpus()) // num_workers)
    if (quota := cpu_quota()) is not None:
        num_cpus = min(num_cpus, math.floor(quota / num_workers))
    return max(1, num_cpus)


class WorkerChannel:
    """The worker's end of its pipe, with its copies of the sequences it runs."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.requests = CachedRequests()

    def recv(self) -> Any:
        return self.conn.recv()

    def send(self, kind: str, payload: object = None) -> None:
        self.conn.send((kind, payload))

    def recv_step(self) -> SchedulerOutput | None:
        """The next step over this worker's copies of its sequences, or None when the engine says stop."""
        delta: StepDelta | None = self.conn.recv()
        return None if delta is None else self.requests.apply(delta)


def worker_main(
    conn: Connection, cpus: set[int] | None, threads: int, body: Callable[..., None], *args: object
) -> None:
    """A worker process: pin, size torch's threads, then `body(channel, *args)`, which builds its runner, calls
    `channel.send("ready")` and serves steps. Its failure is sent as a traceback; the engine gone is the end."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    channel = WorkerChannel(conn)
    try:
        body(channel, *args)
    except EOFError:
        pass  # the engine is gone: nothing to report to
    except Exception:
        with contextlib.suppress(OSError):
            channel.send("error", traceback.format_exc())


class WorkerProc:
    """The engine's handle on one worker process: the process, the engine's end of its pipe, what it was sent."""

    def __init__(self, process: multiprocessing.process.BaseProcess, conn: Connection, block_size: int) -> None:
        self.process, self.conn = process, conn
        self.encoder = StepEncoder(block_size)
        self.bytes_sent = 0  # pickled step bytes sent over the worker's life

    @property
    def name(self) -> str:
        return self.process.name

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def send(self, message: object) -> None:
        """Send a message; RuntimeError naming the worker if its pipe is broken (it has died)."""
        try:
            self.conn.send(message)
        except OSError as error:
            raise RuntimeError(f"worker {self.name} is gone ({error})") from error

    def send_step(self, scheduler_output: SchedulerOutput, generators: bool = False) -> None:
        """Send this worker its step as changes to what it holds (with `generators`, the drawing sequences'
        generator states too: a worker that samples)."""
        message = self.encoder.message(scheduler_output, generators)
        self.bytes_sent += len(message)
        try:
            self.conn.send_bytes(message)
        except OSError as error:
            raise RuntimeError(f"worker {self.name} is gone ({error})") from error

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=SHUTDOWN_TIMEOUT_SECONDS)


def start_workers(
    vllm_config: VllmConfig, body: Callable[..., None], args_of: Callable[[int], tuple], num_workers: int,
    name: str, first: int = 0,
) -> list[WorkerProc]:
    """Start workers `first .. num_workers - 1` of `num_workers` (rank or replica i running `body(channel,
    *args_of(i))`), each pinned to its slice of the CPUs and sized by `worker_threads`."""
    start_method = vllm_config.parallel_config.worker_multiproc_method
    context = multiprocessing.get_context(start_method)
    cpu_threads = vllm_config.device_config.cpu_threads
    workers = []
    for index in range(first, num_workers):
        cpus = worker_cpus(index, num_workers)
        threads = worker_threads(cpus, num_workers, cpu_threads, start_method)
        conn, child_conn = context.Pipe()
        process = context.Process(target=worker_main, args=(child_conn, cpus, threads, body, *args_of(index)),
                                  name=f"{name}-{index}", daemon=True)
        process.start()
        child_conn.close()  # the worker holds the only other end: its death closes the pipe
        workers.append(WorkerProc(process, conn, vllm_config.cache_config.block_size))
    return workers


def poll(workers: dict[int, WorkerProc], deadlines: dict[int, float]) -> tuple[dict[int, object], list[int]]:
    """Wait until one of `workers` (key -> worker) replies or the earliest of their `deadlines` (monotonic seconds)
    passes, then take every reply already there: (key -> its payload, the keys of those that died or are past their
    deadline, which are killed). A worker's traceback is raised here, naming the worker: a bug, not a fault."""
    replies: dict[int, object] = {}
    dead: list[int] = []
    pending = {worker.conn: key for key, worker in workers.items()}
    ready = wait(list(pending), timeout=max(0.0, min(deadlines.values()) - time.monotonic()))
    for conn in ready:
        key = pending.pop(conn)
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            dead.append(key)
            continue
        if kind == "error":
            raise RuntimeError(f"worker {workers[key].name} failed:\n{payload}")
        replies[key] = payload
    now = time.monotonic()
    for key in pending.values():
        if deadlines[key] <= now:
            workers[key].kill()
            dead.append(key)
    return replies, dead


def gather(workers: dict[int, WorkerProc], timeout: float) -> tuple[dict[int, object], list[int]]:
    """One reply from each of `workers`, waiting at most `timeout` seconds in all: (key -> its payload, the keys of
    those that died or stayed silent)."""
    deadline = time.monotonic() + timeout
    replies: dict[int, object] = {}
    dead: list[int] = []
    while pending := {key: w for key, w in workers.items() if key not in replies and key not in dead}:
        got, lost = poll(pending, dict.fromkeys(pending, deadline))
        replies |= got
        dead += lost
    return replies, dead


def shutdown_workers(workers: list[WorkerProc]) -> None:
    """Tell each worker to stop (a `None` step), wait a bounded time, kill what is left."""
    for worker in workers:
        with contextlib.suppress(OSError):  # already gone
            worker.conn.send(None)
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_SECONDS
    for worker in workers:
        worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            worker.kill()
    for worker in workers:
        worker.conn.close()

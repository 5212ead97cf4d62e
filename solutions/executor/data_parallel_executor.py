"""Data parallelism: N whole model replicas, one worker process each, every step run side by side.

    LLM("smollm2-135m", data_parallel_size=2)

Each worker loads the whole model and owns its KV cache (the pool the scheduler's `DataParallelKVCacheManager`
keeps the books of for it) and a runner that samples. Each step the engine core's merged output
(`DataParallelSchedulerOutput`) is cut by replica: `execute_model` sends every replica its own part at once (its
sequences, its block copies) and each starts its forward pass; `sample_tokens` sends each its rows of the step's
grammar masks and gathers the sampled tokens, in the scheduler's order (replica by replica). Sampling stays
reproducible wherever a sequence runs: its generator lives with the engine core, and its state travels to the
worker and back each step it samples — a greedy sequence's does not (it draws nothing; a generator's state is
5 KB, more than a sequence's tokens).

On the CPU the replicas share the cores: each worker is pinned to its own slice of this process's CPUs (where the
platform allows) and runs torch on that many threads (or `cpu_threads`). On GPUs replica r runs on cuda:r.

A worker that dies (its pipe closes) or does not answer within `STEP_TIMEOUT_SECONDS` (it is then killed) is
reported, not raised: the step's tokens of the other replicas come back as usual, and `take_dead_replicas` names it
for the engine core, which drops it from the scheduler (its sequences requeued on the others). A worker whose step
raises is a bug, not a fault: its traceback is raised here. Workers are started with `worker_multiproc_method`
("spawn" by default: each loads the checkpoint itself; "fork" copies this process, and then runs torch on one
thread, as `MultiprocExecutor` explains).

Where this lives in vLLM: `vllm/v1/engine/core_client.py` (`DPAsyncMPClient`) and `vllm/v1/engine/core.py`
(`DPEngineCoreProc`): each data-parallel rank is a whole engine core process with its own scheduler; vLLM's ranks
also step in lockstep (its "wave" of dummy batches keeps their collectives aligned for expert parallelism), and the
loss of one rank stops the engine. SGLang runs one server per replica behind its router.
"""

import multiprocessing
import os
import time
import traceback
import weakref
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait

import torch

from solutions.config import VllmConfig
from solutions.core.sched.data_parallel_scheduler import DataParallelSchedulerOutput
from solutions.core.sched.output import GrammarOutput, ModelRunnerOutput, sampling_rows
from solutions.executor.abstract import Executor
from solutions.model.loader import load_model
from solutions.worker.model_runner import ModelRunner

STEP_TIMEOUT_SECONDS = 600.0  # a replica silent for this long in a step is taken for dead
READY_TIMEOUT_SECONDS = 600.0  # to load the model (and compile, with the inductor backend)


def replica_cpus(replica: int, num_replicas: int) -> set[int] | None:
    """Replica `replica`'s slice of this process's CPUs (None where the platform has no affinity): an equal share
    each, or one CPU shared round-robin when there are fewer CPUs than replicas."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // num_replicas
    if share == 0:
        return {cpus[replica % len(cpus)]}
    return set(cpus[replica * share : (replica + 1) * share])


def run_replica(replica: int, vllm_config: VllmConfig, conn: Connection, cpus: set[int] | None, threads: int) -> None:
    """A worker process: pin, load the model, say ready, then serve steps until `None` (or the pipe closes)."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    device = vllm_config.device_config.device
    if device.type == "cuda":
        device = torch.device("cuda", replica)
        torch.cuda.set_device(device)
    try:
        model = load_model(vllm_config.model_config.model, device=device, dtype=vllm_config.model_config.dtype)
        runner = ModelRunner.from_config(model, vllm_config)
        conn.send(("ready", None))
        replica_busy_loop(runner, conn)
    except EOFError:
        pass  # the engine is gone: nothing to report to
    except Exception:
        conn.send(("error", traceback.format_exc()))


def replica_busy_loop(runner: ModelRunner, conn: Connection) -> None:
    """Each step: a part of the batch and its sampled sequences' generator states; the forward pass; then the rows
    of the grammar masks (or None); sample; send the tokens and those generators' new states back."""
    while (message := conn.recv()) is not None:
        part, states = message
        runner.execute_model(part)
        mask = conn.recv()
        seqs = [seq for seq in sampling_rows(part)[1] if seq.seq_id in states]  # the ones that draw
        for seq in seqs:
            seq.generator = torch.Generator().set_state(states[seq.seq_id])
        grammar = None
        if mask is not None:
            future: Future = Future()
            future.set_result(mask)
            grammar = GrammarOutput(future)
        output = runner.sample_tokens(grammar)
        conn.send(("output", (output, {seq.seq_id: seq.generator.get_state() for seq in seqs})))


class DataParallelExecutor(Executor):
    """`data_parallel_size` replicas in worker processes; `execute_model` and `sample_tokens` over all of them."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        parallel = vllm_config.parallel_config
        num_replicas, start_method = parallel.data_parallel_size, parallel.worker_multiproc_method
        context = multiprocessing.get_context(start_method)
        self.workers: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        for replica in range(num_replicas):
            cpus = replica_cpus(replica, num_replicas)
            threads = vllm_config.device_config.cpu_threads or (len(cpus) if cpus else 1)
            if start_method == "fork":
                threads = 1  # GNU OpenMP's pool does not survive a fork (see multiproc_executor.py)
            conn, child_conn = context.Pipe()
            worker = context.Process(
                target=run_replica, args=(replica, vllm_config, child_conn, cpus, threads),
                name=f"dp-replica-{replica}", daemon=True,
            )
            worker.start()
            child_conn.close()  # the worker holds the only other end: its death closes the pipe
            self.workers.append(worker)
            self.conns.append(conn)
        self.alive = [True] * num_replicas
        self._newly_dead: list[int] = []
        self._step: DataParallelSchedulerOutput | None = None
        self._finalizer = weakref.finalize(self, _shut_down, self.workers, self.conns)
        try:
            replies = self._gather(range(num_replicas), READY_TIMEOUT_SECONDS)
        except RuntimeError:
            self._finalizer()
            raise
        if not_ready := [r for r in range(num_replicas) if r not in replies]:
            self._finalizer()
            raise RuntimeError(f"data-parallel replicas {not_ready} died while loading the model")

    def execute_model(self, scheduler_output: DataParallelSchedulerOutput) -> None:
        """Send each live replica its part of the step and the states of its sampled (not greedy) sequences'
        generators; each starts its forward pass. The logits stay on the replicas (they sample)."""
        self._step = scheduler_output
        for replica, part in scheduler_output.replica_outputs.items():
            states = {seq.seq_id: seq.generator.get_state() for seq in sampling_rows(part)[1]
                      if not seq.sampling_params.greedy}
            self._send(replica, (part, states))

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Each replica's rows of the masks, then its sampled tokens, merged in replica order; a replica that died
        returns nothing (`take_dead_replicas` names it)."""
        step, self._step = self._step, None
        if step is None:
            raise RuntimeError("sample_tokens() needs an execute_model() first")
        mask = None if grammar_output is None else grammar_output.bitmask()  # (N, W) over the merged rows
        start = 0
        for replica, part in step.replica_outputs.items():
            num_rows = len(sampling_rows(part)[0])
            self._send(replica, None if mask is None else mask[start : start + num_rows])
            start += num_rows
        replies = self._gather([r for r in step.replica_outputs if self.alive[r]], STEP_TIMEOUT_SECONDS)
        seqs = {seq.seq_id: seq for seq in sampling_rows(step)[1]}
        merged = ModelRunnerOutput([], [], [])
        for replica in step.replica_outputs:
            if replica not in replies:
                continue
            output, states = replies[replica]
            merged.seq_ids += output.seq_ids
            merged.sampled_token_ids += output.sampled_token_ids
            merged.logprobs += output.logprobs
            merged.prompt_logprobs.update(output.prompt_logprobs)
            for stage, seconds in output.seconds.items():  # side by side: the slowest replica's
                merged.seconds[stage] = max(merged.seconds.get(stage, 0.0), seconds)
            for seq_id, state in states.items():
                seqs[seq_id].generator.set_state(state)
        return merged

    def take_dead_replicas(self) -> list[int]:
        dead, self._newly_dead = self._newly_dead, []
        return dead

    def shutdown(self) -> None:
        self._finalizer()

    def _send(self, replica: int, message: object) -> None:
        if not self.alive[replica]:
            return
        try:
            self.conns[replica].send(message)
        except OSError:  # a broken pipe: it died
            self._mark_dead(replica)

    def _gather(self, replicas: list[int] | range, timeout: float) -> dict[int, object]:
        """One reply from each of `replicas`, waiting at most `timeout` seconds in all: replica -> its payload. A
        replica whose pipe closes, or that has not answered in time (then killed), is marked dead and left out; one
        that reports an error raises it."""
        pending = {self.conns[r]: r for r in replicas}
        replies: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                for replica in pending.values():
                    self.workers[replica].kill()
                    self._mark_dead(replica)
                break
            for conn in ready:
                replica = pending.pop(conn)
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    self._mark_dead(replica)
                    continue
                if kind == "error":
                    raise RuntimeError(f"data-parallel replica {replica} failed:\n{payload}")
                replies[replica] = payload
        return replies

    def _mark_dead(self, replica: int) -> None:
        if self.alive[replica]:
            self.alive[replica] = False
            self._newly_dead.append(replica)


def _shut_down(workers: list[multiprocessing.process.BaseProcess], conns: list[Connection]) -> None:
    """Tell each worker to stop (a `None` step), wait a little, kill what is left."""
    for conn in conns:
        try:
            conn.send(None)
        except OSError:
            pass  # already gone
    for worker in workers:
        worker.join(timeout=10)
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=10)
    for conn in conns:
        conn.close()

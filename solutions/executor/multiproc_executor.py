"""Tensor parallelism from a plain Python process: rank 0 here, ranks 1..N-1 in worker processes it starts.

    LLM("smollm2-135m", tensor_parallel_size=2)

The engine core (scheduler, KV cache manager) lives only on rank 0 and knows nothing of ranks: block ids are
the same on every rank, because every rank's KV cache has the same blocks, each holding that rank's heads. Each
step, `execute_model` broadcasts the step's `SchedulerOutput` to the workers, and every rank runs the same
forward pass on its slice of the weights (`solutions/distributed/layers.py`); the collectives inside the model
keep them in step, and the logits come out whole on every rank. Rank 0's runner samples (`sample_tokens`); the
others wait for the next broadcast. A broadcast of `None` stops them.

The workers are started with "spawn" by default (a fresh interpreter, as the engine core's process in chapter 7):
each loads the checkpoint itself, then keeps its slice, and runs the code `solutions/` holds on disk. With "fork"
a worker is a copy of this process: it slices the model already in memory, and runs the code this process runs,
including any a test or a notebook swapped in (chapter 9's capstone). A forked worker runs torch on 1 thread:
GNU OpenMP's thread pool does not survive a fork, and a forked child that starts a team of 2 threads after its
parent used one hangs (measured here). Otherwise the ranks share the cores: each runs torch with
`cpu_count // tensor_parallel_size` threads. On GPUs each rank has its own (rank r on cuda:r), NCCL carries the
collectives, workers must be spawned (CUDA does not survive a fork), and steps run eagerly. A worker that dies
shows up at the next collective: gloo raises when its peer's connection closes, or after the group's timeout, and
`execute_model` reports which rank is gone.

Where this lives in vLLM: `vllm/v1/executor/multiproc_executor.py` (`MultiprocExecutor`, `WorkerProc`), which
sends the `SchedulerOutput` through a shared-memory message queue rather than a gloo broadcast; the start method
is its `VLLM_WORKER_MULTIPROC_METHOD`.
"""

import multiprocessing
import os
import weakref

import torch
import torch.distributed as dist

from solutions.config import VllmConfig
from solutions.core.sched.output import SchedulerOutput
from solutions.distributed.layers import shard_model
from solutions.distributed.parallel_state import (
    broadcast_object,
    destroy_tensor_parallel,
    free_port,
    init_tensor_parallel,
)
from solutions.executor.abstract import Executor, eager_on_gpu
from solutions.model.llama import LlamaForCausalLM
from solutions.model.loader import load_model
from solutions.worker.model_runner import ModelRunner


def _threads_per_rank(tp_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // tp_size)


def run_worker(
    rank: int, vllm_config: VllmConfig, init_method: str, full_model: LlamaForCausalLM | None, threads: int
) -> None:
    """A worker process: join the group, slice the model (loading it first when spawned; on GPUs onto this
    rank's own, cuda:rank), then run every broadcast step until `None`."""
    torch.set_num_threads(threads)
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    device = vllm_config.device_config.device
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    init_tensor_parallel(rank, tp_size, init_method, device=device.type)
    try:
        if full_model is None:
            full_model = load_model(vllm_config.model_config.model, device=device, dtype=vllm_config.model_config.dtype)
        runner = ModelRunner.from_config(shard_model(full_model, rank, tp_size), vllm_config, **eager_on_gpu(device))
        while (scheduler_output := broadcast_object()) is not None:
            runner.execute_model(scheduler_output)
    finally:
        destroy_tensor_parallel()


class MultiprocExecutor(Executor):
    """Rank 0's side: the same `execute_model` as one process's, over `tensor_parallel_size` ranks."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        if torch.distributed.is_initialized():
            raise RuntimeError(
                "this process already belongs to a tensor-parallel group: one tensor-parallel engine per process; "
                "shut the other down first (its llm_engine.shutdown())"
            )
        parallel = vllm_config.parallel_config
        tp_size, start_method = parallel.tensor_parallel_size, parallel.worker_multiproc_method
        init_method = f"tcp://127.0.0.1:{free_port()}"
        context = multiprocessing.get_context(start_method)
        full_model = self.load_model()
        device = vllm_config.device_config.device
        # Spawned workers load the checkpoint themselves; forked ones are copies of this process, model included.
        source, worker_threads = (None, _threads_per_rank(tp_size)) if start_method == "spawn" else (full_model, 1)
        self.workers = [
            context.Process(target=run_worker, args=(rank, vllm_config, init_method, source, worker_threads),
                            name=f"tp-worker-{rank}", daemon=True)
            for rank in range(1, tp_size)
        ]
        for worker in self.workers:
            worker.start()
        threads = torch.get_num_threads()
        torch.set_num_threads(_threads_per_rank(tp_size))  # given back at shutdown
        self._finalizer = weakref.finalize(self, _shut_down, self.workers, threads)
        try:
            init_tensor_parallel(0, tp_size, init_method, device=device.type)  # returns once every worker has joined
            self.model_runner = ModelRunner.from_config(
                shard_model(full_model, 0, tp_size), vllm_config, **eager_on_gpu(device)
            )
        except BaseException:
            self._finalizer()  # no worker, group or thread setting outlives a failed start
            raise

    def execute_model(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        dead = [worker.name for worker in self.workers if not worker.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel workers {dead} have died; this engine cannot run another step")
        try:
            broadcast_object(scheduler_output)
            return self.model_runner.execute_model(scheduler_output)
        except RuntimeError as error:  # a collective failed: a peer closed its connection or timed out
            dead = [worker.name for worker in self.workers if not worker.is_alive()]
            raise RuntimeError(f"a tensor-parallel step failed (dead workers: {dead or 'none'}): {error}") from error

    def shutdown(self) -> None:
        self._finalizer()


def _shut_down(workers: list[multiprocessing.Process], threads: int) -> None:
    """Stop the workers (a `None` step), leave the group, and give this process its torch threads back; a worker
    that does not stop is killed."""
    if dist.is_initialized() and all(worker.is_alive() for worker in workers):
        try:
            broadcast_object(None)
        except RuntimeError:
            pass  # a worker is already gone: nothing to tell
    for worker in workers:
        worker.join(timeout=10)
        if worker.is_alive():
            worker.kill()
    destroy_tensor_parallel()
    torch.set_num_threads(threads)

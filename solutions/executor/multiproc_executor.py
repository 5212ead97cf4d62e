"""Tensor parallelism from a plain Python process: rank 0 here, ranks 1..N-1 in worker processes it starts.

    LLM("smollm2-135m", tensor_parallel_size=2)

The engine (scheduler, KV cache manager, sampler) lives only on rank 0 and knows nothing of ranks: block ids are
the same on every rank, because every rank's KV cache has the same blocks, each holding that rank's heads. Each
step, `execute_model` broadcasts the step's `SchedulerOutput` to the workers, and every rank runs the same
forward pass on its slice of the weights (`solutions/distributed/layers.py`); the collectives inside the model
keep them in step, and the logits come out whole on every rank. Rank 0 samples; the others wait for the next
broadcast. A broadcast of `None` stops them.

The workers are started with "spawn" (a fresh interpreter, as the engine core's process in chapter 7) and each
loads the checkpoint itself, then keeps its slice. On a CPU the ranks share the cores: each runs torch with
`cpu_count // tensor_parallel_size` threads. A worker that dies shows up at the next collective: gloo raises
when its peer's connection closes, or after the group's timeout, and `execute_model` reports which rank is gone.

Where this lives in vLLM: `vllm/v1/executor/multiproc_executor.py` (`MultiprocExecutor`, `WorkerProc`), which
sends the `SchedulerOutput` through a shared-memory message queue rather than a gloo broadcast.
"""

import multiprocessing
import os
import socket
import weakref
from typing import Any

import torch

from solutions.distributed.layers import shard_model
from solutions.distributed.parallel_state import broadcast_object, destroy_tensor_parallel, init_tensor_parallel
from solutions.core.sched.output import SchedulerOutput
from solutions.model.llama import LlamaForCausalLM
from solutions.model.loader import load_model
from solutions.worker.model_runner import ModelRunner


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _threads_per_rank(tp_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // tp_size)


def run_worker(rank: int, tp_size: int, init_method: str, model: str, dtype: torch.dtype, runner_kwargs: dict[str, Any]) -> None:
    """A worker process: join the group, load and slice the model, then run every broadcast step until `None`."""
    torch.set_num_threads(_threads_per_rank(tp_size))
    init_tensor_parallel(rank, tp_size, init_method)
    try:
        runner = ModelRunner(shard_model(load_model(model, dtype=dtype), rank, tp_size), **runner_kwargs)
        while (scheduler_output := broadcast_object()) is not None:
            runner.execute_model(scheduler_output)
    finally:
        destroy_tensor_parallel()


class MultiprocExecutor:
    """Rank 0's side: the same `execute_model` as a `ModelRunner`, over `tp_size` ranks."""

    def __init__(
        self, model: str, full_model: LlamaForCausalLM, tp_size: int, runner_kwargs: dict[str, Any]
    ) -> None:
        if torch.distributed.is_initialized():
            raise RuntimeError(
                "this process already belongs to a tensor-parallel group: one tensor-parallel engine per process; "
                "shut the other down first (its llm_engine.model_runner.shutdown())"
            )
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = multiprocessing.get_context("spawn")
        dtype = full_model.model.embed_tokens.weight.dtype
        self.workers = [
            context.Process(target=run_worker, args=(rank, tp_size, init_method, model, dtype, runner_kwargs),
                            name=f"tp-worker-{rank}", daemon=True)
            for rank in range(1, tp_size)
        ]
        for worker in self.workers:
            worker.start()
        threads = torch.get_num_threads()
        torch.set_num_threads(_threads_per_rank(tp_size))  # given back at shutdown
        init_tensor_parallel(0, tp_size, init_method)  # returns once every worker has joined
        self.model_runner = ModelRunner(shard_model(full_model, 0, tp_size), **runner_kwargs)
        self.kv_cache = self.model_runner.kv_cache  # rank 0's: its heads of every block
        self._finalizer = weakref.finalize(self, _shut_down, self.workers, threads)

    def execute_model(self, scheduler_output: SchedulerOutput, seconds: dict[str, float] | None = None) -> torch.Tensor:
        dead = [worker.name for worker in self.workers if not worker.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel workers {dead} have died; this engine cannot run another step")
        try:
            broadcast_object(scheduler_output)
            return self.model_runner.execute_model(scheduler_output, seconds)
        except RuntimeError as error:  # a collective failed: a peer closed its connection or timed out
            dead = [worker.name for worker in self.workers if not worker.is_alive()]
            raise RuntimeError(f"a tensor-parallel step failed (dead workers: {dead or 'none'}): {error}") from error

    def shutdown(self) -> None:
        self._finalizer()


def _shut_down(workers: list[multiprocessing.Process], threads: int) -> None:
    """Stop the workers (a `None` step), leave the group, and give this process its torch threads back; a worker
    that does not stop is killed."""
    if all(worker.is_alive() for worker in workers):
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

"""Tensor parallelism from a plain Python process: rank 0 here, ranks 1..N-1 in worker processes it starts.

    LLM("smollm2-135m", tensor_parallel_size=2)

The engine core (scheduler, KV cache manager) lives only on rank 0 and knows nothing of ranks: every rank's KV
cache has the same blocks, each holding that rank's heads. Each step, `execute_model` sends the step to every
worker (`WorkerProc.send_step`: as changes to the sequences the worker already holds), and every rank runs the
same forward pass on its slice of the weights (`solutions/distributed/layers.py`); the collectives keep them in
step, and the logits come out whole on every rank. Rank 0's runner samples; a `None` stops the workers. Rank 0's
side is `execute_model_in_lockstep`, a worker's `worker_busy_loop` (chapter 9's exercises); starting, pinning and
stopping workers is `worker_proc.py`'s, shared with data parallelism. Speculative drafts travel in the same
message, so every rank computes the same rows; only rank 0 verifies and proposes (a proposer calls no collective).

Workers are spawned by default: each loads the checkpoint itself and runs the code on disk. With "fork" a worker
is a copy of this process and runs any code a test or notebook swapped in (chapter 9's capstone). On GPUs rank r
runs on cuda:r, NCCL carries the collectives, workers must be spawned, and steps run eagerly. A worker that dies
is refused before the next step; one that dies during a step shows up at the next collective (gloo raises, or
times out after `COLLECTIVE_TIMEOUT_SECONDS`), and `execute_model` reports which rank is gone.

Where this lives in vLLM: `vllm/v1/executor/multiproc_executor.py` (`MultiprocExecutor`, `WorkerProc`), which
sends the `SchedulerOutput` through a shared-memory message queue, every worker sampling the all-gathered logits;
its `VLLM_WORKER_MULTIPROC_METHOD` defaults to "fork" (ours to "spawn").
"""

import weakref

import torch

from solutions.config import VllmConfig
from solutions.core.sched.output import SchedulerOutput
from solutions.distributed import parallel_state
from solutions.distributed.layers import shard_model
from solutions.distributed.parallel_state import destroy_tensor_parallel, free_port, init_tensor_parallel
from solutions.executor.abstract import Executor, eager_on_gpu
from solutions.executor.worker_proc import (
    READY_TIMEOUT_SECONDS, WorkerChannel, WorkerProc, gather, shutdown_workers, start_workers, worker_cpus,
    worker_threads,
)
from solutions.model.llama import LlamaForCausalLM
from solutions.model.loader import load_model
from solutions.worker.model_runner import ModelRunner


def run_rank(
    channel: WorkerChannel, rank: int, vllm_config: VllmConfig, init_method: str, full_model: LlamaForCausalLM | None
) -> None:
    """A worker's body: join the group, slice the model (loading it first when spawned; on GPUs onto this rank's
    own, cuda:rank), say ready, then run every step rank 0 sends until `None`."""
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    device = vllm_config.device_config.device
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    init_tensor_parallel(rank, tp_size, init_method, parallel_state.COLLECTIVE_TIMEOUT_SECONDS, device=device.type)
    try:
        if full_model is None:
            full_model = load_model(vllm_config.model_config.model, device=device, dtype=vllm_config.model_config.dtype)
        runner = ModelRunner.from_config(  # no proposer: rank 0 drafts
            shard_model(full_model, rank, tp_size), vllm_config, speculative_config=None, **eager_on_gpu(device)
        )
        channel.send("ready")
        worker_busy_loop(runner, channel)
    finally:
        destroy_tensor_parallel()


def worker_busy_loop(runner: ModelRunner, channel: WorkerChannel) -> None:
    """A worker's life after start-up: receive each step rank 0 sends and run its forward pass on this rank's slice
    (its collectives meet rank 0's); return at `None`. A step that raises is not caught: the worker ends, its
    connections close, and rank 0's next collective fails instead of waiting for it."""
    while (scheduler_output := channel.recv_step()) is not None:
        runner.execute_model(scheduler_output)  # the logits are rank 0's to sample; this rank's copy is dropped


def execute_model_in_lockstep(
    model_runner: ModelRunner, workers: list[WorkerProc], scheduler_output: SchedulerOutput
) -> torch.Tensor:
    """Rank 0's side of one step: refuse at once if a worker has died, send the step to every worker, then run
    rank 0's own forward pass, whose collectives the workers join; the logits (B, V). A collective that fails (a
    peer closed its connection or timed out) is re-raised naming the dead workers, so the engine core reports it
    rather than waiting."""
    dead = [worker.name for worker in workers if not worker.is_alive()]
    if dead:
        raise RuntimeError(f"tensor-parallel workers {dead} have died; this engine cannot run another step")
    try:
        for worker in workers:
            worker.send_step(scheduler_output)
        return model_runner.execute_model(scheduler_output)
    except RuntimeError as error:  # a peer closed its connection (it died), or a collective timed out
        for worker in workers:
            worker.process.join(timeout=1)  # a worker whose step failed may still be exiting when its pipe closes
        dead = [worker.name for worker in workers if not worker.is_alive()]
        raise RuntimeError(
            f"a tensor-parallel step failed (dead workers: {dead or 'none'}; with none dead, a rank is stuck or the "
            f"ranks ran different collectives): {error}"
        ) from error


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
        full_model = self.load_model()
        device = vllm_config.device_config.device
        # Spawned workers load the checkpoint themselves; forked ones are copies of this process, model included.
        source = None if start_method == "spawn" else full_model
        self.workers = start_workers(vllm_config, run_rank, lambda rank: (rank, vllm_config, init_method, source),
                                     tp_size, "tp-worker", first=1)
        threads = torch.get_num_threads()
        rank_zero_threads = worker_threads(
            worker_cpus(0, tp_size), tp_size, vllm_config.device_config.cpu_threads, "spawn"
        )  # rank 0 is this process, never a fork
        torch.set_num_threads(rank_zero_threads)  # given back at shutdown
        self._finalizer = weakref.finalize(self, _shut_down, self.workers, threads)
        try:
            init_tensor_parallel(  # returns once every worker has joined
                0, tp_size, init_method, parallel_state.COLLECTIVE_TIMEOUT_SECONDS, device=device.type
            )
            self.model_runner = ModelRunner.from_config(shard_model(full_model, 0, tp_size), vllm_config,
                                                        **eager_on_gpu(device))
            _, dead = gather(dict(enumerate(self.workers, start=1)), READY_TIMEOUT_SECONDS)
            if dead:
                raise RuntimeError(f"tensor-parallel ranks {dead} died while loading the model")
        except BaseException:
            self._finalizer()  # no worker, group or thread setting outlives a failed start
            raise

    def execute_model(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        return execute_model_in_lockstep(self.model_runner, self.workers, scheduler_output)

    def shutdown(self) -> None:
        self._finalizer()


def _shut_down(workers: list[WorkerProc], threads: int) -> None:
    """Stop the workers, leave the group, and give this process its torch threads back."""
    shutdown_workers(workers)
    destroy_tensor_parallel()
    torch.set_num_threads(threads)

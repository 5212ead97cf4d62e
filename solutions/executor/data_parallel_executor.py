"""Data parallelism: N whole model replicas, one worker process each, each stepping on its own.

    LLM("smollm2-135m", data_parallel_size=2)

Each worker loads the whole model and owns its KV cache (whose books the scheduler's `DataParallelKVCacheManager`
keeps) and a runner that samples. The replicas do not wait for each other: `execute_model` sends each replica the
scheduler has given a step (only those whose previous step has come back) its part, as changes
(`WorkerProc.send_step`); `sample_tokens` sends their rows of the grammar masks, waits for the first reply and
returns every reply there by then (`DataParallelModelRunnerOutput`). So one replica's long prefill holds up no
other's decodes. A drawing sequence's generator state goes to its replica once (`cached_requests.py`).

A worker that dies (its pipe closes) or does not answer within `STEP_TIMEOUT_SECONDS` (it is then killed) is
reported, not raised: `take_dead_replicas` names it for the engine core, which requeues its sequences on the
others. A worker whose step raises is a bug: its traceback is raised here. Starting and stopping workers is
`worker_proc.py`'s, shared with tensor parallelism.

Where this lives in vLLM (read 2026-12-03, stored copy at commit 00080ee): `vllm/v1/engine/core_client.py`
(`DPLBAsyncMPClient`) and `vllm/v1/engine/core.py` (`DPEngineCoreProc`): each data-parallel rank is a whole engine
core process with its own scheduler. Dense models' ranks run independently, as here; only MoE models' ranks step in
lockstep (their "wave" of dummy batches keeps expert-parallel collectives aligned). SGLang runs one server per
replica behind its router.
"""

import time
import weakref

import torch

from solutions.config import VllmConfig
from solutions.core.sched.data_parallel_scheduler import DataParallelModelRunnerOutput, DataParallelSchedulerOutput
from solutions.core.sched.output import GrammarOutput, SchedulerOutput, sampling_rows
from solutions.executor.abstract import Executor
from solutions.executor.worker_proc import (
    READY_TIMEOUT_SECONDS, WorkerChannel, gather, poll, shutdown_workers, start_workers,
)
from solutions.model.loader import load_model
from solutions.worker.model_runner import ModelRunner

STEP_TIMEOUT_SECONDS = 600.0  # a replica silent for this long after being sent its step is taken for dead


def run_replica(channel: WorkerChannel, replica: int, vllm_config: VllmConfig) -> None:
    """A replica's body: load the model (on GPUs onto cuda:replica), say ready, then serve steps until `None`."""
    device = vllm_config.device_config.device
    if device.type == "cuda":
        device = torch.device("cuda", replica)
        torch.cuda.set_device(device)
    model = load_model(vllm_config.model_config.model, device=device, dtype=vllm_config.model_config.dtype)
    channel.send("ready")
    replica_busy_loop(ModelRunner.from_config(model, vllm_config), channel)


def replica_busy_loop(runner: ModelRunner, channel: WorkerChannel) -> None:
    """Each step: its part of the batch; the forward pass; then its rows of the grammar masks (or None); sample; send
    the tokens back."""
    while (part := channel.recv_step()) is not None:
        runner.execute_model(part)
        channel.send("output", runner.sample_tokens(GrammarOutput.of(channel.recv())))


class DataParallelExecutor(Executor):
    """`data_parallel_size` replicas in worker processes; `execute_model` dispatches the replicas scheduled this
    step, `sample_tokens` returns whichever replicas' steps have come back."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        num_replicas = vllm_config.parallel_config.data_parallel_size
        self.workers = dict(enumerate(start_workers(
            vllm_config, run_replica, lambda replica: (replica, vllm_config), num_replicas, "dp-replica"
        )))
        self._finalizer = weakref.finalize(self, shutdown_workers, list(self.workers.values()))
        self.in_flight: dict[int, tuple[SchedulerOutput, float]] = {}  # replica -> (its step, its deadline)
        self._dispatched: DataParallelSchedulerOutput | None = None  # this engine step's, until its masks are sent
        self._newly_dead: list[int] = []
        try:
            _, dead = gather(self.workers, READY_TIMEOUT_SECONDS)
            if dead:
                raise RuntimeError(f"data-parallel replicas {dead} died while loading the model")
        except RuntimeError:
            self._finalizer()
            raise

    def execute_model(self, scheduler_output: DataParallelSchedulerOutput) -> None:
        """Send each replica scheduled this step its part; each starts its forward pass at once. The logits stay on
        the replicas (they sample)."""
        self._dispatched = scheduler_output
        for replica, part in scheduler_output.replica_outputs.items():
            try:
                self.workers[replica].send_step(part, generators=True)
            except RuntimeError:  # its pipe is broken: it died
                self._mark_dead(replica)
                continue
            self.in_flight[replica] = part, time.monotonic() + STEP_TIMEOUT_SECONDS

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> DataParallelModelRunnerOutput:
        """Send this step's replicas their rows of the masks, then wait for the first replica with a step in flight
        to answer (at most until the earliest deadline) and return every answer there by then; a replica that died
        returns nothing (`take_dead_replicas` names it)."""
        dispatched, self._dispatched = self._dispatched, None
        if dispatched is None:
            raise RuntimeError("sample_tokens() needs an execute_model() first")
        mask = None if grammar_output is None else grammar_output.bitmask()  # (N, W) over the step's merged rows
        start = 0
        for replica, part in dispatched.replica_outputs.items():
            num_rows = len(sampling_rows(part)[0])
            if replica in self.in_flight:
                try:
                    self.workers[replica].send(None if mask is None else mask[start : start + num_rows])
                except RuntimeError:
                    self._mark_dead(replica)
            start += num_rows
        merged = DataParallelModelRunnerOutput()
        while self.in_flight and not merged.replica_outputs and not self._newly_dead:
            busy = {replica: self.workers[replica] for replica in self.in_flight}
            replies, dead = poll(busy, {replica: deadline for replica, (_, deadline) in self.in_flight.items()})
            for replica in dead:
                self._mark_dead(replica)
            for replica, output in replies.items():
                self.in_flight.pop(replica)
                merged.replica_outputs[replica] = output
        return merged

    def take_dead_replicas(self) -> list[int]:
        dead, self._newly_dead = self._newly_dead, []
        return dead

    def shutdown(self) -> None:
        self._finalizer()

    def _mark_dead(self, replica: int) -> None:
        self.in_flight.pop(replica, None)
        if replica in self.workers:
            del self.workers[replica]
            self._newly_dead.append(replica)

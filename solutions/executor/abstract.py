"""The executor: the engine core's one handle on the workers that run the model, however many there are.

    model_executor = Executor.get_class(vllm_config)(vllm_config)
    model_executor.execute_model(scheduler_output)        # every rank: the forward pass
    model_output = model_executor.sample_tokens(grammar)  # the driver: one token per sampling sequence

Which class is decided by the config alone: one process (`UniProcExecutor`), ranks this process starts
(`MultiprocExecutor`), ranks torchrun started (`ExecutorWithExternalLauncher`), or whole replicas in worker processes
(`DataParallelExecutor`). The core never knows which.

Where this lives in vLLM: `vllm/v1/executor/abstract.py` (`Executor.get_class`).
"""

import torch

from solutions.config import VllmConfig
from solutions.core.sched.output import DraftTokenIds, GrammarOutput, ModelRunnerOutput, SchedulerOutput
from solutions.model.loader import load_model
from solutions.worker.model_runner import ModelRunner


def eager_on_gpu(device: torch.device) -> dict[str, bool]:
    """A rank's runner options: on GPUs (NCCL, one GPU per rank) steps run eagerly, no CUDA graphs across ranks."""
    return {"enforce_eager": True} if device.type == "cuda" else {}


class Executor:
    """Runs the model for the engine core. `model_runner` is this process's runner (rank 0's, under tensor
    parallelism): it holds this rank's model slice and KV cache, and samples."""

    model_runner: ModelRunner

    @staticmethod
    def get_class(vllm_config: VllmConfig) -> type["Executor"]:
        parallel = vllm_config.parallel_config
        if parallel.data_parallel:  # whole replicas in worker processes
            from solutions.executor.data_parallel_executor import DataParallelExecutor

            return DataParallelExecutor
        if parallel.tensor_parallel_size == 1:
            from solutions.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor
        if parallel.distributed_executor_backend == "external_launcher":  # torchrun started every rank's engine
            from solutions.executor.external_launcher import ExecutorWithExternalLauncher

            return ExecutorWithExternalLauncher
        from solutions.executor.multiproc_executor import MultiprocExecutor  # this process starts the workers

        return MultiprocExecutor

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config

    def load_model(self) -> torch.nn.Module:
        """This process's whole model, from the checkpoint the config names, on its device, in its dtype."""
        model_config = self.vllm_config.model_config
        return load_model(model_config.model, device=self.vllm_config.device_config.device, dtype=model_config.dtype)

    def execute_model(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        """One forward pass over the step's batch: the logits (B, V), the sampling rows kept for `sample_tokens`."""
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self.model_runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts rank 0's proposer made after the last sampling, once (None without speculation)."""
        return self.model_runner.take_draft_token_ids()

    def take_dead_replicas(self) -> list[int]:
        """Data parallelism: the replicas found dead since the last call, once (none here: one replica, which does not
        die without the engine)."""
        return []

    def shutdown(self) -> None:
        """Release the workers (nothing to do in one process). Idempotent."""

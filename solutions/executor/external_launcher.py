"""Tensor parallelism under `torchrun`: every rank runs the whole engine, and no rank drives the others.

    torchrun --nproc-per-node 2 my_script.py      # my_script.py: LLM(..., tensor_parallel_size=2,
                                                  #                   distributed_executor_backend="external_launcher")

`torchrun` starts the processes and tells each its place (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`);
each builds the same `LLM` and gets the same requests. There is no broadcast: each rank's scheduler makes the same
decisions from the same inputs, the collectives keep the forward passes in step, and the logits come out whole
and identical on every rank, so every rank samples (and drafts) the same tokens. Multi-node is the same script
under `torchrun --nnodes 2 --node-rank K --master-addr HOST ...` on each machine.

Where this lives in vLLM: `vllm/v1/executor/uniproc_executor.py` (`ExecutorWithExternalLauncher`), selected by
`distributed_executor_backend="external_launcher"`.
"""

import os

from solutions.config import VllmConfig
from solutions.distributed.layers import shard_model
from solutions.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from solutions.exceptions import ParameterError
from solutions.executor.abstract import Executor, eager_on_gpu
from solutions.worker.model_runner import ModelRunner

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class ExecutorWithExternalLauncher(Executor):
    """This rank's slice of the model and KV cache, in the group `torchrun` set up; every rank samples."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        if missing := [name for name in LAUNCHER_ENV if name not in os.environ]:
            raise ParameterError(
                f"distributed_executor_backend='external_launcher' runs under torchrun, which sets "
                f"{list(LAUNCHER_ENV)}; {missing} are not set (start the script with `torchrun --nproc-per-node "
                f"{tp_size} ...`)", "distributed_executor_backend",
            )
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world_size != tp_size:
            raise ParameterError(f"tensor_parallel_size={tp_size} must equal the number of processes torchrun started "
                                 f"(WORLD_SIZE={world_size})", "tensor_parallel_size")
        device = vllm_config.device_config.device  # on GPUs: this rank's own (the config chose it)
        init_tensor_parallel(rank, world_size, "env://", device=device.type)
        model = shard_model(self.load_model(), rank, world_size)
        self.model_runner = ModelRunner.from_config(model, vllm_config, **eager_on_gpu(device))

    def shutdown(self) -> None:
        destroy_tensor_parallel()

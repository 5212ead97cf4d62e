"""Tensor parallelism under `torchrun`: every rank runs the whole engine, and no rank drives the others.

    torchrun --nproc-per-node 2 my_script.py      # my_script.py: LLM(..., tensor_parallel_size=2,
                                                  #                   distributed_executor_backend="external_launcher")

`torchrun` starts the processes and tells each its place (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` in
the environment); each builds the same `LLM` and gets the same requests. There is no broadcast: each rank's
scheduler makes the same decisions from the same inputs, each rank's forward pass runs on its slice of the
weights, the collectives inside the model keep them in step, and the logits come out whole and identical on
every rank, so every rank samples the same tokens and returns the same outputs. Multi-node is the same script
under `torchrun --nnodes 2 --node-rank K --master-addr HOST ...` on each machine.

Where this lives in vLLM: `vllm/v1/executor/uniproc_executor.py` (`ExecutorWithExternalLauncher`), selected by
`distributed_executor_backend="external_launcher"`.
"""

import os
from typing import Any

import torch

from solutions.core.sched.output import SchedulerOutput
from solutions.distributed.layers import shard_model
from solutions.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from solutions.model.llama import LlamaForCausalLM
from solutions.worker.model_runner import ModelRunner

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class ExecutorWithExternalLauncher:
    """This rank's slice of the model and KV cache, in the group `torchrun` set up; the same `execute_model` as a
    `ModelRunner`."""

    def __init__(self, full_model: LlamaForCausalLM, tp_size: int, runner_kwargs: dict[str, Any]) -> None:
        missing = [name for name in LAUNCHER_ENV if name not in os.environ]
        if missing:
            raise ValueError(
                f"distributed_executor_backend='external_launcher' runs under torchrun, which sets {list(LAUNCHER_ENV)}; "
                f"{missing} are not set (start the script with `torchrun --nproc-per-node {tp_size} ...`)"
            )
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world_size != tp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size} must equal the number of processes torchrun started (WORLD_SIZE={world_size})"
            )
        device_type = full_model.model.embed_tokens.weight.device.type  # on GPUs: this rank's own (LLM chose it)
        if device_type == "cuda":  # NCCL; steps run eagerly (no CUDA graphs across ranks)
            runner_kwargs = {**runner_kwargs, "enforce_eager": True}
        init_tensor_parallel(rank, world_size, "env://", device=device_type)
        self.model_runner = ModelRunner(shard_model(full_model, rank, world_size), **runner_kwargs)
        self.kv_cache = self.model_runner.kv_cache  # this rank's heads of every block

    def execute_model(self, scheduler_output: SchedulerOutput, seconds: dict[str, float] | None = None) -> torch.Tensor:
        return self.model_runner.execute_model(scheduler_output, seconds)

    def shutdown(self) -> None:
        destroy_tensor_parallel()

"""The model in this process: one `ModelRunner`, no ranks. On the CPU it also keeps the forward pass's thread count
to the cores this process can get (`CpuThreadPolicy`), as vLLM's CPU worker binds its threads at start-up.

Where this lives in vLLM: `vllm/v1/executor/uniproc_executor.py` (`UniProcExecutor`).
"""

import time

import torch

from solutions.config import VllmConfig
from solutions.core.sched.output import SchedulerOutput
from solutions.executor.abstract import Executor
from solutions.worker.cpu_threads import CpuThreadPolicy
from solutions.worker.model_runner import ModelRunner


class UniProcExecutor(Executor):
    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        device_config = vllm_config.device_config
        self.cpu_threads = CpuThreadPolicy(device_config.cpu_threads) if device_config.device.type == "cpu" else None
        self.model_runner = ModelRunner.from_config(self.load_model(), vllm_config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        if self.cpu_threads is None:
            return self.model_runner.execute_model(scheduler_output)
        self.cpu_threads.before_step()
        start = time.perf_counter()
        logits = self.model_runner.execute_model(scheduler_output)
        self.cpu_threads.after_step(time.perf_counter() - start, sum(scheduler_output.num_scheduled_tokens))
        return logits

    def shutdown(self) -> None:
        if self.cpu_threads is not None:
            self.cpu_threads.restore()

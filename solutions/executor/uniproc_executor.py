"""The model in this process: one `ModelRunner`, no ranks.

Where this lives in vLLM: `vllm/v1/executor/uniproc_executor.py` (`UniProcExecutor`).
"""

from solutions.config import VllmConfig
from solutions.executor.abstract import Executor
from solutions.worker.model_runner import ModelRunner


class UniProcExecutor(Executor):
    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self.model_runner = ModelRunner.from_config(self.load_model(), vllm_config)

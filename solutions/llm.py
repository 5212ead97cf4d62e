"""The offline entry point, shaped like vLLM's `LLM` (`vllm/entrypoints/llm.py`).

    llm = LLM(model="smollm2-135m")
    outs = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=32))
    outs[0].outputs[0].text
"""

from collections.abc import Sequence as Seq

from solutions.core.block_manager import cdiv
from solutions.engine.llm_engine import LLMEngine
from solutions.model.loader import DEFAULT_MODEL, load_model, load_tokenizer
from solutions.outputs import RequestOutput
from solutions.sampling_params import SamplingParams

ATTENTION_BACKENDS = ("torch",)  # chapter 6 adds "triton"


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class LLM:
    """Load a model once; generate for batches of prompts.

    `num_kv_blocks=None` sizes the paged KV cache so that `max_num_seqs` sequences of `max_model_len` tokens
    all fit. `enable_prefix_caching` is accepted for vLLM compatibility; the block manager shares cached
    prefixes from chapter 4 on.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        attention_backend: str = "torch",
        seed: int = 0,
    ) -> None:
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.model = load_model(model)
        self.tokenizer = load_tokenizer(model)
        limit = self.model.config.max_position_embeddings
        max_model_len = min(limit, 2048) if max_model_len is None else _positive_int("max_model_len", max_model_len)
        if max_model_len > limit:
            raise ValueError(f"max_model_len must be at most the model's max_position_embeddings={limit}, got {max_model_len}")
        block_size = _positive_int("block_size", block_size)
        max_num_seqs = _positive_int("max_num_seqs", max_num_seqs)
        if num_kv_blocks is None:
            num_kv_blocks = max_num_seqs * cdiv(max_model_len, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.engine = LLMEngine(
            self.model,
            self.tokenizer,
            block_size=block_size,
            num_kv_blocks=_positive_int("num_kv_blocks", num_kv_blocks),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=_positive_int("max_num_batched_tokens", max_num_batched_tokens),
            max_model_len=max_model_len,
            seed=seed,
        )
        self._request_counter = 0

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); outputs come back in prompt order.

        Every request is validated before any is queued, so one bad prompt raises ValueError and leaves the
        engine exactly as it was.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts; give one or one per prompt")
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts; give one per prompt")
        first = self._request_counter
        requests = [
            self.engine.process_request(str(first + i), prompt, p, prio)
            for i, (prompt, p, prio) in enumerate(zip(prompts, params, priorities, strict=True))
        ]
        self._request_counter += len(requests)
        for request in requests:
            self.engine.add_request(request)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                finished[output.request_id] = output
        return [finished[r.request_id] for r in requests]

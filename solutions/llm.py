"""The offline entry point, shaped like vLLM's `LLM` (`vllm/entrypoints/llm.py`).

    llm = LLM(model="smollm2-135m")
    outs = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=32))
    outs[0].outputs[0].text
"""

import dataclasses
import os
from collections.abc import Sequence as Seq

import torch
from tqdm.auto import tqdm

from solutions.attention.paged import KVCache
from solutions.baselines.reserving_kv_cache_manager import reservation_policy
from solutions.beam_search import BeamSearchOutput, BeamSearchParams
from solutions.core.block_manager import cdiv
from solutions.core.sched.request_queue import SchedulingPolicy
from solutions.engine.llm_engine import LLMEngine
from solutions.executor.multiproc_executor import WORKER_MULTIPROC_METHODS
from solutions.model.loader import DEFAULT_MODEL, load_model, load_tokenizer
from solutions.outputs import RequestOutput
from solutions.sampling_params import RequestOutputKind, SamplingParams
from solutions.worker.model_runner import ATTENTION_BACKENDS

SCHEDULING_POLICIES = tuple(policy.value for policy in SchedulingPolicy)
DEVICES = ("cpu", "cuda")
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "external_launcher")  # workers this process starts; every rank by torchrun
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# CPU matmuls in float16 are emulated (several times slower than float32 here); bfloat16 runs natively.
CPU_DTYPES = ("float32", "bfloat16")


def resolve_device_and_dtype(device: str, dtype: str | torch.dtype) -> tuple[torch.device, torch.dtype]:
    """Check `device` and `dtype` once, at the boundary: ValueError naming the field and the allowed values."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device='cuda' but PyTorch sees no CUDA GPU (torch.cuda.is_available() is False; the pinned torch is the "
            "CPU build: install the CUDA build of the same version), or use device='cpu'"
        )
    names = {v: k for k, v in DTYPES.items()}
    name = names.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if device == "cpu" and name not in CPU_DTYPES:
        raise ValueError(
            f"dtype={name!r} is not supported on device='cpu'; on the CPU dtype must be one of {CPU_DTYPES}"
        )
    return torch.device(device), DTYPES[name]


def check_gpus_for_tensor_parallel(tp_size: int, executor_backend: str, multiproc_method: str) -> None:
    """Tensor parallelism on GPUs: one GPU per rank on this node, and workers that start fresh (CUDA does not
    survive a fork). ValueError naming the field otherwise."""
    if multiproc_method == "fork":
        raise ValueError(
            "worker_multiproc_method='fork' cannot start GPU workers (CUDA does not survive a fork): use 'spawn' "
            "with device='cuda'"
        )
    if executor_backend == "mp" and torch.cuda.device_count() < tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} needs {tp_size} GPUs on this machine, one per rank; "
            f"{torch.cuda.device_count()} are visible"
        )


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _as_prompt_list(prompts: str | list[int] | Seq[str | list[int]]) -> list[str | list[int]]:
    """One prompt (a string, or a list of token ids) or several, as a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


class LLM:
    """Load a model once; generate for batches of prompts through the engine (`self.llm_engine`).

    `num_kv_blocks=None` sizes the paged KV cache so that `max_num_seqs` sequences of `max_model_len` tokens
    all fit, but within `kv_cache_memory_bytes` (as vLLM's option of that name; vLLM's default instead takes a
    fraction of the GPU's free memory), counted in `dtype`'s bytes. `long_prefill_token_threshold=None` lets
    one prompt take the whole token budget of a step.

    `device` ("cpu" or "cuda") and `dtype` ("float32", "bfloat16", "float16"; the CPU takes the first two) say
    where the weights, the KV cache and the activations live. `attention_backend` picks who attends: "torch"
    (the default, chapters 3 and 5: plain PyTorch, always eager), "inductor" (the CPU's fast path: decode
    attention that reads the paged cache in place, and the whole forward pass compiled with `torch.compile` at
    start-up, about a minute) or "triton" (chapter 6's kernels: on a GPU they compile natively and pure-decode
    steps replay CUDA graphs, one per batch-size bucket). `enforce_eager=True` turns the compiled forward pass
    and the CUDA graphs off, as in vLLM.

    `kv_reservation` ("max", "pow2", "oracle") turns the engine into chapter 2's Orca baselines for comparisons:
    each request is admitted only with blocks for its whole reserved length, taken at once
    (`solutions/baselines/reserving_kv_cache_manager.py`). None, the default, is paged allocation.

    `tensor_parallel_size=N` splits the model over N processes on this machine, each holding some of every
    layer's heads and hidden units and its own heads' KV cache; this process is rank 0 and starts the others
    (`solutions/executor/multiproc_executor.py`; `worker_multiproc_method="fork"` copies this process instead of
    starting fresh interpreters). With `distributed_executor_backend="external_launcher"` the script runs under
    `torchrun --nproc-per-node N`, every rank builds the same `LLM` and gets the same outputs
    (`solutions/executor/external_launcher.py`). Ranks talk through gloo on the CPU and NCCL on GPUs (one GPU per
    rank, rank r on cuda:r; their steps run eagerly, without CUDA graphs), with the "torch" or "triton" backend.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int = 2**30,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        long_prefill_token_threshold: int | None = None,
        enable_prefix_caching: bool = True,
        scheduling_policy: str = "fcfs",
        attention_backend: str = "torch",
        seed: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
        enforce_eager: bool = False,
        kv_reservation: str | None = None,
        tensor_parallel_size: int = 1,
        distributed_executor_backend: str = "mp",
        worker_multiproc_method: str = "spawn",
    ) -> None:
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {scheduling_policy!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        block_size = _positive_int("block_size", block_size)
        max_num_seqs = _positive_int("max_num_seqs", max_num_seqs)
        max_num_batched_tokens = _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if long_prefill_token_threshold is not None:
            _positive_int("long_prefill_token_threshold", long_prefill_token_threshold)
        if num_kv_blocks is not None:
            _positive_int("num_kv_blocks", num_kv_blocks)
        _positive_int("kv_cache_memory_bytes", kv_cache_memory_bytes)
        if max_model_len is not None:
            _positive_int("max_model_len", max_model_len)
        if not isinstance(enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {enforce_eager!r}")
        tensor_parallel_size = _positive_int("tensor_parallel_size", tensor_parallel_size)
        if tensor_parallel_size > 1 and attention_backend == "inductor":
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} runs with attention_backend 'torch' or 'triton'; the "
                "inductor fast path compiles one process's whole model, got attention_backend='inductor'"
            )
        if distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {DISTRIBUTED_EXECUTOR_BACKENDS}, got {distributed_executor_backend!r}"
            )
        if worker_multiproc_method not in WORKER_MULTIPROC_METHODS:
            raise ValueError(f"worker_multiproc_method must be one of {WORKER_MULTIPROC_METHODS}, got {worker_multiproc_method!r}")
        if tensor_parallel_size > 1 and device == "cuda":
            check_gpus_for_tensor_parallel(tensor_parallel_size, distributed_executor_backend, worker_multiproc_method)
        if kv_reservation is not None:
            reservation_policy(kv_reservation)  # ValueError naming the field, before the model loads
        self.device, self.dtype = resolve_device_and_dtype(device, dtype)
        if attention_backend == "inductor" and self.device.type != "cpu":
            raise ValueError(
                "attention_backend='inductor' is the CPU's fast path (device='cpu'); on a GPU use "
                "attention_backend='triton'"
            )
        if attention_backend == "triton" and self.device.type == "cpu":
            import kernels

            if not kernels.interpreted():
                raise ValueError(
                    "attention_backend='triton' with device='cpu' needs Triton's interpreter, which is off here: a "
                    "GPU is present, so the kernels compile for it. Use device='cuda', or attention_backend='torch'"
                )
        if tensor_parallel_size > 1 and self.device.type == "cuda":
            # One GPU per rank: rank r on cuda:r (under torchrun, this node's LOCAL_RANK); NCCL joins them.
            local_rank = int(os.environ.get("LOCAL_RANK", 0)) if distributed_executor_backend == "external_launcher" else 0
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        self.model = load_model(model, device=self.device, dtype=self.dtype)
        self.tokenizer = load_tokenizer(model)
        limit = self.model.config.max_position_embeddings
        max_model_len = min(limit, 2048) if max_model_len is None else max_model_len
        if max_model_len > limit:
            raise ValueError(f"max_model_len must be at most the model's max_position_embeddings={limit}, got {max_model_len}")
        if num_kv_blocks is None:
            bytes_per_block = KVCache.bytes_per_block(self.model.config, block_size, self.dtype)
            num_kv_blocks = max(1, min(max_num_seqs * cdiv(max_model_len, block_size), kv_cache_memory_bytes // bytes_per_block))
        self.llm_engine = LLMEngine(
            self.model,
            self.tokenizer,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=long_prefill_token_threshold or max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            scheduling_policy=SchedulingPolicy(scheduling_policy),
            attention_backend=attention_backend,
            seed=seed,
            enforce_eager=enforce_eager,
            kv_reservation=kv_reservation,
            tensor_parallel_size=tensor_parallel_size,
            model_name=model,
            distributed_executor_backend=distributed_executor_backend,
            worker_multiproc_method=worker_multiproc_method,
        )
        self._request_counter = 0

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        priority: Seq[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); outputs come back in prompt order.

        Every request is validated before any is queued, so one bad prompt raises ValueError and leaves the
        engine exactly as it was.
        """
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts; give one or one per prompt")
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts; give one per prompt")
        engine = self.llm_engine
        if engine.scheduler.policy is not SchedulingPolicy.PRIORITY and any(priorities):
            raise ValueError("priority needs LLM(scheduling_policy='priority'); under 'fcfs' leave it unset")
        final_only = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        first = self._request_counter
        requests = [
            engine.process_request(str(first + i), prompt, p, prio)
            for i, (prompt, p, prio) in enumerate(zip(prompts, final_only, priorities, strict=True))
        ]
        self._request_counter += len(requests)
        for request in requests:
            engine.add_request(request)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[r.request_id] for r in requests]

    def chat(
        self, messages: list[dict[str, str]] | list[list[dict[str, str]]], sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (`[{"role": "user", "content": ...}, ...]`), formatted with the
        model's chat template."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError("chat needs a tokenizer with a chat template; this model has none, use generate")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: Seq[str | list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """The `params.beam_width` best continuations of each prompt, best first (one `BeamSearchOutput` each).

        Runs outside the scheduler, as vLLM's does, through the engine's `beam_search`: beams fork and free
        sequences that share blocks (see `solutions/beam_search.py`). The engine must be idle.
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        beams = self.llm_engine.beam_search(_as_prompt_list(prompts), params)
        for sequences in beams:
            for seq in sequences:
                if self.tokenizer is not None:
                    seq.text = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        return [BeamSearchOutput(sequences) for sequences in beams]

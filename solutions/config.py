"""The engine's configuration: one object, built once by `EngineArgs.create_engine_config()`, handed to every layer.

Every option has been checked and resolved by the time a `VllmConfig` exists (device, dtype, context limit, KV
cache size in blocks, prefill cap), so no layer below re-reads a keyword or repeats a check; a part whose values
need nothing resolved checks them itself in `__post_init__` (`ParallelConfig`, `SpeculativeConfig`). The parts
follow vLLM's split, so each layer takes the parts it needs:

    model_config      which checkpoint, its architecture (`hf_config`), dtype, context limit, seed, who attends
    cache_config      the KV cache: block size, how many blocks, prefix caching, which KV cache manager
    scheduler_config  one step's limits: sequences, tokens, prefill chunk; FCFS or priority
    parallel_config   tensor parallelism: how many ranks, who starts them; data parallelism: how many replicas
    device_config     where the weights, the cache and the activations live
    speculative_config  speculative decoding: how drafts are proposed, how many per step (None: off)
    structured_outputs_config  how constrained outputs are compiled: whitespace in JSON or none

The config is plain data and pickles, so the engine core's process and the workers build themselves from it.

Where this lives in vLLM: `vllm/config/` (`VllmConfig`, `ModelConfig`, `CacheConfig`, `SchedulerConfig`,
`ParallelConfig`, `DeviceConfig`, `SpeculativeConfig` in `vllm/config/speculative.py`, `StructuredOutputsConfig` in
`vllm/config/structured_outputs.py`).
"""

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, Self, get_args

import torch

from solutions.exceptions import ParameterError, check_one_of, check_positive_int
from solutions.model import config as hf

# The admission order, named as the flag spells it; the scheduler turns it into its queue (`SchedulingPolicy`).
SchedulerPolicy = Literal["fcfs", "priority"]
# Which replica takes a new sequence under data parallelism (chapter 12); `core/sched/placement.py` builds it.
DataParallelPlacement = Literal["round_robin", "least_loaded", "prefix", "approx_prefix"]
DistributedExecutorBackend = Literal["mp", "external_launcher"]  # workers this process starts; every rank by torchrun
WorkerMultiprocMethod = Literal["spawn", "fork"]
PAGED_KV_CACHE_MANAGER = "solutions.core.kv_cache_manager.KVCacheManager"


@dataclass(frozen=True)
class ModelConfig:
    """The model and how it runs. `hf_config` is the checkpoint's architecture (`solutions/model/config.py`)."""

    model: str  # "smollm2-135m" or a local checkpoint folder
    hf_config: hf.ModelConfig
    dtype: torch.dtype
    max_model_len: int  # prompt + output tokens of one sequence, at most
    seed: int  # unseeded requests draw from generators seeded by this and their arrival
    attention_backend: str  # "torch", "inductor" (the CPU's fast path) or "triton" (chapter 6's kernels)
    enforce_eager: bool  # no compiled forward pass, no CUDA graphs

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.hf_config.eos_token_id


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache. `kv_cache_manager_cls` names the manager by its qualified name, as vLLM names its
    worker class: the paged one, or chapter 2's reserving baseline with `kv_reservation` set. Host memory behind it
    (chapter 11): a swap pool for preemption by swapping, and a second tier for the prefix cache."""

    block_size: int  # tokens per KV block
    num_kv_blocks: int  # blocks in the pool (resolved from the memory budget when not given)
    enable_prefix_caching: bool
    kv_reservation: str | None = None  # None: paged; "max" / "pow2" / "oracle": Orca's whole-length admission
    kv_cache_manager_cls: str = PAGED_KV_CACHE_MANAGER
    kv_cache_manager_kwargs: dict[str, Any] = field(default_factory=dict)  # beyond (blocks, block size, caching)
    preemption_mode: str = "recompute"  # or "swap" (chapter 11): preempted groups go to a host pool of
    num_swap_blocks: int = 0  # blocks (from `swap_space`)
    num_offload_blocks: int = 0  # the prefix cache's host tier, in blocks (from `kv_offloading_size`; 0: off)

    @property
    def swapping(self) -> bool:
        """Does preemption swap groups out to a host pool of `num_swap_blocks`? Decided here once: the KV cache
        manager's swap pool and the runner's host cache are made from it."""
        return self.preemption_mode == "swap"


@dataclass(frozen=True)
class SchedulerConfig:
    """The limits of one step and the admission order."""

    max_num_seqs: int  # sequences running at once, the samples of an n > 1 request included
    max_num_batched_tokens: int  # the token budget of one step
    max_model_len: int
    long_prefill_token_threshold: int  # at most this many tokens of one sequence per step (chunked prefill)
    policy: SchedulerPolicy


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: `tensor_parallel_size` ranks, started by this process ("mp", with
    `worker_multiproc_method`) or by torchrun ("external_launcher"). Data parallelism: `data_parallel_size` whole
    replicas, started by this process, each with the cache and step limits the other configs give one engine."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: DistributedExecutorBackend = "mp"
    worker_multiproc_method: WorkerMultiprocMethod = "spawn"
    data_parallel_size: int = 1  # model replicas, each a worker process with its own KV block pool
    data_parallel_placement: DataParallelPlacement = "prefix"  # which replica takes a new sequence

    def __post_init__(self) -> None:
        """ParameterError naming the field: each value, then what data parallelism does not run with (each replica
        is one whole model in one worker process: no tensor parallelism inside it, no torchrun around it)."""
        for name, kind in (
            ("distributed_executor_backend", DistributedExecutorBackend),
            ("worker_multiproc_method", WorkerMultiprocMethod), ("data_parallel_placement", DataParallelPlacement),
        ):
            check_one_of(name, getattr(self, name), get_args(kind))
        for name in ("tensor_parallel_size", "data_parallel_size"):
            check_positive_int(name, getattr(self, name))
        if not self.data_parallel:
            return
        for name, conflict, what in (
            ("tensor_parallel_size", self.tensor_parallel_size != 1,
             f"tensor_parallel_size={self.tensor_parallel_size}"),
            ("distributed_executor_backend", self.distributed_executor_backend != "mp",
             f"distributed_executor_backend={self.distributed_executor_backend!r} (this process starts the replicas)"),
        ):
            if conflict:
                raise ParameterError(f"data_parallel_size={self.data_parallel_size} does not run with {what}", name)

    @property
    def data_parallel(self) -> bool:
        """Is data parallelism on (more than one replica)? Asked here only, by every layer that branches on it."""
        return self.data_parallel_size > 1


@dataclass(frozen=True)
class DeviceConfig:
    device: torch.device  # on GPUs under tensor parallelism, this rank's own (cuda:rank)
    cpu_threads: int | None = None  # the CPU forward pass's torch threads; None: the free cores, step by step


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each step, every decoding sequence proposes up to `num_speculative_tokens` draft tokens,
    which the target model verifies in its next forward pass. `method` "ngram" (prompt lookup) copies what followed
    the longest earlier occurrence of the context's last n tokens, n in [`prompt_lookup_min`, `prompt_lookup_max`];
    "draft_model" drafts with the target's own first `num_draft_layers` layers (ours; vLLM's draft model is a separate
    checkpoint). Each method's own fields (`METHOD_FIELDS`) are None under the other. Built from the engine's
    `speculative_config` option (`from_options`), so a bad value is a ParameterError naming the key:
    `speculative_config['num_speculative_tokens'] must be an int >= 1, got 0`."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    num_draft_layers: int | None = None  # in [1, num_hidden_layers - 1]: the whole model would be no cheaper

    OPTION: ClassVar[str] = "speculative_config"  # the engine option these come from, named in every error
    METHOD_FIELDS: ClassVar[dict[str, tuple[str, ...]]] = {
        "ngram": ("prompt_lookup_min", "prompt_lookup_max"), "draft_model": ("num_draft_layers",),
    }

    def __post_init__(self) -> None:
        check_one_of(f"{self.OPTION}['method']", self.method, tuple(self.METHOD_FIELDS), parameter=self.OPTION)
        own = self.method_keys(self.method)
        other = [key for key in self.method_keys(None) if key not in own and getattr(self, key) is not None]
        self.refuse_keys(self.method, other)
        for key in own[1:]:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParameterError(f"{self.OPTION}[{key!r}] must be an int >= 1, got {value!r}", self.OPTION)
        if self.method == "ngram" and self.prompt_lookup_min > self.prompt_lookup_max:
            raise ParameterError(f"{self.OPTION}['prompt_lookup_min'] must be at most prompt_lookup_max="
                                 f"{self.prompt_lookup_max}, got {self.prompt_lookup_min}", self.OPTION)

    @classmethod
    def method_keys(cls, method: str | None) -> tuple[str, ...]:
        """The keys of `method`'s config ("method" first); None: every key of every method."""
        own = [name for m, names in cls.METHOD_FIELDS.items() if method in (m, None) for name in names]
        return ("method", "num_speculative_tokens", *own)

    @classmethod
    def from_options(cls, options: object, num_hidden_layers: int | None = None) -> Self:
        """The engine's `speculative_config` dict, with vLLM's defaults: prompt_lookup_min and prompt_lookup_max
        default to each other, and both to 5. Given the target's `num_hidden_layers`, `num_draft_layers` must
        leave the draft cheaper than the target: at most `num_hidden_layers` - 1."""
        if not isinstance(options, dict):
            raise ParameterError(f"{cls.OPTION} must be a dict (or None), got {type(options).__name__}", cls.OPTION)
        values = {f.name: options.get(f.name) for f in fields(cls)}
        if values["method"] in cls.METHOD_FIELDS:  # else the constructor names the method's allowed values
            cls.refuse_keys(values["method"], sorted(set(options) - set(values)))
        if values["method"] == "ngram":
            lookup_min, lookup_max = values["prompt_lookup_min"], values["prompt_lookup_max"]
            lookup_min = lookup_min if lookup_min is not None else lookup_max if lookup_max is not None else 5
            lookup_max = lookup_max if lookup_max is not None else lookup_min
            values.update(prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max)
        config = cls(**values)
        layers = config.num_draft_layers
        if num_hidden_layers is not None and layers is not None and layers >= num_hidden_layers:
            raise ParameterError(f"{cls.OPTION}['num_draft_layers'] must be in [1, {num_hidden_layers - 1}] (the model "
                                 f"has {num_hidden_layers} layers), got {layers}", cls.OPTION)
        return config

    @classmethod
    def refuse_keys(cls, method: str, unknown: list[str]) -> None:
        """Keys given that `method` does not read are a mistake (a misspelling, another method's key)."""
        if unknown:
            raise ParameterError(f"{cls.OPTION} has unknown keys {unknown} for method {method!r}; its keys are "
                                 f"{cls.method_keys(method)}", cls.OPTION)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """How the engine compiles constraints. `disable_any_whitespace`: JSON outputs have no whitespace between
    tokens at all (compact separators); by default a bounded run is allowed (`backend_guidance.py`)."""

    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.disable_any_whitespace, bool):
            raise ParameterError(
                f"disable_any_whitespace must be True or False, got {self.disable_any_whitespace!r}",
                "disable_any_whitespace",
            )


@dataclass(frozen=True)
class VllmConfig:
    """Everything the engine was asked for, checked and resolved."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    speculative_config: SpeculativeConfig | None = None
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)

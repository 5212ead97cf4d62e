"""The engine's configuration: one object, built once by `EngineArgs.create_engine_config()`, handed to every layer.

Every option has been checked and resolved by the time a `VllmConfig` exists (the device and dtype, the context
limit, the KV cache's size in blocks, the per-step prefill cap), so no layer below re-reads a keyword or repeats
a check. The parts follow vLLM's split, so each layer takes the parts it needs:

    model_config      which checkpoint, its architecture (`hf_config`), dtype, context limit, seed, who attends
    cache_config      the KV cache: block size, how many blocks, prefix caching, which KV cache manager
    scheduler_config  one step's limits: sequences, tokens, prefill chunk; FCFS or priority
    parallel_config   tensor parallelism: how many ranks, who starts them; data parallelism: how many replicas
    device_config     where the weights, the cache and the activations live
    speculative_config  speculative decoding: how drafts are proposed, how many per step (None: off)

The config is plain data and pickles, so the engine core's process and tensor-parallel workers build themselves
from the same object.

Where this lives in vLLM: `vllm/config/` (`VllmConfig`, `ModelConfig`, `CacheConfig`, `SchedulerConfig`,
`ParallelConfig`, `DeviceConfig`, `SpeculativeConfig` in `vllm/config/speculative.py`).
"""

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from solutions.model import config as hf

# The admission order, named as the flag spells it; the scheduler turns it into its queue (`SchedulingPolicy`).
SchedulerPolicy = Literal["fcfs", "priority"]
# Which replica takes a new sequence under data parallelism (chapter 12); `core/sched/placement.py` builds it.
DataParallelPlacement = Literal["round_robin", "least_loaded", "prefix", "approx_prefix"]
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
    distributed_executor_backend: str = "mp"
    worker_multiproc_method: str = "spawn"
    data_parallel_size: int = 1  # model replicas, each a worker process with its own KV block pool
    data_parallel_placement: DataParallelPlacement = "prefix"  # which replica takes a new sequence


@dataclass(frozen=True)
class DeviceConfig:
    device: torch.device  # on GPUs under tensor parallelism, this rank's own (cuda:rank)
    cpu_threads: int | None = None  # the CPU forward pass's torch threads; None: the free cores, step by step


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each step, every decoding sequence proposes up to `num_speculative_tokens` draft
    tokens, and the target model verifies them in its next forward pass. `method` "ngram" (prompt lookup) copies
    the tokens that followed the longest earlier occurrence of the context's last n tokens, n in
    [`prompt_lookup_min`, `prompt_lookup_max`]; "draft_model" drafts greedily with the target's own first
    `num_draft_layers` layers, its final norm and LM head (self-speculation; `num_draft_layers` is ours, vLLM's
    draft model is a separate checkpoint). Each method's own fields are None under the other."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    num_draft_layers: int | None = None  # in [1, num_hidden_layers - 1]: the whole model would be no cheaper


@dataclass(frozen=True)
class VllmConfig:
    """Everything the engine was asked for, checked and resolved."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    speculative_config: SpeculativeConfig | None = None

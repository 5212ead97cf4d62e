"""`EngineArgs`: every engine option, declared once — its default, its check, its help, its command-line flag.

    args = EngineArgs(model="smollm2-135m", block_size=16)      # a bad value: ValueError naming the field
    config = args.create_engine_config()                         # resolved: device, dtype, max_model_len, blocks

`LLM(**kwargs)` is `EngineArgs(**kwargs)`; the server's and `python -m solutions`' flags are `add_cli_args`, read
back by `from_cli_args`. Checks that need nothing but the values run when the object is made (so a typo fails
before a model loads); `create_engine_config()` then resolves what depends on the machine and the checkpoint.

Where this lives in vLLM: `vllm/engine/arg_utils.py` (`EngineArgs`, `AsyncEngineArgs`, `add_cli_args`,
`from_cli_args`, `create_engine_config`).
"""

import argparse
import dataclasses
import json
import os
import types
from dataclasses import dataclass, field
from typing import Any, Self, get_args

import torch

from solutions.attention.registry import ATTENTION_BACKENDS, get_attention_backend
from solutions.config import (
    CacheConfig,
    DataParallelPlacement,
    DeviceConfig,
    DistributedExecutorBackend,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SchedulerPolicy,
    SpeculativeConfig,
    StructuredOutputsConfig,
    VllmConfig,
    WorkerMultiprocMethod,
)
from solutions.exceptions import ParameterError, check_one_of, check_positive_int
from solutions.model.config import ModelConfig as HFConfig
from solutions.model.loader import DEFAULT_MODEL, resolve_model
from solutions.utils.math_utils import cdiv

SCHEDULING_POLICIES = get_args(SchedulerPolicy)
PLACEMENT_POLICIES = get_args(DataParallelPlacement)
DEVICES = ("cpu", "cuda")
DISTRIBUTED_EXECUTOR_BACKENDS = get_args(DistributedExecutorBackend)
WORKER_MULTIPROC_METHODS = get_args(WorkerMultiprocMethod)
KV_RESERVATIONS = ("max", "pow2", "oracle")  # chapter 2's Orca baselines (the paper's Max, Pow2, Oracle)
RESERVING_KV_CACHE_MANAGER = "solutions.baselines.reserving_kv_cache_manager.ReservingKVCacheManager"
ENGINE_CORE_KINDS = ("process", "thread")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# CPU matmuls in float16 are emulated (several times slower than float32 here); bfloat16 runs natively.
CPU_DTYPES = ("float32", "bfloat16")
SPECULATIVE_KEYS = {method: SpeculativeConfig.method_keys(method) for method in SpeculativeConfig.METHOD_FIELDS}
PREEMPTION_MODES = ("recompute", "swap")  # vLLM v0's; chapter 11
KV_OFFLOADING_BACKENDS = ("native",)  # vLLM v1's own CPU tier (its "lmcache" is another library)


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class EngineArgs:
    """The engine's options (each field's help says what it does). `num_kv_blocks=None` sizes the paged KV cache so
    that `max_num_seqs` sequences of `max_model_len` tokens fit within `kv_cache_memory_bytes` (vLLM's default takes a
    fraction of the GPU's free memory instead). `attention_backend`: "torch" (eager PyTorch), "inductor" (the CPU's
    fast path: paged decode attention in place, the forward pass compiled at start-up) or "triton" (chapter 6's
    kernels; CUDA graphs for pure-decode steps on a GPU). `kv_reservation` turns the engine into chapter 2's Orca
    baselines. `tensor_parallel_size=N` splits the model over N processes (chapter 9); `data_parallel_size=N` runs N
    whole replicas, one scheduler placing each sequence (`data_parallel_placement`, chapter 12).
    `speculative_config`, as vLLM's keyword: `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max":
    4}` or `{"method": "draft_model", "num_speculative_tokens": 4, "num_draft_layers": 8}`. Chapter 11:
    `preemption_mode="swap"` swaps preempted groups to a host pool of `swap_space` GiB (vLLM v0's names);
    `kv_offloading_size` GiB of host memory keep the blocks the prefix cache evicts (vLLM v1's)."""

    model: str = field(default=DEFAULT_MODEL, metadata=_help(f"{DEFAULT_MODEL} or a local Hugging Face folder"))
    block_size: int = field(default=16, metadata=_help("tokens per KV block"))
    num_kv_blocks: int | None = field(default=None, metadata=_help("KV blocks in the pool (default: sized)"))
    kv_cache_memory_bytes: int = field(default=2**30, metadata=_help("the KV cache's budget when sized"))
    max_num_seqs: int = field(default=64, metadata=_help("sequences running at once"))
    max_num_batched_tokens: int = field(default=2048, metadata=_help("the token budget of one step"))
    max_model_len: int | None = field(default=None, metadata=_help("context limit (default: the model's, <= 2048)"))
    long_prefill_token_threshold: int | None = field(default=None, metadata=_help("prefill chunk cap per sequence"))
    enable_prefix_caching: bool = field(default=True, metadata=_help("reuse cached blocks of equal prefixes"))
    scheduling_policy: str = field(default="fcfs", metadata=_help(f"one of {SCHEDULING_POLICIES}"))
    attention_backend: str = field(default="torch", metadata=_help(f"one of {ATTENTION_BACKENDS}"))
    seed: int = field(default=0, metadata=_help("seeds the generators of unseeded requests"))
    device: str = field(default="cpu", metadata=_help(f"one of {DEVICES}"))
    dtype: str = field(default="float32", metadata=_help(f"one of {tuple(DTYPES)} (the CPU: {CPU_DTYPES})"))
    enforce_eager: bool = field(default=False, metadata=_help("no compiled forward pass, no CUDA graphs"))
    cpu_threads: int | None = field(
        default=None, metadata=_help("torch threads of the CPU forward pass (default: the cores others leave free)")
    )
    kv_reservation: str | None = field(default=None, metadata=_help(f"Orca's baselines: one of {KV_RESERVATIONS}"))
    tensor_parallel_size: int = field(default=1, metadata=_help("ranks the model is split over"))
    distributed_executor_backend: str = field(default="mp", metadata=_help(f"one of {DISTRIBUTED_EXECUTOR_BACKENDS}"))
    worker_multiproc_method: str = field(default="spawn", metadata=_help(f"one of {WORKER_MULTIPROC_METHODS}"))
    data_parallel_size: int = field(default=1, metadata=_help("model replicas, each with its own KV block pool"))
    data_parallel_placement: str = field(
        default="prefix", metadata=_help(f"which replica a new sequence runs on: one of {PLACEMENT_POLICIES}")
    )
    speculative_config: dict | None = field(
        default=None,
        metadata=_help(f"speculative decoding as JSON, each method's keys {SPECULATIVE_KEYS} (default: off)"),
    )
    preemption_mode: str = field(default="recompute", metadata=_help(f"one of {PREEMPTION_MODES}"))
    swap_space: float = field(default=4.0, metadata=_help("GiB of host memory for swapped-out blocks (mode 'swap')"))
    kv_offloading_size: float | None = field(
        default=None, metadata=_help("GiB of host memory for the prefix cache's evicted blocks (default: off)")
    )
    kv_offloading_backend: str = field(default="native", metadata=_help(f"one of {KV_OFFLOADING_BACKENDS}"))
    disable_any_whitespace: bool = field(
        default=False, metadata=_help("structured outputs: JSON with no whitespace between tokens (default: bounded)")
    )

    def __post_init__(self) -> None:
        """The checks that need nothing but the values: ParameterError (a ValueError) naming the field."""
        if isinstance(self.dtype, torch.dtype):  # accepted as in vLLM: torch.bfloat16 for "bfloat16"
            self.dtype = {v: k for k, v in DTYPES.items()}.get(self.dtype, str(self.dtype))
        for name, allowed in (
            ("scheduling_policy", SCHEDULING_POLICIES), ("device", DEVICES), ("dtype", tuple(DTYPES)),
            ("preemption_mode", PREEMPTION_MODES), ("kv_offloading_backend", KV_OFFLOADING_BACKENDS),
        ):
            check_one_of(name, getattr(self, name), allowed)
        if self.kv_reservation is not None:
            check_one_of("kv_reservation", self.kv_reservation, KV_RESERVATIONS, "or None")
        for name in ("enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ParameterError(f"{name} must be True or False, got {getattr(self, name)!r}", name)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ParameterError(f"seed must be an int, got {self.seed!r}", "seed")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            check_positive_int(name, getattr(self, name))
        for name in ("num_kv_blocks", "max_model_len", "long_prefill_token_threshold", "cpu_threads"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        parallel = self._parallel_config()  # its own checks
        self._structured_outputs_config()  # its own check
        self._check_attention_backend()
        if self.dtype not in CPU_DTYPES and self.device == "cpu":
            raise ParameterError(
                f"dtype={self.dtype!r} is not supported on device='cpu'; on the CPU dtype must be one of {CPU_DTYPES}",
                "dtype",
            )
        if self.speculative_config is not None:
            self._check_speculative_config()
        self._check_host_memory()
        if parallel.data_parallel:
            self._check_data_parallel()

    def _check_attention_backend(self) -> None:
        """A registered name (`registry.py`), and what its class says it runs with (`AttentionBackend`): the device,
        tensor parallelism."""
        backend = get_attention_backend(self.attention_backend)
        if self.tensor_parallel_size > 1 and not backend.supports_tensor_parallel:
            able = [name for name in ATTENTION_BACKENDS if get_attention_backend(name).supports_tensor_parallel]
            raise ParameterError(
                f"tensor_parallel_size={self.tensor_parallel_size} runs with attention_backend {_either(able)}; got "
                f"attention_backend={self.attention_backend!r}, one process's backend ({backend.__name__}: "
                "supports_tensor_parallel=False)", "tensor_parallel_size",
            )
        if self.device not in backend.devices:
            able = [name for name in ATTENTION_BACKENDS if self.device in get_attention_backend(name).devices]
            raise ParameterError(
                f"attention_backend={self.attention_backend!r} runs on device {_either(backend.devices)}: on "
                f"device={self.device!r} use attention_backend {_either(able)}", "attention_backend",
            )

    def _check_data_parallel(self) -> None:
        """What data parallelism does not run with beyond `ParallelConfig`'s own (ParameterError naming the
        field): speculative decoding and the reserving baselines run on one replica."""
        for name, conflict, what in (
            ("speculative_config", self.speculative_config is not None, "speculative_config"),
            ("kv_reservation", self.kv_reservation is not None, f"kv_reservation={self.kv_reservation!r}"),
        ):
            if conflict:
                raise ParameterError(f"data_parallel_size={self.data_parallel_size} does not run with {what}", name)

    def _parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            self.tensor_parallel_size, self.distributed_executor_backend, self.worker_multiproc_method,
            self.data_parallel_size, self.data_parallel_placement,
        )

    def _structured_outputs_config(self) -> StructuredOutputsConfig:
        return StructuredOutputsConfig(self.disable_any_whitespace)

    def _check_host_memory(self) -> None:
        """Chapter 11's sizes, and what they do not run with (ParameterError naming the field)."""
        for name in ("swap_space", "kv_offloading_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0):
                raise ParameterError(f"{name} must be a number of GiB >= 0, got {value!r}", name)
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise ParameterError(
                "preemption_mode='swap' needs a swap pool: swap_space must be > 0 GiB, got 0", "swap_space"
            )
        if self.kv_reservation is not None and (self.preemption_mode == "swap" or self.kv_offloading_size):
            raise ParameterError(
                "preemption_mode='swap' and kv_offloading_size do not run with kv_reservation (the reserving baseline "
                f"never preempts), got kv_reservation={self.kv_reservation!r}", "kv_reservation",
            )
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ParameterError(
                "kv_offloading_size keeps evicted blocks by their prefix hash: it needs enable_prefix_caching=True",
                "kv_offloading_size",
            )

    def _speculative_config(self, num_hidden_layers: int | None = None) -> SpeculativeConfig | None:
        """`speculative_config` as a `SpeculativeConfig` (whose checks name the key at fault), and what it does
        not run with: a draft model under tensor parallelism."""
        if self.speculative_config is None:
            return None
        config = SpeculativeConfig.from_options(self.speculative_config, num_hidden_layers)
        if config.method == "draft_model" and self.tensor_parallel_size > 1:
            raise ParameterError(
                "speculative_config['method'] 'draft_model' runs with tensor_parallel_size=1 only (rank 0 drafts "
                "alone, and the draft's layers are its shards of the target's, whose collectives the other ranks "
                f"would not join), got tensor_parallel_size={self.tensor_parallel_size}", "speculative_config",
            )
        return config

    def _check_speculative_config(self) -> None:
        """Its keys, and the options it does not run with yet (ParameterError naming both)."""
        self._speculative_config()
        if self.kv_reservation is not None:
            raise ParameterError(
                "speculative_config does not run with kv_reservation (the reserving baseline allocates whole "
                f"lengths up front, not draft slots), got kv_reservation={self.kv_reservation!r}", "speculative_config",
            )

    # --- resolution ----------------------------------------------------------------------------------------------

    def create_engine_config(self) -> VllmConfig:
        """Resolve what depends on the machine and the checkpoint (reads its config.json, not its weights)."""
        device = self._resolve_device()
        hf_config = HFConfig.from_folder(resolve_model(self.model))
        limit = hf_config.max_position_embeddings
        max_model_len = min(limit, 2048) if self.max_model_len is None else self.max_model_len
        if max_model_len > limit:
            raise ParameterError(
                f"max_model_len must be at most the model's max_position_embeddings={limit}, got {max_model_len}",
                "max_model_len",
            )
        dtype = DTYPES[self.dtype]
        num_kv_blocks = self.num_kv_blocks
        if num_kv_blocks is None:
            from solutions.attention.paged import KVCache

            bytes_per_block = KVCache.bytes_per_block(hf_config, self.block_size, dtype)
            wanted = self.max_num_seqs * cdiv(max_model_len, self.block_size)
            num_kv_blocks = max(1, min(wanted, self.kv_cache_memory_bytes // bytes_per_block))
        num_swap_blocks, num_offload_blocks = self._host_blocks(hf_config, dtype)
        reserving = self.kv_reservation is not None
        return VllmConfig(
            model_config=ModelConfig(
                self.model, hf_config, dtype, max_model_len, self.seed, self.attention_backend, self.enforce_eager
            ),
            cache_config=CacheConfig(
                self.block_size, num_kv_blocks, self.enable_prefix_caching, self.kv_reservation,
                RESERVING_KV_CACHE_MANAGER if reserving else CacheConfig.kv_cache_manager_cls,
                dict(kv_reservation=self.kv_reservation, max_model_len=max_model_len) if reserving else {},
                self.preemption_mode, num_swap_blocks, num_offload_blocks,
            ),
            scheduler_config=SchedulerConfig(
                self.max_num_seqs, self.max_num_batched_tokens, max_model_len,
                self.long_prefill_token_threshold or self.max_num_batched_tokens,
                self.scheduling_policy,
            ),
            parallel_config=self._parallel_config(),
            device_config=DeviceConfig(device, self.cpu_threads),
            speculative_config=self._speculative_config(hf_config.num_hidden_layers),
            structured_outputs_config=self._structured_outputs_config(),
        )

    def _host_blocks(self, hf_config: HFConfig, dtype: torch.dtype) -> tuple[int, int]:
        """(swap pool, host tier) sizes in blocks, from their GiB. Each rank of tensor parallelism holds its own shard
        of each block, so the GiB are per rank. A swap pool of 0 blocks with preemption_mode='swap' is refused, as is
        a host tier of 0 blocks when one was asked for."""
        from solutions.attention.paged import KVCache

        bytes_per_block = KVCache.bytes_per_block(hf_config, self.block_size, dtype)
        counts = []
        for name, wanted, needs in (
            ("swap_space", self.preemption_mode == "swap",
             "with preemption_mode='swap' it must hold at least one (or use preemption_mode='recompute')"),
            ("kv_offloading_size", bool(self.kv_offloading_size), "it must hold at least one (or None: off)"),
        ):
            gib = getattr(self, name)
            counts.append(int(gib * 2**30) // bytes_per_block if wanted else 0)
            if wanted and counts[-1] == 0:
                raise ParameterError(f"{name}={gib} GiB holds no KV block of {bytes_per_block} bytes: {needs}", name)
        return counts[0], counts[1]

    def _resolve_device(self) -> torch.device:
        tp = self.tensor_parallel_size
        if tp > 1 and self.device == "cuda":  # first: these say what tensor parallelism on GPUs needs, GPU or not
            self._check_gpus_for_tensor_parallel()
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ParameterError(
                "device='cuda' but PyTorch sees no CUDA GPU (torch.cuda.is_available() is False; the pinned torch is "
                "the CPU build: install the CUDA build of the same version), or use device='cpu'", "device",
            )
        if self.data_parallel_size > torch.cuda.device_count() and self.device == "cuda":
            raise ParameterError(
                f"data_parallel_size={self.data_parallel_size} needs {self.data_parallel_size} GPUs on this machine, "
                f"one per replica; {torch.cuda.device_count()} are visible", "data_parallel_size",
            )
        if self.attention_backend == "triton" and self.device == "cpu":
            import kernels

            if not kernels.interpreted():
                raise ParameterError(
                    "attention_backend='triton' with device='cpu' needs Triton's interpreter, which is off here: a GPU "
                    "is present, so the kernels compile for it. Use device='cuda', or attention_backend='torch'",
                    "attention_backend",
                )
        if tp == 1 or self.device != "cuda":
            return torch.device(self.device)
        # rank r on cuda:r (under torchrun, this node's LOCAL_RANK); NCCL joins them.
        launched = self.distributed_executor_backend == "external_launcher"
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) if launched else 0)

    def _check_gpus_for_tensor_parallel(self) -> None:
        """Tensor parallelism on GPUs: one per rank on this node, and workers that start fresh (no CUDA after fork)."""
        tp = self.tensor_parallel_size
        if self.worker_multiproc_method == "fork":
            raise ParameterError(
                "worker_multiproc_method='fork' cannot start GPU workers (CUDA does not survive a fork): use 'spawn' "
                "with device='cuda'", "worker_multiproc_method",
            )
        if self.distributed_executor_backend == "mp" and torch.cuda.device_count() < tp:
            raise ParameterError(
                f"tensor_parallel_size={tp} needs {tp} GPUs on this machine, one per rank; "
                f"{torch.cuda.device_count()} are visible", "tensor_parallel_size",
            )

    # --- the command line ----------------------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One flag per field (`max_num_seqs` → `--max-num-seqs`; a bool → `--x / --no-x`), with its default."""
        group = parser.add_argument_group("engine", f"{cls.__name__}'s options (solutions/engine/arg_utils.py)")
        for f in dataclasses.fields(cls):
            kind = _value_type(f.type)
            help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
            if kind is bool:
                group.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=f.default,
                                   help=help_text)
            else:  # a dict is given as JSON, as vLLM's --speculative-config
                group.add_argument(
                    _flag(f.name), type=json.loads if kind is dict else kind, default=f.default, help=help_text
                )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> Self:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def to_cli_args(self) -> list[str]:
        """The flags that give back these options (for starting a server in a subprocess); defaults left out."""
        argv = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if isinstance(value, bool):
                argv.append(_flag(f.name) if value else "--no-" + _flag(f.name)[2:])
            elif isinstance(value, dict):
                argv += [_flag(f.name), json.dumps(value)]
            elif value is not None:
                argv += [_flag(f.name), str(value)]
        return argv


@dataclass
class AsyncEngineArgs(EngineArgs):
    """`EngineArgs` for a server: also where the engine core runs, its own process or a thread of the server's."""

    engine_core: str = field(default="process", metadata=_help(f"one of {ENGINE_CORE_KINDS}"))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_one_of("engine_core", self.engine_core, ENGINE_CORE_KINDS)


def engine_args_from_kwargs(cls: type[EngineArgs], kwargs: dict[str, Any]) -> EngineArgs:
    """`cls(**kwargs)`, with an unknown keyword a ParameterError naming it (not a TypeError)."""
    known = {f.name for f in dataclasses.fields(cls)}
    if unknown := sorted(set(kwargs) - known):
        raise ParameterError(f"unknown engine options {unknown}; the engine takes {sorted(known)}", unknown[0])
    return cls(**kwargs)


def _either(values: tuple | list) -> str:
    return " or ".join(map(repr, values))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_type(annotation: Any) -> type:
    """`int` for `int` and for `int | None`."""
    if isinstance(annotation, types.UnionType):
        (kind,) = [arg for arg in annotation.__args__ if arg is not type(None)]
        return kind
    return annotation

"""Argument checks the kernel wrappers run before a launch: a wrong shape, dtype or stride raises `ValueError`
naming the argument, instead of a kernel reading the wrong memory (which, in the interpreter, can crash the
process).

`check_caches` runs first in every wrapper, so it also checks that a launch can work at all: that the interpreter
could be switched on when there is no GPU (`kernels/__init__.py` leaves `LAUNCH_ERROR` when it could not — importing
never fails), and that compiled kernels get CUDA tensors."""

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Why no kernel can be launched in this process (set on import by `kernels/__init__.py`), or None.
LAUNCH_ERROR: str | None = None


def check_launchable(device: torch.device) -> None:
    """Raise before a launch that cannot work: no interpreter and no GPU (RuntimeError, with what to do), or CPU
    tensors handed to kernels compiled for the GPU (ValueError: make them on the GPU)."""
    if LAUNCH_ERROR is not None:
        raise RuntimeError(LAUNCH_ERROR)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "the tensors are on the CPU, but the kernels are compiled for the GPU: make them on the GPU "
            "(grading.devices.DEVICE, or LLM(device='cuda')); Triton's interpreter (TRITON_INTERPRET=1) "
            "runs CPU tensors"
        )


def check_tensor(
    name: str,
    t: object,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
) -> torch.Tensor:
    """`t` must be a tensor with `ndim` dimensions, one of `dtypes`, on `device`, with a unit last stride."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be {allowed}, got {str(t.dtype).removeprefix('torch.')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the other arguments on {device}")
    if t.numel() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dimension, got strides {t.stride()}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")


def check_caches(key_cache: object, value_cache: object) -> tuple[int, int, int, int]:
    """Both caches `[num_blocks, block_size, num_kv_heads, head_dim]`, same shape, dtype and strides; and a launch
    on their device can work (`check_launchable`)."""
    check_tensor("key_cache", key_cache, 4, FLOAT_DTYPES)
    check_launchable(key_cache.device)
    check_tensor("value_cache", value_cache, 4, FLOAT_DTYPES, key_cache.device)
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache {tuple(value_cache.shape)} {value_cache.dtype} must match "
            f"key_cache {tuple(key_cache.shape)} {key_cache.dtype}"
        )
    if value_cache.stride() != key_cache.stride():
        raise ValueError(f"value_cache strides {value_cache.stride()} must equal key_cache's {key_cache.stride()}")
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def check_query(query: object, key_cache: torch.Tensor) -> tuple[int, int]:
    """`query` (rows, Hq, D) on the cache's device, in its dtype and head dim, Hq a multiple of its KV heads;
    returns (rows, Hq)."""
    check_tensor("query", query, 3, FLOAT_DTYPES, key_cache.device)
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if head_dim != key_cache.shape[3]:
        raise ValueError(f"query has head_dim {head_dim}, key_cache has {key_cache.shape[3]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query has {num_heads} heads, not a multiple of the cache's {num_kv_heads} KV heads")
    if query.dtype != key_cache.dtype:
        raise ValueError(f"query is {query.dtype}, key_cache is {key_cache.dtype}; they must match")
    return num_rows, num_heads


def next_power_of_2(n: int) -> int:
    """Triton's `tl.arange` wants a power-of-two length: head dims like 80 are padded and masked."""
    return 1 << max(n - 1, 0).bit_length()

"""Store: write each new token's key and value into the paged cache at the slot the slot mapping gives it.

Slot s is row s of the cache viewed as `[num_blocks * block_size, num_kv_heads, head_dim]`, so token t goes to
block `slot // block_size`, offset `slot % block_size`. A slot of -1 (`PAD_SLOT_ID` in vLLM) marks a padding
token whose K/V must not be written anywhere. One program per token copies all its KV heads at once: a
`[num_kv_heads, head_dim]` tile, two loads and two stores.

Where this lives in vLLM: `vllm/v1/attention/ops/triton_reshape_and_cache_flash.py`.
"""

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.validation import check_caches, check_shape, check_tensor, next_power_of_2

PAD_SLOT_ID = -1


@triton.jit
def kv_store_kernel(
    key_ptr,  # (T, Hkv, D) this step's keys
    value_ptr,  # (T, Hkv, D)
    key_cache_ptr,  # (num_blocks, BLOCK_SIZE, Hkv, D)
    value_cache_ptr,  # same shape and strides as the key cache
    slot_mapping_ptr,  # (T,) int64, -1 for padding
    stride_kt, stride_kh,  # key strides (token, head); the head_dim stride is 1
    stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,  # cache strides (block, slot in block, head)
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS_PADDED: tl.constexpr,  # powers of two >= num_kv_heads, head_dim (tl.arange needs them)
    HEAD_DIM_PADDED: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # a padding token: nothing to store
        return
    block_idx = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, NUM_KV_HEADS_PADDED)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # (H, D)

    # -- read this token's K and V tile: (H, D) --
    key = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)

    # -- write it at its slot; the tile lands in one (block, offset) row of the cache --
    cache_offs = block_idx.to(tl.int64) * stride_cb + block_offset * stride_cs  # int64: large caches
    tile_offs = offs_h[:, None] * stride_ch + offs_d[None, :]  # (H, D)
    tl.store(key_cache_ptr + cache_offs + tile_offs, key, mask=mask)
    tl.store(value_cache_ptr + cache_offs + tile_offs, value, mask=mask)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kernel: Any = None,
) -> None:
    """Write key, value (T, Hkv, D) into the caches at `slot_mapping` (T,), skipping slots of -1.

    `kernel` is the Triton kernel to launch: None means this module's `kv_store_kernel`, looked up at call time,
    so that whatever this module holds under that name runs (chapter 6's capstone puts the learner's there).
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_caches(key_cache, value_cache)
    check_tensor("key", key, 3, (key_cache.dtype,), key_cache.device)
    check_tensor("value", value, 3, (key_cache.dtype,), key_cache.device)
    num_tokens = key.shape[0]
    check_shape("key", key, (num_tokens, num_kv_heads, head_dim))
    check_shape("value", value, (num_tokens, num_kv_heads, head_dim))
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64, torch.int32), key_cache.device)
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    if num_tokens == 0:
        return
    kernel = kv_store_kernel if kernel is None else kernel
    kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS_PADDED=next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=next_power_of_2(head_dim),
    )


def store_kv_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The same in PyTorch: scatter the rows whose slot is not -1 into the flattened caches."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    keep = slot_mapping != PAD_SLOT_ID  # (T,)
    slots = slot_mapping[keep].long()
    key_cache.view(-1, num_kv_heads, head_dim)[slots] = key[keep]
    value_cache.view(-1, num_kv_heads, head_dim)[slots] = value[keep]

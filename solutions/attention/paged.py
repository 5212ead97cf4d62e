"""Chapter 3: attention over a paged KV cache, in plain PyTorch.

The cache of each layer is one pool of blocks, laid out (num_blocks, block_size, Hkv, D) as in vLLM and
FlashAttention. Two operations make it work:

- store: each new token's K/V go to its *slot* (block_table[pos // block_size] * block_size + pos % block_size),
  given per token by the slot mapping — vLLM's `reshape_and_cache_flash`;
- attend: for each sequence, gather its blocks through its block table, cut to its length, and run ordinary
  causal attention — what the Triton kernel of chapter 6 does without materialising the gathered copy.

Every step handles a flat batch: the new tokens of all sequences concatenated, with `query_start_loc`
saying where each sequence's tokens start, so prefills (many tokens) and decodes (one token) mix freely.

Where this lives in vLLM: `vllm/v1/attention/backends/` (metadata), `vllm/v1/attention/ops/`.
"""

import functools
from dataclasses import dataclass
from typing import Protocol

import torch

from solutions.attention.causal import causal_attention


class KVCacheShape(Protocol):
    """What the KV cache needs of a model's config (`solutions/model/config.py`'s `ModelConfig` has it)."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int


@dataclass
class KVCache:
    """Every layer's paged key and value pools; block b of layer l is `key_caches[l][b]` (block_size, Hkv, D)."""

    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    # Each layer's sliding window (`ModelConfig.sliding_windows`): the backends mask what a layer's queries see by
    # it; every token stays cached. Empty: no layer is windowed.
    sliding_windows: tuple[int | None, ...] = ()

    @classmethod
    def allocate(
        cls, config: KVCacheShape, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu", sliding_windows: tuple[int | None, ...] = (),
    ) -> "KVCache":
        """Zeroed pools in the model's dtype, on its device (the kernels read and write them in place)."""
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # Zeros, not torch.empty: a batched backend reads whole blocks, padding included, and weighs the slots
        # past a sequence's end by a probability of 0 — but 0 × NaN is NaN, and uninitialised memory may hold
        # NaN. Once zeroed, a slot only ever holds real (finite) keys and values, stale or current.
        return cls(
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)],
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)],
            sliding_windows,
        )

    def sliding_window(self, layer_idx: int) -> int | None:
        """How many positions layer `layer_idx`'s queries see, their own included; None: every earlier one."""
        return self.sliding_windows[layer_idx] if self.sliding_windows else None

    @staticmethod
    def bytes_per_block(config: KVCacheShape, block_size: int, dtype: torch.dtype = torch.float32) -> int:
        """K and V of one block in every layer: what sizing the pool from a memory budget divides by."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element_size

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.key_caches + self.value_caches)


@dataclass
class AttentionMetadata:
    """Where this step's T tokens go and what each of the B sequences attends to (vLLM's names)."""

    slot_mapping: torch.Tensor  # (T,) cache slot of each new token
    query_start_loc: torch.Tensor  # (B + 1,) sequence b's new tokens are rows query_start_loc[b]:[b + 1]
    seq_lens: torch.Tensor  # (B,) tokens in the cache for sequence b after this step (context + new)
    block_tables: list[list[int]]  # (B, blocks) physical block ids of each sequence

    @functools.cached_property
    def block_table_tensor(self) -> torch.Tensor:
        """The block tables as one (B, max_blocks) int32 tensor, rows padded with block 0 (a real block that is
        never read past `seq_lens[b]`), as kernels take them. Built from the lists on first use, unless set: the
        model runner sets it from its persistent block table (`solutions/worker/block_table.py`), which writes
        only what changed since the last step."""
        width = max((len(table) for table in self.block_tables), default=0)
        rows = [table + [0] * (width - len(table)) for table in self.block_tables]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width)  # (B, max_blocks)


def write_to_kv_cache(
    k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter k, v (T, Hkv, D) into the paged caches (num_blocks, block_size, Hkv, D) at `slot_mapping` (T,)."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k  # slot s = row s of the flattened pool
    value_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v


def gather_kv(cache: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    """One sequence's keys (or values) in position order, (seq_len, Hkv, D), copied out of its blocks."""
    blocks = cache[torch.tensor(block_table, dtype=torch.long)]  # (num_blocks_of_seq, block_size, Hkv, D)
    return blocks.flatten(0, 1)[:seq_len]  # (seq_len, Hkv, D)


def paged_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention for a flat batch of queries q (T, Hq, D) over each sequence's paged context -> (T, Hq, D).

    Sequence b's queries are rows `query_start_loc[b]:[b + 1]`, the last of its `seq_lens[b]` tokens (the store
    ran first), so a prefill, a chunk after a cached prefix and a decode are one case; `causal_attention` aligns
    the mask to the end of the context and shares each KV head with its group of query heads (GQA).
    """
    out = torch.empty_like(q)
    starts = metadata.query_start_loc.tolist()
    for b, block_table in enumerate(metadata.block_tables):
        rows = slice(starts[b], starts[b + 1])
        seq_len = int(metadata.seq_lens[b])
        keys = gather_kv(key_cache, block_table, seq_len)  # (seq_len, Hkv, D)
        values = gather_kv(value_cache, block_table, seq_len)
        out[rows] = causal_attention(q[rows], keys, values, scale)  # the new tokens are the last of seq_len
    return out


class PagedAttention:
    """Backend for one engine step: store the new K/V by slot mapping, then attend through block tables.

    What chapter 3's `generate_paged` runs in every layer; the engine's default backend does the same with its
    decodes batched (`torch_backend.py`), and tests hold that one to this one.
    """

    def __init__(self, kv_cache: KVCache, metadata: AttentionMetadata) -> None:
        self.kv_cache, self.metadata = kv_cache, metadata

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        key_cache, value_cache = self.kv_cache.key_caches[layer_idx], self.kv_cache.value_caches[layer_idx]
        write_to_kv_cache(k, v, key_cache, value_cache, self.metadata.slot_mapping)
        return paged_attention(q, key_cache, value_cache, self.metadata, scale=q.shape[-1] ** -0.5)


def copy_blocks(kv_cache: KVCache, blocks_to_copy: list[tuple[int, int]]) -> None:
    """Copy-on-write, applied: for every layer, K and V of block `src` are copied into block `dst`.

    Runs before the forward pass that writes into the `dst` blocks, so each sequence that was given a private
    copy of a shared partial block sees the tokens written so far. All pairs go in one indexed copy per
    cache tensor (2 × layers copies, however many pairs) — vLLM's `copy_blocks` does the same in one kernel.
    Pairs must have distinct destinations, none of them a source of another pair (the block pool guarantees
    it: a destination is a fresh block).
    """
    if not blocks_to_copy:
        return
    src = torch.tensor([s for s, _ in blocks_to_copy], dtype=torch.long)  # (P,)
    dst = torch.tensor([d for _, d in blocks_to_copy], dtype=torch.long)  # (P,)
    for cache in kv_cache.key_caches + kv_cache.value_caches:
        cache[dst] = cache[src]  # (P, block_size, Hkv, D): the gather copies src first, so the order is safe

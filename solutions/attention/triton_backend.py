"""Chapter 6: the paged attention backend on Triton kernels, a drop-in for chapter 3's `PagedAttention`.

Per layer it does the same two things — store the new K/V by slot mapping, then attend through the block
tables — but each is one kernel launch over the whole flat batch instead of a Python loop over sequences that
copies every context out of its blocks: `kernels.store_kv_cache`, then `kernels.paged_decode_attention` when
every sequence brings exactly one new token (a pure decode step), else `kernels.unified_attention`. A layer with
a sliding window (`KVCache.sliding_window`) always takes the unified kernel, which masks by it: chapter 6's decode
kernels, the learner's exercises, see every earlier position.

The metadata's tensors are converted once per step (in the constructor), not once per layer: int32 block
tables padded with block 0 (never read past `seq_lens[b]`), int32 lengths and offsets, and the longest query.

On a machine without CUDA the kernels run in Triton's interpreter (`import kernels` turns it on), so the
backend works, slowly, on the CPU; on a GPU the kernels compile natively, and the cache and the activations live
on the device (`LLM(device="cuda")`). There, pure-decode steps replay CUDA graphs captured over `for_decode`
backends (`solutions/worker/cuda_graph.py`).

Where this lives in vLLM: `vllm/v1/attention/backends/triton_attn.py` (`TritonAttentionImpl.forward`).
"""

import torch

from solutions.attention.paged import AttentionMetadata, KVCache


class TritonAttentionBackend:
    """Backend for one engine step: the `PagedAttention` interface, Triton kernels underneath."""

    devices = ("cpu", "cuda")  # on the CPU, in Triton's interpreter
    compiles_on = ("cuda",)  # the forward compiled, pure-decode steps replayed as CUDA graphs (`for_decode`)
    supports_tensor_parallel = True

    def __init__(self, kv_cache: KVCache, metadata: AttentionMetadata) -> None:
        import kernels  # sets TRITON_INTERPRET on a machine without CUDA, before any kernel is decorated

        self._kernels = kernels
        self.kv_cache, self.metadata = kv_cache, metadata
        device = kv_cache.key_caches[0].device
        self.block_tables = metadata.block_table_tensor.to(device)  # (B, max_blocks) int32
        self.seq_lens = metadata.seq_lens.to(device=device, dtype=torch.int32)  # (B,)
        self.query_start_loc = metadata.query_start_loc.to(device=device, dtype=torch.int32)  # (B + 1,)
        self.slot_mapping = metadata.slot_mapping.to(device)  # (T,)
        query_lens = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]  # (B,) on the host
        self.max_query_len = int(query_lens.max()) if len(query_lens) else 0
        self.decode_only = self.max_query_len == 1 and bool((query_lens == 1).all())

    @classmethod
    def for_decode(
        cls, kv_cache: KVCache, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
    ) -> "TritonAttentionBackend":
        """A pure-decode step over tensors already on the cache's device — a CUDA graph's static inputs: slot
        mapping (B,) int64, block tables (B, max_blocks) int32, seq_lens (B,) int32. Nothing is read back to the
        host, so every launch the forward makes can be captured, and replayed on new contents of the same
        tensors."""
        import kernels

        backend = cls.__new__(cls)
        backend._kernels = kernels
        backend.kv_cache, backend.metadata = kv_cache, None
        backend.slot_mapping, backend.block_tables, backend.seq_lens = slot_mapping, block_tables, seq_lens
        num_seqs = block_tables.shape[0]
        backend.query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=block_tables.device)
        backend.max_query_len, backend.decode_only = 1, True
        return backend

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, Hq, D), k and v (T, Hkv, D) for the step's new tokens -> attention output (T, Hq, D)."""
        key_cache, value_cache = self.kv_cache.key_caches[layer_idx], self.kv_cache.value_caches[layer_idx]
        self._kernels.store_kv_cache(k.contiguous(), v.contiguous(), key_cache, value_cache, self.slot_mapping)
        q, scale, window = q.contiguous(), q.shape[-1] ** -0.5, self.kv_cache.sliding_window(layer_idx)
        if self.decode_only and window is None:  # one token per sequence: row b of q is sequence b's query
            return self._kernels.paged_decode_attention(
                q, key_cache, value_cache, self.block_tables, self.seq_lens, scale
            )
        return self._kernels.unified_attention(
            q, key_cache, value_cache, self.block_tables, self.seq_lens, self.query_start_loc, scale,
            max_query_len=self.max_query_len, window=window,
        )

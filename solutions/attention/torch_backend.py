"""The engine's attention backend in plain PyTorch: one step's mixed batch, without a Python loop over decodes.

Chapter 3's `paged_attention` gathers and attends one sequence at a time — clear, and the oracle this module is
tested against, but with 64 decoding sequences and 30 layers it runs 1,920 small gathers per step. Here the
step's sequences are split by query length:

- decodes (one new token each — almost every sequence in a busy engine): all of them at once. One gather
  through the padded block-table tensor fetches every sequence's K/V, `(Bd, L, Hkv, D)`, and one fused
  attention call with a length mask attends to it. The costs: copying the context out of the cache once per
  layer (the Triton kernel of chapter 6 reads it in place), and the padding to the longest context.
- prefills (a prompt, or a chunk of one): few per step and large, so one at a time is cheap relative to their
  matmuls. A prefill with no earlier context attends to its own new K/V directly (nothing to gather); a later
  chunk, or a prompt whose head was found in the prefix cache, gathers its context through its block table.

The metadata arrives on the host (the scheduler's lists, turned into tensors); what the attention ops index
with is copied once per step to the cache's device, so the same backend runs on the CPU and on a GPU, in the
cache's dtype. It never runs inside a CUDA graph (see `solutions/worker/cuda_graph.py`): its batched gather
copies every sequence's context out of the cache, which a graph would have to do at a fixed, maximal width.

Where this lives in vLLM: `vllm/v1/attention/backends/` (one backend per implementation, e.g. the CPU
backend's split into prefill and decode metadata).
"""

import torch
import torch.nn.functional as F

from solutions.attention.causal import visible
from solutions.attention.paged import AttentionMetadata, KVCache, gather_kv, write_to_kv_cache


def batched_decode_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, window: int | None = None,
) -> torch.Tensor:
    """One query per sequence, q (Bd, Hq, D), over each sequence's paged context -> (Bd, Hq, D).

    `block_tables` (Bd, max_blocks) int64, `seq_lens` (Bd,): sequence b attends to its first seq_lens[b] tokens, or
    with a sliding `window` to the last `window` of them.
    The gather is one `index_select` of whole blocks (each a contiguous block_size × Hkv × D run of memory,
    about twice as fast here as indexing with the 2-D table); PyTorch's fused attention then shares each KV head
    across its query group (`enable_gqa`) and skips the padding by the boolean mask.
    """
    Bd, Hq, D = q.shape
    num_blocks, block_size, Hkv, _ = key_cache.shape
    flat = block_tables.flatten()  # (Bd * max_blocks,)
    keys = key_cache.index_select(0, flat).view(Bd, -1, Hkv, D)  # (Bd, L, Hkv, D), L = max_blocks * block_size
    values = value_cache.index_select(0, flat).view(Bd, -1, Hkv, D)  # (Bd, L, Hkv, D)
    seen = visible(seq_lens[:, None] - 1, torch.arange(keys.shape[1], device=q.device)[None, :], window)  # (Bd, L)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=seen[:, None, None, :],
        scale=scale, enable_gqa=True,
    )  # (Bd, Hq, 1, D)
    return out[:, :, 0, :]  # (Bd, Hq, D)


class TorchAttentionBackend:
    """Store the step's new K/V by slot mapping, then attend: decodes batched, prefills one by one, each query within
    its layer's sliding window if it has one (`KVCache.sliding_window`).

    `decode_attention` is the one step a subclass changes: `inductor_backend.py` attends in place.
    """

    devices = ("cpu", "cuda")
    compiles_on = ()  # eager everywhere
    supports_tensor_parallel = True
    decode_attention = staticmethod(batched_decode_attention)
    max_decode_query_len = 1  # sequences with at most this many new tokens are attended by `decode_attention`

    def __init__(self, kv_cache: KVCache, metadata: AttentionMetadata) -> None:
        """`metadata` on the host; what the ops index with is copied here, once per step, to the cache's device.

        The sequences of up to `max_decode_query_len` new tokens are grouped by that number n (1: decodes; 1 + k: a
        speculative verify, where the subclass's kernel takes n queries per sequence): one `decode_attention`
        call per group, its rows, block tables and lengths prepared here.
        """
        self.kv_cache, self.metadata = kv_cache, metadata
        device = kv_cache.key_caches[0].device
        self.query_starts, self.seq_lens = metadata.query_start_loc.tolist(), metadata.seq_lens.tolist()  # host
        query_lens = [end - start for start, end in zip(self.query_starts, self.query_starts[1:])]  # (B,)
        self.prefills = [b for b, n in enumerate(query_lens) if n > self.max_decode_query_len]
        self.slot_mapping = metadata.slot_mapping.to(device)  # (T,)
        # n -> (rows (Bn * n,), block tables (Bn, max_blocks), seq_lens (Bn,)) of the Bn sequences of n new tokens
        self.decode_groups: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for n in sorted({n for n in query_lens if n <= self.max_decode_query_len}):
            seqs = [b for b, length in enumerate(query_lens) if length == n]
            rows = torch.tensor([self.query_starts[b] + i for b in seqs for i in range(n)], device=device)
            tables = metadata.block_table_tensor[torch.tensor(seqs)].to(device=device, dtype=torch.long)
            self.decode_groups[n] = rows, tables, metadata.seq_lens[seqs].to(device)
        self.decodes_only = len(self.decode_groups) == 1 and not self.prefills  # then the rows are 0 .. T - 1

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, Hq, D), k and v (T, Hkv, D) for the step's T new tokens -> (T, Hq, D)."""
        key_cache, value_cache = self.kv_cache.key_caches[layer_idx], self.kv_cache.value_caches[layer_idx]
        write_to_kv_cache(k, v, key_cache, value_cache, self.slot_mapping)
        scale, window = q.shape[-1] ** -0.5, self.kv_cache.sliding_window(layer_idx)
        if self.decodes_only:  # a pure decode (or verify) step, most steps: no scatter of the output
            ((n, (_, tables, seq_lens)),) = self.decode_groups.items()
            queries = q if n == 1 else q.view(-1, n, *q.shape[1:])  # (Bd, Hq, D) or (Bd, n, Hq, D)
            return self.decode_attention(queries, key_cache, value_cache, tables, seq_lens, scale, window).view_as(q)
        out = torch.empty_like(q)
        for n, (rows, tables, seq_lens) in self.decode_groups.items():
            queries = q[rows] if n == 1 else q[rows].view(-1, n, *q.shape[1:])
            attended = self.decode_attention(queries, key_cache, value_cache, tables, seq_lens, scale, window)
            out[rows] = attended.reshape(-1, *q.shape[1:])  # (Bn * n, Hq, D)
        if self.prefills:
            self.prefill_attention(q, k, v, key_cache, value_cache, out, scale, window)
        return out

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, out: torch.Tensor, scale: float, window: int | None) -> None:
        """The prefills' rows of `out`, one sequence at a time: its new tokens with each other, or with its
        context gathered from its blocks; with a sliding `window`, each token sees the last `window` positions."""
        starts, seq_lens = self.query_starts, self.seq_lens
        for b in self.prefills:
            rows = slice(starts[b], starts[b + 1])
            if seq_lens[b] == starts[b + 1] - starts[b]:  # no earlier context: attend to the new K/V only
                out[rows] = causal_self_attention(q[rows], k[rows], v[rows], scale, window)
            else:
                block_table = self.metadata.block_tables[b]
                keys = gather_kv(key_cache, block_table, seq_lens[b])
                values = gather_kv(value_cache, block_table, seq_lens[b])
                out[rows] = causal_context_attention(q[rows], keys, values, scale, window)


def causal_self_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """Causal attention of T tokens to each other, q (T, Hq, D), k and v (T, Hkv, D) -> (T, Hq, D), with
    PyTorch's fused kernel (it shares each KV head across its query group itself: `enable_gqa`). A sliding
    `window` needs an explicit mask: `causal_context_attention`'s, its context being the T tokens themselves.

    The inputs get a batch dimension of one: given 3-D tensors, PyTorch's CPU dispatch picks the unfused "math"
    path, which writes out the (Hq, T, T) scores (on a 2-core AMD EPYC, 2026-11-23: 9 heads of 128 tokens took
    0.50 ms instead of the fused kernel's 0.31)."""
    if window is not None:
        return causal_context_attention(q, k, v, scale, window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=scale,
        enable_gqa=True,
    )  # (1, Hq, T, D)
    return out[0].transpose(0, 1)  # (T, Hq, D)


def causal_context_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """The last Tq tokens (Tq, Hq, D) of a Tk-token context attend causally to it, k and v (Tk, Hkv, D) ->
    (Tq, Hq, D): query i sits at position Tk - Tq + i, and sees the last `window` positions up to its own if a
    window is given. Chapter 3's `causal_attention`, fused, on q's device."""
    Tq, Tk = q.shape[0], k.shape[0]
    query_pos = torch.arange(Tk - Tq, Tk, device=q.device)[:, None]  # (Tq, 1)
    seen = visible(query_pos, torch.arange(Tk, device=q.device)[None, :], window)  # (Tq, Tk)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=seen, scale=scale,
        enable_gqa=True,
    )  # (1, Hq, Tq, D): 4-D for the fused kernel, as above
    return out[0].transpose(0, 1)  # (Tq, Hq, D)

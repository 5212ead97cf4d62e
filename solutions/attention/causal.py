"""Scaled dot-product attention with a causal mask: the arithmetic every backend ends with.

Backends differ only in where K and V come from (the step's own tokens, a contiguous cache, blocks
gathered through a block table); once they hold a sequence's K/V they all call `causal_attention`.
"""

import torch


def repeat_kv(x: torch.Tensor, num_queries_per_kv: int) -> torch.Tensor:
    """Grouped-query attention: repeat each K/V head (T, Hkv, D) for the query heads that share it -> (T, Hq, D).

    Query head h reads K/V head h // num_queries_per_kv, so copies of one head must sit side by side.
    """
    return x.repeat_interleave(num_queries_per_kv, dim=1)  # (T, Hq, D)


def visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Whether the query at `query_pos` sees the key at `key_pos` (broadcast): every key up to its own position,
    or with a sliding window only the last `window` of them, its own included — Hugging Face's rule (transformers
    5.23.0, `masking_utils.py`: a sliding-window layer lets query i see key j when i - window < j <= i)."""
    causal = key_pos <= query_pos
    return causal if window is None else causal & (key_pos > query_pos - window)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of Tq queries (Tq, Hq, D) over Tk keys/values (Tk, Hkv, D) -> (Tq, Hq, D).

    The queries are the *last* Tq tokens of the Tk-token context, so query i sits at position
    Tk - Tq + i and may see keys 0 .. Tk - Tq + i. With Tq == Tk this is ordinary causal attention;
    with Tq == 1 it is one decode step over a cache.
    """
    Tq, Tk = q.shape[0], k.shape[0]
    num_queries_per_kv = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, num_queries_per_kv), repeat_kv(v, num_queries_per_kv)  # (Tk, Hq, D)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # (Hq, Tq, Tk)
    query_pos = torch.arange(Tk - Tq, Tk, device=q.device)[:, None]  # (Tq, 1)
    key_pos = torch.arange(Tk, device=q.device)[None, :]  # (1, Tk)
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))  # (Hq, Tq, Tk)
    probs = torch.softmax(scores, dim=-1)  # (Hq, Tq, Tk)
    return torch.einsum("hqk,khd->qhd", probs, v)  # (Tq, Hq, D)

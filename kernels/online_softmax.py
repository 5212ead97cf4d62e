"""Online softmax: softmax-weighted sums computed one tile of scores at a time, in PyTorch.

Every attention kernel in this package runs this loop (Milakov & Gimelshein, "Online normalizer calculation for
softmax", 2018; FlashAttention, Dao et al. 2022, Algorithm 1). The scores of a row are never all in memory at
once: a kernel sees them `tile_n` at a time and keeps three running values per row, named as in the papers:

    m_i  the largest score seen so far                       (keeps every exp() argument <= 0)
    l_i  sum of exp(score - m_i) over the scores seen so far  (the softmax denominator, in units of e^m_i)
    acc  sum of exp(score - m_i) * value over the same        (the numerator)

A new tile with scores s (G, N) and values v (N, D) moves the reference point from m_i to m_new and rescales
what was summed under the old one by alpha = exp(m_i - m_new) <= 1:

    m_new = max(m_i, rowmax(s));  alpha = exp(m_i - m_new);  p = exp(s - m_new)
    l_i   = alpha * l_i + rowsum(p);  acc = alpha * acc + p @ v;  m_i = m_new

At the end out = acc / l_i equals softmax(scores) @ values exactly (up to rounding), and m_i + log(l_i) is the
row's log-sum-exp, which split-KV uses to merge partial results.

Here the loop is plain PyTorch, to see the algorithm without Triton; `kernels/contiguous_decode.py` and
`kernels/paged_decode.py` run the same loop inside a kernel.
"""

import torch


def online_softmax_attention(
    scores: torch.Tensor, values: torch.Tensor, tile_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax(scores) @ values, visiting `tile_n` columns of scores (G, L) and rows of values (L, D) at a time.

    Returns (out (G, D), m_i (G,), l_i (G,)): the output and the final running max and running sum. A row's
    first tile must hold a finite score (a causal row always does: position 0). Computed in fp32.
    """
    num_rows, seq_len = scores.shape
    device = scores.device
    m_i = torch.full((num_rows,), float("-inf"), device=device)  # (G,) running max
    l_i = torch.zeros(num_rows, device=device)  # (G,) running sum of exp(score - m_i)
    acc = torch.zeros(num_rows, values.shape[1], device=device)  # (G, D) running sum of exp(score - m_i) * value
    for start in range(0, seq_len, tile_n):
        s = scores[:, start : start + tile_n].float()  # (G, N); the last tile may be shorter
        v = values[start : start + tile_n].float()  # (N, D)
        m_new = torch.maximum(m_i, s.max(dim=1).values)  # (G,)
        alpha = torch.exp(m_i - m_new)  # (G,) 0 on the first tile (m_i = -inf)
        p = torch.exp(s - m_new[:, None])  # (G, N)
        l_i = alpha * l_i + p.sum(dim=1)
        acc = alpha[:, None] * acc + p @ v  # (G, D)
        m_i = m_new
    return acc / l_i[:, None], m_i, l_i


def online_softmax_attention_reference(
    scores: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same three results from the whole row at once: (softmax @ values, row max, sum of exp(s - max))."""
    scores = scores.float()
    m_i = scores.max(dim=1).values  # (G,)
    l_i = torch.exp(scores - m_i[:, None]).sum(dim=1)  # (G,)
    return torch.softmax(scores, dim=1) @ values.float(), m_i, l_i

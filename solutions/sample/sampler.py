"""Pick each sequence's next token from its logits: greedy, or temperature + top-k + top-p sampling.

Where this lives in vLLM: `vllm/v1/sample/sampler.py` and `vllm/v1/sample/ops/topk_topp_sampler.py`.
"""

import torch

from solutions.sampling_params import SamplingParams


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit (V,) outside the top-k and outside the top-p nucleus."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)  # (V,)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)  # (V,)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before token >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """One next token per row of `logits` (B, V), row b drawn with params[b] and generators[b]."""
    tokens = []
    for row, p, generator in zip(logits, params, generators, strict=True):
        if p.greedy:
            tokens.append(int(row.argmax()))
            continue
        row = filter_top_k_top_p(row.float() / p.temperature, p.top_k, p.top_p)  # (V,)
        probs = torch.softmax(row, dim=-1)  # (V,)
        tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
    return tokens

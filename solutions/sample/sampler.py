"""From each row of logits to a next token, for the whole step at once.

Greedy rows take the argmax. Sampled rows go through temperature, then the filters — top-k (keep the k most
likely), top-p (keep the smallest set whose probability reaches p), min-p (drop tokens less likely than min_p
times the most likely) — then draw one token. The filters run batched, each a mask over all sampled rows
with that row's own k, p and min_p (top-k and top-p each sort the rows; min-p needs no sort).

The draw is the one per-row part: each sequence owns a `torch.Generator`, so a seeded request draws the same
uniform number whatever else shares the step, and picks its token by inverse CDF (the first token whose
cumulative probability exceeds it). That is what makes a seeded request reproducible inside any batch.

The logits may live on a GPU: the filters and the draw run there, on the logits' device. The generators stay on
the host (one scalar draw per sampled row, then one copy of the batch's uniforms to the device), so a seeded
request draws the same numbers on the CPU and on a GPU.

Where this lives in vLLM: `vllm/v1/sample/sampler.py`, `vllm/v1/sample/ops/topk_topp_sampler.py` (and min-p in
`vllm/v1/sample/logits_processor/`).
"""

from dataclasses import dataclass

import torch

from solutions.sampling_params import SamplingParams


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit (B, V) outside its row's k most likely; top_k (B,) int (V keeps all)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]  # (1, V)
    drop = rank >= top_k[:, None]  # (B, V) in sorted order: outside the top-k
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's nucleus: the most likely tokens whose probability first reaches top_p (B,) (1 keeps all).

    A token stays if the tokens more likely than it hold less than top_p, so the most likely always stays,
    and so does the token that crosses top_p. Logits (B, V) in, logits with the rest set to -inf out.
    """
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    probs = torch.softmax(sorted_logits, dim=-1)  # (B, V)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V) probability of the more likely tokens
    drop = mass_before >= top_p[:, None]  # (B, V) the nucleus already holds top_p without this token
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop every token less likely than min_p (B,) times its row's most likely token (0 keeps all).

    A floor that scales with the model's confidence: a peaked distribution keeps few tokens, a flat one many.
    Logits (B, V) in, logits with the dropped tokens set to -inf out.
    """
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    drop = probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values  # (B, V)
    return logits.masked_fill(drop, float("-inf"))


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Set to -inf every logit (B, V) outside its row's top-k, top-p nucleus or min-p floor.

    top_k (B,) int (V keeps all), top_p (B,) float (1 keeps all), min_p (B,) float (0 keeps all). Top-p is taken
    on the distribution left after top-k; min-p compares with the most likely token, which no filter removes,
    so its place in the order does not matter.
    """
    return apply_min_p(apply_top_p(apply_top_k(logits, top_k), top_p), min_p)


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]  # one per row
    logprobs: list[list[tuple[int, float]] | None]  # per row: the top `logprobs` (token, logprob), or None
    sampled_logprobs: list[tuple[float, int]]  # per row: the sampled token's (logprob, rank among all tokens)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> SamplerOutput:
    """One next token per row of `logits` (B, V), row b drawn with params[b] and generators[b]."""
    logits = logits.float()
    device = logits.device
    token_ids = logits.argmax(dim=-1)  # (B,) the greedy choice; sampled rows overwrite theirs
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    if sampled:
        temperature = torch.tensor([params[b].temperature for b in sampled], device=device)  # (Bs,)
        rows = logits[sampled] / temperature[:, None]  # (Bs, V)
        vocab_size = logits.shape[-1]
        top_k = torch.tensor([params[b].top_k if params[b].top_k > 0 else vocab_size for b in sampled], device=device)
        top_p = torch.tensor([float(params[b].top_p) for b in sampled], device=device)
        min_p = torch.tensor([float(params[b].min_p) for b in sampled], device=device)
        with device:  # factory calls in the filters (a rank `torch.arange`) make their tensors beside the logits
            probs = torch.softmax(apply_top_k_top_p_min_p(rows, top_k, top_p, min_p), dim=-1)  # (Bs, V)
        uniform = torch.stack([torch.rand((), generator=generators[b]) for b in sampled]).to(device)  # (Bs,) host draws
        cdf = probs.cumsum(dim=-1)  # (Bs, V)
        choice = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(1)  # (Bs,)
        token_ids[sampled] = choice.clamp(max=vocab_size - 1)  # guard the float edge u * total == total
    token_list = token_ids.tolist()

    logprobs: list[list[tuple[int, float]] | None] = [None] * len(params)
    sampled_logprobs: list[tuple[float, int]] = [(0.0, 0)] * len(params)
    wanted = [b for b, p in enumerate(params) if p.logprobs is not None]
    if wanted:  # raw log-probabilities of the model, before temperature and filters (vLLM's default)
        all_logprobs = torch.log_softmax(logits[wanted], dim=-1)  # (Bw, V)
        for row, b in zip(all_logprobs, wanted, strict=True):
            chosen = row[token_list[b]]
            rank = int((row > chosen).sum()) + 1
            sampled_logprobs[b] = (float(chosen), rank)
            top = torch.topk(row, params[b].logprobs) if params[b].logprobs > 0 else None
            logprobs[b] = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return SamplerOutput(token_list, logprobs, sampled_logprobs)

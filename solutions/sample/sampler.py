"""From each row of logits to a next token, for the whole step at once.

Greedy rows take the argmax. Sampled rows go through temperature, then the filters — top-k (the k most likely),
top-p (the smallest set whose probability reaches p), min-p (drop tokens less likely than min_p times the most
likely) — batched, each a mask over the rows that use it, then draw one token. The draw is per row: each sequence
owns a host `torch.Generator` and picks its token by inverse CDF, so a seeded request draws the same whatever else
shares the step, on the CPU or a GPU (the uniforms are copied to the logits' device).

Before that, as vLLM does, the raw logits of every row are processed: one additive bias (B, V) holds
`allowed_token_ids`, `logit_bias`, `min_tokens` (-inf on EOS and the stop token ids until enough output) and
`bad_words` (-inf on a word's last token where the output ends with the rest of it); then the repetition,
presence and frequency penalties (`ops/penalties.py`). Each is built only in a step where some row uses it and is
exact for the rows that do not. Logprobs are the raw model's.

Where this lives in vLLM: `vllm/v1/sample/sampler.py`, `vllm/v1/sample/ops/topk_topp_sampler.py`,
`vllm/v1/sample/ops/penalties.py` (and min-p, min_tokens, logit_bias in `vllm/v1/sample/logits_processor/`).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from solutions.sample.ops.penalties import apply_penalties
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
    # (B, V) the nucleus already holds top_p without this token; a float cumulative sum can round up to 1
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
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

    Each filter runs only on the rows whose value filters: a sort of 49,152 logits costs about as much as the
    rest of a row's sampling, and most rows keep all (speculative decoding samples k + 1 rows per sequence).
    """
    vocab_size = logits.shape[-1]
    logits = _on_rows(apply_top_k, logits, top_k, top_k < vocab_size)
    logits = _on_rows(apply_top_p, logits, top_p, top_p < 1)
    return _on_rows(apply_min_p, logits, min_p, min_p > 0)


def _on_rows(
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], logits: torch.Tensor, values: torch.Tensor,
    filters: torch.Tensor,
) -> torch.Tensor:
    """`apply(logits, values)` on the rows where `filters` (B,) bool is True; the other rows are left as they are."""
    rows = filters.nonzero().squeeze(1)  # (Bf,)
    if len(rows) == len(logits):
        return apply(logits, values)
    if len(rows) == 0:
        return logits
    return logits.index_copy(0, rows, apply(logits[rows], values[rows]))  # (B, V), a new tensor


def apply_logit_bias(
    logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]], num_prompt_tokens: list[int],
    eos_token_id: int | None,
) -> torch.Tensor:
    """`allowed_token_ids`, `logit_bias`, `min_tokens` and `bad_words` of every row, as one bias (B, V) added to the
    logits (-inf bans a token)."""
    bias = torch.zeros_like(logits)  # (B, V)
    for b, p in enumerate(params):
        if p.allowed_token_ids is not None:
            bias[b] = float("-inf")
            bias[b, p.allowed_token_ids] = 0.0
        if p.logit_bias:
            bias[b, list(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
        if len(token_ids[b]) - num_prompt_tokens[b] < p.min_tokens:  # EOS and the stop tokens may not end it yet
            stop_ids = p.stop_token_ids + ([eos_token_id] if eos_token_id is not None and not p.ignore_eos else [])
            bias[b, stop_ids] = float("-inf")
        num_output_tokens = len(token_ids[b]) - num_prompt_tokens[b]
        for *prefix, last in p._bad_words_token_ids:  # banned where the output ends with the word's other tokens
            if len(prefix) <= num_output_tokens and token_ids[b][len(token_ids[b]) - len(prefix) :] == prefix:
                bias[b, last] = float("-inf")
    return logits + bias


def penalize(
    logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]], num_prompt_tokens: list[int]
) -> torch.Tensor:
    """`apply_penalties` over every row: each row's prompt and output token ids padded to (B, L) with V. A row
    without penalties gets no tokens (its penalties are neutral: counting its tokens would change nothing)."""
    device, vocab_size = logits.device, logits.shape[1]

    def padded(rows: list[list[int]]) -> torch.Tensor:
        width = max(map(len, rows), default=0)
        return torch.tensor([row + [vocab_size] * (width - len(row)) for row in rows], dtype=torch.long, device=device)

    used = [p.has_penalties for p in params]
    prompts = [ids[:n] if u else [] for ids, n, u in zip(token_ids, num_prompt_tokens, used, strict=True)]
    outputs = [ids[n:] if u else [] for ids, n, u in zip(token_ids, num_prompt_tokens, used, strict=True)]
    return apply_penalties(
        logits, padded(prompts), padded(outputs),
        torch.tensor([float(p.presence_penalty) for p in params], device=device),
        torch.tensor([float(p.frequency_penalty) for p in params], device=device),
        torch.tensor([float(p.repetition_penalty) for p in params], device=device),
    )


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: list[int], num_logprobs: list[int]
) -> list[tuple[list[tuple[int, float]], tuple[float, int]]]:
    """Per row of log-probabilities (N, V): its `num_logprobs` most likely (token, logprob), and the (logprob, rank
    among all tokens) of `token_ids[row]` (the sampled token, or the prompt's actual next token)."""
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device)[:, None])  # (N, 1)
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()  # (N,)
    top = torch.topk(logprobs, max(num_logprobs, default=0), dim=1)  # (N, k) for the largest k asked
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    return [
        (list(zip(top_ids[i][:k], top_values[i][:k], strict=True)), (value, ranks[i]))
        for i, (k, value) in enumerate(zip(num_logprobs, chosen[:, 0].tolist(), strict=True))
    ]


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]  # one per row
    logprobs: list[list[tuple[int, float]] | None]  # per row: the top `logprobs` (token, logprob), or None
    sampled_logprobs: list[tuple[float, int]]  # per row: the sampled token's (logprob, rank among all tokens)


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of non-negative weights (B, V), the token whose cumulative weight first exceeds uniform * total."""
    cdf = weights.cumsum(dim=-1)  # (B, V)
    choice = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(1)  # (B,)
    return choice.clamp(max=weights.shape[-1] - 1)  # guard the float edge u * total == total


def process_logits(
    logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]] | None = None,
    num_prompt_tokens: list[int] | None = None, eos_token_id: int | None = None,
) -> torch.Tensor:
    """The logits (B, V) in float32 after each row's logit bias and penalties — what greedy rows take the argmax
    of and sampled rows draw from. `token_ids[b]` (the row's prompt then its output tokens, the first
    `num_prompt_tokens[b]` the prompt) and the model's `eos_token_id` are needed only when a row has penalties or
    `min_tokens`."""
    logits = logits.float()
    if any(p.has_logit_bias or p.has_penalties for p in params) and (token_ids is None or num_prompt_tokens is None):
        raise ValueError("penalties, min_tokens, logit_bias and allowed_token_ids need token_ids and num_prompt_tokens")
    if any(p.has_logit_bias for p in params):
        logits = apply_logit_bias(logits, params, token_ids, num_prompt_tokens, eos_token_id)
    if any(p.has_penalties for p in params):
        logits = penalize(logits, params, token_ids, num_prompt_tokens)
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
    token_ids: list[list[int]] | None = None, num_prompt_tokens: list[int] | None = None,
    eos_token_id: int | None = None,
) -> SamplerOutput:
    """One next token per row of `logits` (B, V), row b drawn with params[b] and generators[b] after
    `process_logits` (which says when `token_ids`, `num_prompt_tokens` and `eos_token_id` are needed)."""
    raw = logits.float()
    logits = process_logits(raw, params, token_ids, num_prompt_tokens, eos_token_id)
    device = logits.device
    next_ids = logits.argmax(dim=-1)  # (B,) the greedy choice; sampled rows overwrite theirs
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
        next_ids[sampled] = inverse_cdf(probs, uniform)  # (Bs,)
    token_list = next_ids.tolist()

    logprobs: list[list[tuple[int, float]] | None] = [None] * len(params)
    sampled_logprobs: list[tuple[float, int]] = [(0.0, 0)] * len(params)
    wanted = [b for b, p in enumerate(params) if p.logprobs is not None]
    if wanted:  # raw log-probabilities of the model, before penalties, temperature and filters (vLLM's default)
        all_logprobs = torch.log_softmax(raw[wanted], dim=-1)  # (Bw, V)
        gathered = gather_logprobs(all_logprobs, [token_list[b] for b in wanted], [params[b].logprobs for b in wanted])
        for b, (top, chosen) in zip(wanted, gathered, strict=True):
            logprobs[b], sampled_logprobs[b] = top, chosen
    return SamplerOutput(token_list, logprobs, sampled_logprobs)

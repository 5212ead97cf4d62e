"""Verify draft tokens against the target model's distribution, keeping the output exactly the target's.

A sequence that proposed k draft tokens is scored at k + 1 positions in one forward pass: position j gives the
target's distribution for draft token j (j < k), position k the one after the last draft (the bonus row). The
output is the accepted drafts followed by exactly one token the target chooses: at the first rejected position
the recovered token, or, when all k are accepted, the bonus token. So every step yields 1 to k + 1 tokens.

Greedy rows (temperature 0) accept while the draft equals the target's argmax, then emit the target's argmax at
that position: the output is exactly what decoding without speculation would give.

Random rows (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", §2.3; Chen et al.
2023) compare the target's processed distribution p (temperature, top-k, top-p, min-p, as `sampler.sample`
does) with the draft's distribution q: draft token x is accepted with probability min(1, p(x) / q(x)); on
rejection the token is drawn from normalise(max(0, p - q)), the mass p has beyond q. Accepting x or replacing it
then yields p exactly. An n-gram draft has no distribution: q is one-hot on x, so x is accepted with probability
p(x) and the replacement is drawn from p with x removed. The bonus token is drawn from p at the bonus row.

Each random sequence draws k + 1 uniforms from its own generator (the global one when it has none), in a fixed
order: one per draft position for the accept test, then one for the final token (inverse CDF, as `sample`).
A seeded sequence thus draws the same tokens whatever shares its batch, and with k = 0 it samples exactly as
`sample` does. Greedy sequences draw nothing. Penalties and logit processors are the caller's, applied to
`target_logits` before this.

Where this lives in vLLM: `vllm/v1/sample/rejection_sampler.py` (`RejectionSampler`, `rejection_sample`,
`sample_recovered_tokens`); vLLM samples the bonus token outside, with the ordinary sampler, and draws the
recovered token with the exponential race (Gumbel-max) instead of an inverse CDF.
"""

from itertools import accumulate

import torch

from solutions.sample.sampler import apply_top_k_top_p_min_p
from solutions.sampling_params import SamplingParams


def _check_inputs(
    target_logits: torch.Tensor, draft_token_ids: list[list[int]], params: list[SamplingParams],
    generators: list[torch.Generator | None], draft_probs: list[torch.Tensor | None] | None,
) -> None:
    """Raise a ValueError naming the argument whose shape does not fit the others."""
    num_seqs = len(draft_token_ids)
    for name, value in (("params", params), ("generators", generators), ("draft_probs", draft_probs)):
        if value is not None and len(value) != num_seqs:
            raise ValueError(f"{name} must have one entry per sequence ({num_seqs}), got {len(value)}")
    num_rows = sum(len(draft) + 1 for draft in draft_token_ids)
    if target_logits.ndim != 2 or target_logits.shape[0] != num_rows:
        raise ValueError(
            f"target_logits must be (sum of (k_i + 1) = {num_rows}, V), got {tuple(target_logits.shape)}"
        )
    vocab_size = target_logits.shape[1]
    for i, draft in enumerate(draft_token_ids):
        if any(not 0 <= t < vocab_size for t in draft):
            raise ValueError(f"draft_token_ids[{i}] must be token ids in [0, {vocab_size}), got {draft}")
        if draft_probs is not None and draft_probs[i] is not None and draft_probs[i].shape != (len(draft), vocab_size):
            raise ValueError(
                f"draft_probs[{i}] must be (k_i = {len(draft)}, V = {vocab_size}) or None, "
                f"got {tuple(draft_probs[i].shape)}"
            )


def _sample_greedy(argmax: list[int], draft: list[int]) -> list[int]:
    """Accept while the draft equals the target's argmax (argmax has k + 1 entries), then the target's token."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == argmax[accepted]:
        accepted += 1
    return draft[:accepted] + [argmax[accepted]]


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of non-negative weights (B, V), the token whose cumulative weight first exceeds uniform * total."""
    cdf = weights.cumsum(dim=-1)  # (B, V)
    choice = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(1)  # (B,)
    return choice.clamp(max=weights.shape[-1] - 1)  # guard the float edge u * total == total


def rejection_sample(
    target_logits: torch.Tensor, draft_token_ids: list[list[int]], params: list[SamplingParams],
    generators: list[torch.Generator | None], draft_probs: list[torch.Tensor | None] | None = None,
) -> list[list[int]]:
    """Per sequence i, its accepted draft tokens then one more token (recovered or bonus).

    target_logits (sum_i (k_i + 1), V): sequence i's rows are its k_i = len(draft_token_ids[i]) draft positions,
    then its bonus row. draft_probs[i] (k_i, V) is the draft model's distribution at each draft position, None
    (or draft_probs None) for an n-gram draft. generators[i] None draws from the global generator.
    """
    _check_inputs(target_logits, draft_token_ids, params, generators, draft_probs)
    logits = target_logits.float()
    device, vocab_size = logits.device, logits.shape[1]
    num_drafts = [len(draft) for draft in draft_token_ids]
    starts = list(accumulate((k + 1 for k in num_drafts), initial=0))  # first row of each sequence (and the end)
    outputs: list[list[int]] = [[] for _ in draft_token_ids]

    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        argmax = logits.argmax(dim=-1).tolist()  # (N,)
        for i in greedy:
            outputs[i] = _sample_greedy(argmax[starts[i] : starts[i] + num_drafts[i] + 1], draft_token_ids[i])

    randoms = [i for i, p in enumerate(params) if not p.greedy]
    if not randoms:
        return outputs
    # The target's processed distribution p at every row of the random sequences, filtered batched as `sample`.
    rows = [starts[i] + j for i in randoms for j in range(num_drafts[i] + 1)]
    local_starts = list(accumulate((num_drafts[i] + 1 for i in randoms), initial=0))  # into `rows`
    expand = [b for b, i in enumerate(randoms) for _ in range(num_drafts[i] + 1)]  # row -> index into randoms

    def per_row(values: list[float | int]) -> torch.Tensor:
        return torch.tensor([values[b] for b in expand], device=device)

    sampled = [params[i] for i in randoms]
    temperature = per_row([float(p.temperature) for p in sampled])
    top_k = per_row([p.top_k if p.top_k > 0 else vocab_size for p in sampled])
    top_p = per_row([float(p.top_p) for p in sampled])
    min_p = per_row([float(p.min_p) for p in sampled])
    with device:  # factory calls in the filters make their tensors beside the logits
        probs = torch.softmax(
            apply_top_k_top_p_min_p(logits[rows] / temperature[:, None], top_k, top_p, min_p), dim=-1
        )  # (R, V)
    # k_i + 1 uniforms per sequence from its own generator, on the host: k_i accept tests, then the final token
    uniform = torch.cat([torch.rand(num_drafts[i] + 1, generator=generators[i]) for i in randoms]).to(device)  # (R,)

    # Accept test at every draft position: u * q(x) < p(x), i.e. with probability min(1, p(x) / q(x)) for u in
    # [0, 1). At the measure-zero edges it never accepts p(x) = 0 and accepts q(x) = 0 < p(x) (vLLM's p / q >= u
    # rejects q(x) = 0 and accepts p(x) = 0 when u = 0).
    draft_rows = [local_starts[b] + j for b, i in enumerate(randoms) for j in range(num_drafts[i])]
    drafts = torch.tensor([t for i in randoms for t in draft_token_ids[i]], dtype=torch.long, device=device)  # (D,)
    q_rows = {i: draft_probs[i].to(device=device, dtype=torch.float32)
              for i in randoms if draft_probs is not None and draft_probs[i] is not None}
    q_of_draft = torch.cat([
        q_rows[i][torch.arange(num_drafts[i], device=device), draft_token_ids[i]] if i in q_rows
        else torch.ones(num_drafts[i], device=device)  # n-gram: q is one-hot on the draft token
        for i in randoms
    ])  # (D,)
    accept = (uniform[draft_rows] * q_of_draft < probs[draft_rows, drafts]).tolist()  # (D,)

    # The final token: at the first rejected position from max(0, p - q), else the bonus token from p.
    num_accepted, cursor = [], 0
    for i in randoms:
        run = accept[cursor : cursor + num_drafts[i]]
        num_accepted.append(run.index(False) if False in run else num_drafts[i])
        cursor += num_drafts[i]
    final_rows = [local_starts[b] + n for b, n in enumerate(num_accepted)]
    q_final = torch.zeros(len(randoms), vocab_size, device=device)  # (Br, V) zero where nothing was rejected
    for b, (i, n) in enumerate(zip(randoms, num_accepted, strict=True)):
        if n < num_drafts[i]:
            if i in q_rows:
                q_final[b] = q_rows[i][n]
            else:
                q_final[b, draft_token_ids[i][n]] = 1.0
    p_final = probs[final_rows]  # (Br, V)
    residual = (p_final - q_final).clamp(min=0.0)  # (Br, V)
    # p == q up to rounding leaves no residual mass (and then rejection had probability ~0): draw from p
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_final)
    last_uniforms = [local_starts[b] + num_drafts[i] for b, i in enumerate(randoms)]  # each sequence's (k_i+1)-th
    final = _inverse_cdf(residual, uniform[last_uniforms]).tolist()  # (Br,)
    for b, (i, n) in enumerate(zip(randoms, num_accepted, strict=True)):
        outputs[i] = draft_token_ids[i][:n] + [final[b]]
    return outputs

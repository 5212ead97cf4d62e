"""Verify draft tokens against the target model's distribution, keeping the output exactly the target's.

A sequence with k drafts is scored at k + 1 positions in one forward pass: position j gives the target's
distribution for draft j, position k the one after the last draft (the bonus row). The output is the accepted
drafts and exactly one token the target chooses (the recovered token at the first rejection, else the bonus
token): 1 to k + 1 tokens a step.

Greedy rows (temperature 0) accept while the draft equals the target's argmax, then emit that argmax: exactly
decoding without speculation. Random rows (Leviathan et al. 2023, §2.3; Chen et al. 2023) accept draft x with
probability min(1, p(x) / q(x)), p the target's processed distribution (as `sampler.sample`), q the draft's; on
rejection the token is drawn from normalise(max(0, p - q)), which yields p exactly. An n-gram draft's q is one-hot
on x: x is accepted with probability p(x), the replacement drawn from p without x.

Each random sequence draws k + 1 uniforms from its own generator (the global one without), one per draft then one
for the final token (inverse CDF, as `sample`), so a seeded sequence draws the same tokens whatever shares its
batch, and with k = 0 samples exactly as `sample`. Penalties and logit processors are applied by the caller.

Where this lives in vLLM: `vllm/v1/sample/rejection_sampler.py` (`RejectionSampler`, `rejection_sample`,
`sample_recovered_tokens`); vLLM samples the bonus token outside, with the ordinary sampler, and draws the
recovered token with the exponential race (Gumbel-max) instead of an inverse CDF.
"""

from itertools import accumulate

import torch

from solutions.sample.sampler import apply_top_k_top_p_min_p, inverse_cdf
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
        raise ValueError(f"target_logits must be (sum of (k_i + 1) = {num_rows}, V), got {tuple(target_logits.shape)}")
    vocab_size = target_logits.shape[1]
    for i, draft in enumerate(draft_token_ids):
        if any(not 0 <= t < vocab_size for t in draft):
            raise ValueError(f"draft_token_ids[{i}] must be token ids in [0, {vocab_size}), got {draft}")
        if draft_probs is not None and draft_probs[i] is not None and draft_probs[i].shape != (len(draft), vocab_size):
            raise ValueError(f"draft_probs[{i}] must be (k_i = {len(draft)}, V = {vocab_size}) or None, "
                             f"got {tuple(draft_probs[i].shape)}")


def rejection_greedy_sample(target_argmax: list[int], draft_token_ids: list[int]) -> list[int]:
    """One greedy sequence: accept its drafts while each equals the target's argmax at its position, then emit the
    target's argmax at the first mismatch, or at the bonus row when all k match. `target_argmax` has k + 1 entries."""
    accepted = 0
    while accepted < len(draft_token_ids) and draft_token_ids[accepted] == target_argmax[accepted]:
        accepted += 1
    return draft_token_ids[:accepted] + [target_argmax[accepted]]


def rejection_random_sample(
    target_probs: torch.Tensor, draft_token_ids: list[int], draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """One random sequence: its accepted drafts, then one token drawn from the residual or, all accepted, from p.

    target_probs (k + 1, V) is the target's processed distribution p at the k draft rows and the bonus row;
    draft_probs (k, V) the draft model's q, None for an n-gram draft (q one-hot on each draft token). Exactly
    k + 1 uniforms are drawn from `generator` (the global one if None), on the host: k accept tests, then the final
    token by inverse CDF.
    """
    num_drafts, device = len(draft_token_ids), target_probs.device
    uniform = torch.rand(num_drafts + 1, generator=generator).to(device)  # (k + 1,)
    drafts = torch.tensor(draft_token_ids, dtype=torch.long, device=device)  # (k,)
    positions = torch.arange(num_drafts, device=device)  # (k,)
    q_of_draft = torch.ones(num_drafts, device=device) if draft_probs is None else draft_probs[positions, drafts]
    # Accept test at every draft position: u * q(x) < p(x), i.e. with probability min(1, p(x) / q(x)) for u in
    # [0, 1). At the measure-zero edges it never accepts p(x) = 0 and accepts q(x) = 0 < p(x) (vLLM's p / q >= u
    # rejects q(x) = 0 and accepts p(x) = 0 when u = 0).
    accept = (uniform[:num_drafts] * q_of_draft < target_probs[positions, drafts]).tolist()  # (k,)
    num_accepted = accept.index(False) if False in accept else num_drafts
    p = target_probs[num_accepted]  # (V,) at the first rejected position, or the bonus row
    weights = p
    if num_accepted < num_drafts:  # rejected: draw from the mass p has beyond q, normalise(max(0, p - q))
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[draft_token_ids[num_accepted]] = 1.0
        else:
            q = draft_probs[num_accepted]
        residual = (p - q).clamp(min=0.0)  # (V,)
        # p == q up to rounding leaves no residual mass (and then rejection had probability ~0): draw from p
        weights = residual if residual.sum() > 0 else p
    final = int(inverse_cdf(weights[None], uniform[num_drafts:])[0])
    return draft_token_ids[:num_accepted] + [final]


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
            outputs[i] = rejection_greedy_sample(argmax[starts[i] : starts[i + 1]], draft_token_ids[i])

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
    for b, i in enumerate(randoms):  # one sequence at a time, each drawing from its own generator
        q = None if draft_probs is None or draft_probs[i] is None else draft_probs[i].to(device, torch.float32)
        target = probs[local_starts[b] : local_starts[b + 1]]  # (k_i + 1, V)
        outputs[i] = rejection_random_sample(target, draft_token_ids[i], q, generators[i])
    return outputs

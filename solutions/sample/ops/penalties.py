"""Repetition, presence and frequency penalties: push a row's logits away from the tokens it has already seen.

- repetition penalty r (the CTRL paper's; Hugging Face's `RepetitionPenaltyLogitsProcessor`): for every token in
  the prompt *or* the output, a positive logit is divided by r and a negative one multiplied by r, so r > 1 makes
  the token less likely either way (dividing a negative logit would make it *more* likely). 1 changes nothing.
- frequency penalty f and presence penalty p (OpenAI's): for every token of the *output* with count c,
  `logit - c * f - (c > 0) * p`. 0 changes nothing; negative values encourage repeats.

Every row has its own three penalties, and all rows are penalised at once: the token lists become per-row counts
over the vocabulary (B, V) with one `scatter_add_`, and everything after is elementwise. A row with neutral
penalties comes out bit for bit as it went in (x / 1 and x * 1 are exact, and so is x - 0 * c).

Where this lives in vLLM: `vllm/v1/sample/ops/penalties.py` and `apply_penalties` in
`vllm/model_executor/layers/utils.py`.
"""

import torch


def get_token_bin_counts_and_mask(token_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each token occurs in each row: token_ids (B, L) int64, padded with `vocab_size` (rows may be
    shorter than L) -> counts (B, V) int64 and mask (B, V) bool (count > 0). The padding id lands in an extra
    column that is dropped."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.long, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    counts = counts[:, :vocab_size]
    return counts, counts > 0


def apply_penalties(
    logits: torch.Tensor, prompt_token_ids: torch.Tensor, output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor, frequency_penalties: torch.Tensor, repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """The penalised logits (B, V) (a new tensor; `logits` is not changed).

    logits (B, V) float; prompt_token_ids (B, Lp) and output_token_ids (B, Lo) int64, each row padded with V
    (the vocabulary size, an id no token has); presence_penalties, frequency_penalties, repetition_penalties (B,)
    float. The repetition penalty covers prompt and output tokens, the other two the output tokens only.
    """
    vocab_size = logits.shape[1]
    _, prompt_mask = get_token_bin_counts_and_mask(prompt_token_ids, vocab_size)  # (B, V)
    output_counts, output_mask = get_token_bin_counts_and_mask(output_token_ids, vocab_size)  # (B, V)
    seen = prompt_mask | output_mask  # (B, V)
    penalty = torch.where(seen, repetition_penalties[:, None], 1.0).to(logits.dtype)  # (B, V)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - frequency_penalties[:, None] * output_counts  # (B, V)
    return logits - presence_penalties[:, None] * output_mask

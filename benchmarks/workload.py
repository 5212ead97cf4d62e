"""A seeded, ShareGPT-like stream of request lengths (no text: memory experiments only need lengths).

Source of the means: the vLLM paper (Kwon et al., SOSP 2023, arXiv 2309.06180), Fig. 11a and §6.1 — on
ShareGPT, prompts average 161.31 tokens and outputs 337.99 tokens (OPT tokenizer).

The fit: the paper gives means only. Chat lengths are positive and right-skewed with a long tail, so we draw
prompt and output lengths independently from lognormals. We choose the spread, not fit it: σ = √ln 2 ≈ 0.83,
which makes the standard deviation equal to the mean (coefficient of variation 1, since CV² = e^σ² − 1). Then
μ = ln(mean) − σ²/2, so that the untruncated mean is the paper's. Lengths are rounded, prompts clipped to
[1, max_model_len // 2] (the prompt cap of vLLM's ShareGPT benchmark) and outputs to
[1, max_model_len − prompt], so every request fits in `max_model_len`. Clipping trims the tail, so the realised
means come out a little below the paper's; `describe` reports them.
"""

import math
from dataclasses import dataclass

import numpy as np

SHAREGPT_MEAN_PROMPT_LEN = 161.31  # vLLM paper, Fig. 11a
SHAREGPT_MEAN_OUTPUT_LEN = 337.99  # vLLM paper, Fig. 11a
SIGMA = math.sqrt(math.log(2.0))  # lognormal σ with standard deviation == mean (our choice, see above)
MAX_MODEL_LEN = 2048  # OPT's context length, the paper's Orca (Max) reservation


@dataclass(frozen=True, slots=True)
class Request:
    """What a memory simulation needs to know about a request: its id and true lengths."""

    request_id: int
    prompt_len: int
    output_len: int


def lognormal_mu(mean: float, sigma: float) -> float:
    """μ of the lognormal with this mean and σ (mean = e^(μ + σ²/2))."""
    return math.log(mean) - sigma**2 / 2


def sample_lengths(
    num_requests: int, seed: int, max_model_len: int = MAX_MODEL_LEN, sigma: float = SIGMA
) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths, each an int64 array of shape (num_requests,)."""
    rng = np.random.default_rng(seed)
    raw_prompt = rng.lognormal(lognormal_mu(SHAREGPT_MEAN_PROMPT_LEN, sigma), sigma, num_requests)
    raw_output = rng.lognormal(lognormal_mu(SHAREGPT_MEAN_OUTPUT_LEN, sigma), sigma, num_requests)
    prompt_lens = np.clip(np.rint(raw_prompt), 1, max_model_len // 2).astype(np.int64)
    output_lens = np.clip(np.rint(raw_output), 1, max_model_len - prompt_lens).astype(np.int64)
    return prompt_lens, output_lens


def sharegpt_like_requests(
    num_requests: int, seed: int, max_model_len: int = MAX_MODEL_LEN, sigma: float = SIGMA
) -> list[Request]:
    """`num_requests` requests in arrival order, ids 0..num_requests-1; the same seed gives the same list."""
    prompt_lens, output_lens = sample_lengths(num_requests, seed, max_model_len, sigma)
    return [Request(i, int(p), int(o)) for i, (p, o) in enumerate(zip(prompt_lens, output_lens))]


def describe(requests: list[Request]) -> str:
    """One line with the realised means beside the paper's."""
    mean_prompt = sum(r.prompt_len for r in requests) / len(requests)
    mean_output = sum(r.output_len for r in requests) / len(requests)
    return (
        f"{len(requests)} requests; mean prompt {mean_prompt:.1f} tokens (paper {SHAREGPT_MEAN_PROMPT_LEN}), "
        f"mean output {mean_output:.1f} tokens (paper {SHAREGPT_MEAN_OUTPUT_LEN}); lognormal σ = {SIGMA:.2f}"
    )

"""Token bitmasks: which tokens a request may sample next, one bit per token, and how they reach the logits.

A mask row is `ceil(V / 32)` int32 words; bit `j` of word `w` says whether token `32 * w + j` is allowed (the
layout of llguidance and xgrammar, and so of vLLM). A bit per token keeps a batch's masks small: SmolLM2's
49,152 tokens take 6 KiB per row, where a bool per token would take 48 KiB and a float per token 192 KiB.
Applying a row sets every disallowed token's logit to -inf, so softmax gives it probability 0 and argmax never
picks it: greedy and sampled requests alike can only produce what the grammar allows.

Where this lives in vLLM: `vllm/v1/structured_output/utils.py` and `apply_grammar_bitmask` in
`vllm/v1/worker/gpu_model_runner.py` (which calls xgrammar's `apply_token_bitmask_inplace` kernel).
"""

import torch

ALL_ALLOWED = -1  # an int32 word with all 32 bits set


def bitmask_width(vocab_size: int) -> int:
    """int32 words per mask row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A (num_rows, ceil(V / 32)) int32 mask, every token allowed."""
    return torch.full((num_rows, bitmask_width(vocab_size)), ALL_ALLOWED, dtype=torch.int32)


def pack_token_bitmask(token_ids: list[int], num_words: int) -> torch.Tensor:
    """One mask row (num_words,) int32 with exactly the bits of `token_ids` set."""
    words = torch.zeros(num_words, dtype=torch.int64)
    ids = torch.tensor(sorted(set(token_ids)), dtype=torch.int64)
    words.index_add_(0, ids // 32, 1 << (ids % 32))  # distinct ids: each bit added once
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31 is int32's sign bit


def unpack_token_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool (N, V) allowed-token matrix of a (N, W) int32 mask; tokens past the mask's 32 * W bits are not
    allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # (32,)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)  # (N, 32 * W): bit j of word w is token 32w + j
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)


# The 8 bits of each byte value as additive logit terms, lowest bit first: 0 where set (allowed), -inf where not.
_BYTE_TO_LOGIT_TERMS = torch.where(((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` (N, V) with every token that row n's mask (N, W) int32 does not allow set to -inf (a new tensor).

    Read a byte at a time: one table lookup turns a mask byte into its 8 tokens' terms, 0 or -inf, and adding
    them leaves allowed logits exactly as they were. (An int32's bytes are little-endian on every CPU and GPU
    torch runs on, so byte k of word w holds tokens 32w + 8k to 32w + 8k + 7.) One gather per byte does less
    work than 32 shifts per word and a `masked_fill`; chapter 08's notebook times the two side by side on the
    machine that runs it. The terms take the logits' dtype and device, so bf16 logits stay bf16.
    """
    vocab_size = logits.shape[-1]
    terms = _BYTE_TO_LOGIT_TERMS.to(logits.device, logits.dtype)
    mask_bytes = bitmask.to(logits.device).contiguous().view(torch.uint8).long()  # (N, 4W)
    additive = terms[mask_bytes].flatten(1)  # (N, 32W)
    if additive.shape[1] < vocab_size:  # tokens past the mask's bits are not allowed
        additive = torch.nn.functional.pad(additive, (0, vocab_size - additive.shape[1]), value=float("-inf"))
    return logits + additive[:, :vocab_size]

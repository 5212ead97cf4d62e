"""Comparing greedy token streams the way vLLM's model tests do (`check_logprobs_close`)."""

import functools
from pathlib import Path

import torch

from grading.tiny_models import hf_model


@functools.cache
def hf_oracle(folder: Path | str) -> torch.nn.Module:
    """The Hugging Face model of a checkpoint folder, loaded once per process."""
    return hf_model(folder)


@functools.cache
def hf_greedy(folder: Path | str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """Hugging Face's greedy continuation of `prompt` (EOS ignored), computed once per prompt."""
    with torch.inference_mode():
        out = hf_oracle(folder).generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


def assert_greedy_close(ours: list[int], theirs: list[int], prompt: list[int], oracle: torch.nn.Module) -> None:
    """Equal token ids, or a first divergence where each side's token is in the other's top-2 (a float tie).

    After a justified divergence the streams are different texts, so comparison stops there.
    """
    assert len(ours) == len(theirs), f"lengths differ: {len(ours)} vs {len(theirs)}"
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a == b:
            continue
        with torch.inference_mode():
            logits = oracle(torch.tensor([prompt + theirs[:i]])).logits[0, -1]
        top2 = logits.topk(2).indices.tolist()
        assert a in top2 and b in top2, (
            f"token {i} differs: ours {a}, reference {b}; reference top-2 {top2} "
            f"(logits {logits[top2].tolist()}) — not a near-tie"
        )
        return

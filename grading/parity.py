"""Comparing greedy token streams the way vLLM's model tests do (`check_logprobs_close`)."""

import torch


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

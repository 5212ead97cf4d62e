"""Chapter 2: a KV cache reserved contiguously per request, and generation that reuses it.

Prefill runs the prompt once and stores every layer's keys and values; each decode step then feeds only
the newest token, appends its K/V, and attends over the stored prefix. Per-token cost stops growing with
the sequence (except the attention read itself), at the price of reserving `max_len` slots up front.

Where this lives in vLLM: nowhere any more — this is the layout vLLM replaced (Orca/FasterTransformer
style); Hugging Face's `DynamicCache`/`StaticCache` are the same idea.
"""

import torch

from solutions.attention.causal import causal_attention
from solutions.model.llama import LlamaForCausalLM


class ContiguousKVCache:
    """One request's keys and values: per layer a (max_len, Hkv, D) tensor, positions 0..max_len-1.

    Invariant: slots [0, num_tokens) of every layer hold the K/V of the tokens at those positions;
    later slots are reserved but hold nothing useful.
    """

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int) -> None:
        self.max_len = max_len
        self.keys = [torch.zeros(max_len, num_kv_heads, head_dim) for _ in range(num_layers)]
        self.values = [torch.zeros(max_len, num_kv_heads, head_dim) for _ in range(num_layers)]

    def write(self, layer_idx: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (T, Hkv, D) of the tokens at `positions` (T,) in layer `layer_idx`'s slots."""
        if int(positions.max()) >= self.max_len:
            raise ValueError(f"position {int(positions.max())} is past the reserved max_len {self.max_len}")
        self.keys[layer_idx][positions] = k
        self.values[layer_idx][positions] = v

    def read(self, layer_idx: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (length, Hkv, D) of positions 0..length-1 (views: no copy)."""
        return self.keys[layer_idx][:length], self.values[layer_idx][:length]

    @classmethod
    def for_model(cls, model: LlamaForCausalLM, max_len: int) -> "ContiguousKVCache":
        c = model.config
        return cls(c.num_hidden_layers, max_len, c.num_key_value_heads, c.head_dim)


class ContiguousAttention:
    """Backend for one step of one sequence: the step's tokens sit at positions start..start+T-1."""

    def __init__(self, cache: ContiguousKVCache, start: int) -> None:
        self.cache, self.start = cache, start

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        end = self.start + q.shape[0]
        self.cache.write(layer_idx, torch.arange(self.start, end), k, v)
        keys, values = self.cache.read(layer_idx, end)  # (end, Hkv, D): the whole prefix, this step included
        return causal_attention(q, keys, values, scale=q.shape[-1] ** -0.5)  # (T, Hq, D)


def prefill(model: LlamaForCausalLM, cache: ContiguousKVCache, prompt_ids: list[int]) -> torch.Tensor:
    """Run the whole prompt once, filling the cache; return the logits (V,) that predict the next token."""
    positions = torch.arange(len(prompt_ids))  # (T,)
    hidden = model(torch.tensor(prompt_ids), positions, ContiguousAttention(cache, 0))  # (T, D_model)
    return model.compute_logits(hidden[-1:])[0]  # (V,): only the last row is needed


def decode_step(model: LlamaForCausalLM, cache: ContiguousKVCache, token_id: int, position: int) -> torch.Tensor:
    """Feed one token at `position` (its K/V join the cache); return the logits (V,) for the next one."""
    hidden = model(torch.tensor([token_id]), torch.tensor([position]), ContiguousAttention(cache, position))
    return model.compute_logits(hidden)[0]  # (V,)


def generate_with_cache(
    model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int, max_len: int | None = None
) -> list[int]:
    """Greedy generation: one prefill, then one decode step per token. Same tokens as `generate_naive`.

    `max_len` is the reservation (default: exactly prompt + new tokens, the "oracle" policy).
    """
    if max_new_tokens == 0:
        return []
    cache = ContiguousKVCache.for_model(model, max_len or len(prompt_ids) + max_new_tokens)
    new_tokens = [int(prefill(model, cache, prompt_ids).argmax())]
    for position in range(len(prompt_ids), len(prompt_ids) + max_new_tokens - 1):
        new_tokens.append(int(decode_step(model, cache, new_tokens[-1], position).argmax()))
    return new_tokens

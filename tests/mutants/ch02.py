"""Plausible wrong answers to chapter 02's exercises. Each must fail at least one test of its exercise."""

import torch

from solutions.baselines import contiguous_cache
from solutions.baselines.contiguous_cache import ContiguousAttention, ContiguousKVCache, decode_step, prefill
from solutions.model.llama import LlamaForCausalLM


class CacheWriteIgnoresPositions(ContiguousKVCache):
    """Stores the step's tokens in slots 0..T-1: right for prefill, but each decode token overwrites slot 0."""

    def write(self, layer_idx: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys[layer_idx][: k.shape[0]] = k
        self.values[layer_idx][: v.shape[0]] = v


class CacheReadsWholeReservation(ContiguousKVCache):
    """Returns all `max_len` slots, so attention also sees the reserved-but-empty (zero) slots."""

    def read(self, layer_idx: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer_idx], self.values[layer_idx]


class CacheWriteClampsPastMaxLen(ContiguousKVCache):
    """Silently drops tokens that do not fit instead of telling the caller the reservation was too small."""

    def write(self, layer_idx: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        fits = positions < self.max_len
        self.keys[layer_idx][positions[fits]] = k[fits]
        self.values[layer_idx][positions[fits]] = v[fits]


def prefill_returns_first_row_logits(
    model: LlamaForCausalLM, cache: ContiguousKVCache, prompt_ids: list[int]
) -> torch.Tensor:
    hidden = model(torch.tensor(prompt_ids), torch.arange(len(prompt_ids)), ContiguousAttention(cache, 0))
    return model.compute_logits(hidden)[0]  # row 0 predicts the token after the *first* prompt token


def prefill_positions_from_one(
    model: LlamaForCausalLM, cache: ContiguousKVCache, prompt_ids: list[int]
) -> torch.Tensor:
    positions = torch.arange(1, len(prompt_ids) + 1)  # 1-based positions: every RoPE rotation is one step off
    hidden = model(torch.tensor(prompt_ids), positions, ContiguousAttention(cache, 0))
    return model.compute_logits(hidden[-1:])[0]


def decode_step_one_position_late(
    model: LlamaForCausalLM, cache: ContiguousKVCache, token_id: int, position: int
) -> torch.Tensor:
    # treats `position` as "tokens so far, counting the prompt's last one twice": leaves an empty slot behind
    return decode_step(model, cache, token_id, position + 1)


def decode_step_restarts_the_cache(
    model: LlamaForCausalLM, cache: ContiguousKVCache, token_id: int, position: int
) -> torch.Tensor:
    # right rotation, but the backend starts at 0: the token overwrites slot 0 and attends only to itself
    hidden = model(torch.tensor([token_id]), torch.tensor([position]), ContiguousAttention(cache, 0))
    return model.compute_logits(hidden)[0]


def generate_with_cache_one_token_too_many(
    model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int, max_len: int | None = None
) -> list[int]:
    # forgets that prefill already produced the first new token: max_new_tokens decode steps instead of one fewer
    cache = ContiguousKVCache.for_model(model, max_len or len(prompt_ids) + max_new_tokens + 1)
    new_tokens = [int(prefill(model, cache, prompt_ids).argmax())]
    for position in range(len(prompt_ids), len(prompt_ids) + max_new_tokens):
        new_tokens.append(int(decode_step(model, cache, new_tokens[-1], position).argmax()))
    return new_tokens


def generate_with_cache_decodes_at_the_prompt_length(
    model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int, max_len: int | None = None
) -> list[int]:
    if max_new_tokens == 0:
        return []
    cache = ContiguousKVCache.for_model(model, max_len or len(prompt_ids) + max_new_tokens)
    new_tokens = [int(prefill(model, cache, prompt_ids).argmax())]
    for _ in range(max_new_tokens - 1):  # the position never advances: every step overwrites the same slot
        new_tokens.append(int(decode_step(model, cache, new_tokens[-1], len(prompt_ids)).argmax()))
    return new_tokens


def generate_with_cache_ignores_max_len(
    model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int, max_len: int | None = None
) -> list[int]:
    return contiguous_cache.generate_with_cache(model, prompt_ids, max_new_tokens)  # always the oracle reservation


MUTANTS = {
    "cache_write_ignores_positions": {"ContiguousKVCache": CacheWriteIgnoresPositions},
    "cache_reads_whole_reservation": {"ContiguousKVCache": CacheReadsWholeReservation},
    "cache_write_clamps_past_max_len": {"ContiguousKVCache": CacheWriteClampsPastMaxLen},
    "prefill_returns_first_row_logits": {"prefill": prefill_returns_first_row_logits},
    "prefill_positions_from_one": {"prefill": prefill_positions_from_one},
    "decode_step_one_position_late": {"decode_step": decode_step_one_position_late},
    "decode_step_restarts_the_cache": {"decode_step": decode_step_restarts_the_cache},
    "generate_with_cache_one_token_too_many": {"generate_with_cache": generate_with_cache_one_token_too_many},
    "generate_with_cache_decodes_at_the_prompt_length": {
        "generate_with_cache": generate_with_cache_decodes_at_the_prompt_length
    },
    "generate_with_cache_ignores_max_len": {"generate_with_cache": generate_with_cache_ignores_max_len},
}

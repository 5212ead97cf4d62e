"""Plausible wrong answers to chapter 02's exercises. Each must fail at least one test of its exercise.

Mutants call only the reference objects imported below by value, never `contiguous_cache.<name>` at call time: the
capstone swaps the learner's objects into that module, so such a lookup could end up calling the mutant itself.
"""

import torch

from solutions.baselines.contiguous_cache import ContiguousAttention, ContiguousKVCache, decode_step, prefill
from solutions.model.llama import LlamaForCausalLM

# --- ContiguousKVCache ---------------------------------------------------------------------------------------


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


class CacheBoundCheckOffByOne(ContiguousKVCache):
    """`>` where `>=` belongs: position max_len passes the check, and indexing fails with torch's IndexError."""

    def write(self, layer_idx: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if int(positions.max()) > self.max_len:
            raise ValueError(f"position {int(positions.max())} is past the reserved max_len {self.max_len}")
        self.keys[layer_idx][positions] = k
        self.values[layer_idx][positions] = v


class CacheChecksOnlyTheFirstPosition(ContiguousKVCache):
    """Checks where the write starts, not where it ends: a prefill that runs past the reservation gets an
    IndexError from torch (or, with slicing, a silently short write) instead of the ValueError."""

    def write(self, layer_idx: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if int(positions[0]) >= self.max_len:
            raise ValueError(f"position {int(positions[0])} is past the reserved max_len {self.max_len}")
        self.keys[layer_idx][positions] = k
        self.values[layer_idx][positions] = v


# --- prefill -------------------------------------------------------------------------------------------------


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


def prefill_returns_every_row(model: LlamaForCausalLM, cache: ContiguousKVCache, prompt_ids: list[int]) -> torch.Tensor:
    hidden = model(torch.tensor(prompt_ids), torch.arange(len(prompt_ids)), ContiguousAttention(cache, 0))
    return model.compute_logits(hidden)  # (T, V): chapter 1's forward, not the one prediction asked for


def prefill_leaves_the_last_token_to_decode(
    model: LlamaForCausalLM, cache: ContiguousKVCache, prompt_ids: list[int]
) -> torch.Tensor:
    # "decode feeds one token, so prefill must stop one short": the last prompt token is never fed
    prefix = prompt_ids[:-1]
    hidden = model(torch.tensor(prefix), torch.arange(len(prefix)), ContiguousAttention(cache, 0))
    return model.compute_logits(hidden[-1:])[0]


# --- decode_step ---------------------------------------------------------------------------------------------


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


def decode_step_rotates_at_position_zero(
    model: LlamaForCausalLM, cache: ContiguousKVCache, token_id: int, position: int
) -> torch.Tensor:
    # the right slot, but positions = arange(T) as in prefill: the new token's q and k turn by angle 0
    hidden = model(torch.tensor([token_id]), torch.arange(1), ContiguousAttention(cache, position))
    return model.compute_logits(hidden)[0]


def decode_step_writes_one_slot_early(
    model: LlamaForCausalLM, cache: ContiguousKVCache, token_id: int, position: int
) -> torch.Tensor:
    # "the cache holds `position` tokens, so the last one is at position - 1": overwrites the previous token's K/V
    hidden = model(torch.tensor([token_id]), torch.tensor([position]), ContiguousAttention(cache, position - 1))
    return model.compute_logits(hidden)[0]


# --- generate_with_cache -------------------------------------------------------------------------------------


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
    if max_new_tokens == 0:
        return []
    cache = ContiguousKVCache.for_model(model, len(prompt_ids) + max_new_tokens)  # always the oracle reservation
    new_tokens = [int(prefill(model, cache, prompt_ids).argmax())]
    for position in range(len(prompt_ids), len(prompt_ids) + max_new_tokens - 1):
        new_tokens.append(int(decode_step(model, cache, new_tokens[-1], position).argmax()))
    return new_tokens


def generate_with_cache_first_decode_one_position_late(
    model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int, max_len: int | None = None
) -> list[int]:
    if max_new_tokens == 0:
        return []
    cache = ContiguousKVCache.for_model(model, max_len or len(prompt_ids) + max_new_tokens)
    new_tokens = [int(prefill(model, cache, prompt_ids).argmax())]
    # "the prompt's last token is at len(prompt_ids)": decodes start at p + 1, leaving slot p empty (zeros)
    for position in range(len(prompt_ids) + 1, len(prompt_ids) + max_new_tokens):
        new_tokens.append(int(decode_step(model, cache, new_tokens[-1], position).argmax()))
    return new_tokens


def generate_with_cache_always_prefills_a_token(
    model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int, max_len: int | None = None
) -> list[int]:
    # no special case for zero new tokens: prefill's token is returned even when none was asked for
    cache = ContiguousKVCache.for_model(model, max_len or len(prompt_ids) + max(max_new_tokens, 1))
    new_tokens = [int(prefill(model, cache, prompt_ids).argmax())]
    for position in range(len(prompt_ids), len(prompt_ids) + max_new_tokens - 1):
        new_tokens.append(int(decode_step(model, cache, new_tokens[-1], position).argmax()))
    return new_tokens


MUTANTS = {
    "cache_write_ignores_positions": {"ContiguousKVCache": CacheWriteIgnoresPositions},
    "cache_reads_whole_reservation": {"ContiguousKVCache": CacheReadsWholeReservation},
    "cache_write_clamps_past_max_len": {"ContiguousKVCache": CacheWriteClampsPastMaxLen},
    "cache_bound_check_off_by_one": {"ContiguousKVCache": CacheBoundCheckOffByOne},
    "cache_checks_only_the_first_position": {"ContiguousKVCache": CacheChecksOnlyTheFirstPosition},
    "prefill_returns_first_row_logits": {"prefill": prefill_returns_first_row_logits},
    "prefill_positions_from_one": {"prefill": prefill_positions_from_one},
    "prefill_returns_every_row": {"prefill": prefill_returns_every_row},
    "prefill_leaves_the_last_token_to_decode": {"prefill": prefill_leaves_the_last_token_to_decode},
    "decode_step_one_position_late": {"decode_step": decode_step_one_position_late},
    "decode_step_restarts_the_cache": {"decode_step": decode_step_restarts_the_cache},
    "decode_step_rotates_at_position_zero": {"decode_step": decode_step_rotates_at_position_zero},
    "decode_step_writes_one_slot_early": {"decode_step": decode_step_writes_one_slot_early},
    "generate_with_cache_one_token_too_many": {"generate_with_cache": generate_with_cache_one_token_too_many},
    "generate_with_cache_decodes_at_the_prompt_length": {
        "generate_with_cache": generate_with_cache_decodes_at_the_prompt_length
    },
    "generate_with_cache_ignores_max_len": {"generate_with_cache": generate_with_cache_ignores_max_len},
    "generate_with_cache_first_decode_one_position_late": {
        "generate_with_cache": generate_with_cache_first_decode_one_position_late
    },
    "generate_with_cache_always_prefills_a_token": {"generate_with_cache": generate_with_cache_always_prefills_a_token},
}

# For each exercise, a mutant that changes SmolLM2's greedy tokens: the capstone must fail on it, which proves the
# capstone's generation really runs through that exercise.
CAPSTONE_MUTANTS = {
    "ContiguousKVCache": "cache_write_ignores_positions",
    "prefill": "prefill_returns_first_row_logits",
    "decode_step": "decode_step_rotates_at_position_zero",
    "generate_with_cache": "generate_with_cache_decodes_at_the_prompt_length",
}

# The statements each exercise's question is about, as `ast.unparse` writes them (a compound statement by its
# header). Hint 2 may show none of them, and nothing under chapters/ may state them (tests/test_hints.py): they
# live here, beside the wrong answers, because a learner reads the chapter's test file.
DECISIVE = {
    "ContiguousKVCache": [
        'if int(positions.max()) >= self.max_len:',
        'return (self.keys[layer_idx][:length], self.values[layer_idx][:length])',
    ],
    "prefill": [
        'positions = torch.arange(len(prompt_ids))',
        'return model.compute_logits(hidden[-1:])[0]',
    ],
    "decode_step": [
        'hidden = model(torch.tensor([token_id]), torch.tensor([position]), ContiguousAttention(cache, position))',
    ],
    "generate_with_cache": [
        'for position in range(len(prompt_ids), len(prompt_ids) + max_new_tokens - 1):',
        'new_tokens.append(int(decode_step(model, cache, new_tokens[-1], position).argmax()))',
    ],
}

"""Plausible wrong answers to chapter 03's exercises. Each must fail at least one test of its exercise.

Class exercises are mutated by subclassing the reference and overriding the one method that goes wrong.
"""

import torch

from solutions.attention.causal import causal_attention
from solutions.core.block_manager import BlockManager, cdiv
from solutions.core.block_pool import FreeKVCacheBlockQueue, KVCacheBlock
from solutions.model.llama import LlamaForCausalLM
from solutions.worker.model_runner import ModelRunner
from solutions.attention.paged import AttentionMetadata, gather_kv
from solutions.baselines.paged_generation import generate_paged
from solutions.core.sched.output import SchedulerOutput
from solutions.core.sequence import Sequence

# --- FreeKVCacheBlockQueue ----------------------------------------------------------------------------------------


class RemoveForgetsBackLink(FreeKVCacheBlockQueue):
    """Fixes the forward link around the removed block but not the backward one: `tail.prev` goes stale."""

    def remove(self, block: KVCacheBlock) -> None:
        prev, next_ = block.prev_free_block, block.next_free_block
        if prev is None or next_ is None:
            raise RuntimeError(f"block {block.block_id} is not in the free block queue")
        prev.next_free_block = next_
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1


class RemoveKeepsItsLinks(FreeKVCacheBlockQueue):
    """Unlinks the block from its neighbours but leaves its own links set, so it still looks queued."""

    def remove(self, block: KVCacheBlock) -> None:
        prev, next_ = block.prev_free_block, block.next_free_block
        if prev is None or next_ is None:
            raise RuntimeError(f"block {block.block_id} is not in the free block queue")
        prev.next_free_block = next_
        next_.prev_free_block = prev
        self.num_free_blocks -= 1


class PopleftTakesTheTail(FreeKVCacheBlockQueue):
    """A stack, not a queue: hands out the most recently freed block first."""

    def popleft(self) -> KVCacheBlock:
        block = self.tail.prev_free_block
        if block is self.head:
            raise RuntimeError("popleft from an empty free block queue")
        self.remove(block)
        return block


# --- BlockManager -------------------------------------------------------------------------------------------------


class FreeForgetsTheLastBlock(BlockManager):
    """A leak: the partly filled last block never goes back to the pool."""

    def free(self, seq: Sequence) -> None:
        blocks = self.block_pool.blocks
        self.block_pool.free_blocks(blocks[block_id] for block_id in reversed(seq.block_table[:-1]))
        seq.block_table.clear()


class FreeInTableOrder(BlockManager):
    """Frees first block first: the sequence's head would be evicted before its tail once prefixes are cached."""

    def free(self, seq: Sequence) -> None:
        blocks = self.block_pool.blocks
        self.block_pool.free_blocks(blocks[block_id] for block_id in seq.block_table)
        seq.block_table.clear()


class AllocateRoundsDown(BlockManager):
    """Prefill gets `num_tokens // block_size` blocks: a prompt's partial last block has nowhere to go."""

    def can_allocate(self, seq: Sequence) -> bool:
        return seq.num_tokens // self.block_size <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        blocks = self.block_pool.get_new_blocks(seq.num_tokens // self.block_size)
        seq.block_table.extend(block.block_id for block in blocks)


class CanAllocateStrict(BlockManager):
    """`<` for `<=`: refuses a prompt that needs exactly the free blocks."""

    def can_allocate(self, seq: Sequence) -> bool:
        return cdiv(seq.num_tokens, self.block_size) < self.num_free_blocks


class AppendSlotOneTokenEarly(BlockManager):
    """Takes the next block when the last one becomes full, one token before any token needs it."""

    def can_append_slot(self, seq: Sequence) -> bool:
        return cdiv(seq.num_tokens + 1, self.block_size) - len(seq.block_table) <= self.num_free_blocks

    def append_slot(self, seq: Sequence) -> None:
        if cdiv(seq.num_tokens + 1, self.block_size) > len(seq.block_table):
            seq.block_table.extend(block.block_id for block in self.block_pool.get_new_blocks(1))


class AppendSlotOneTokenLate(BlockManager):
    """Adds a block one token after the token that starts it: that token's K/V have no slot to go to."""

    def can_append_slot(self, seq: Sequence) -> bool:
        return int(seq.num_tokens - 1 > len(seq.block_table) * self.block_size) <= self.num_free_blocks

    def append_slot(self, seq: Sequence) -> None:
        if seq.num_tokens - 1 > len(seq.block_table) * self.block_size:
            seq.block_table.extend(block.block_id for block in self.block_pool.get_new_blocks(1))


# --- slot_mapping -------------------------------------------------------------------------------------------------


def slot_mapping_off_by_one(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size + 1 for p in range(start, end)]


def slot_mapping_without_block_size(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] + p % block_size for p in range(start, end)]  # a block id is not a slot


def slot_mapping_without_check(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    # positions past the table wrap around to the first blocks instead of raising
    table = block_table * 2
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


# --- write_to_kv_cache, gather_kv, paged_attention ----------------------------------------------------------------


def write_to_kv_cache_into_a_copy(
    k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_kv_heads, head_dim = key_cache.shape[2:]
    # indexing with a tensor makes a copy, so copy_ writes into that copy and the caches never change
    key_cache.view(-1, num_kv_heads, head_dim)[slot_mapping].copy_(k)
    value_cache.view(-1, num_kv_heads, head_dim)[slot_mapping].copy_(v)


def write_to_kv_cache_by_position(
    k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_kv_heads, head_dim = key_cache.shape[2:]
    rows = torch.arange(k.shape[0])  # (T,) the step's tokens packed from slot 0, as in a contiguous cache
    key_cache.view(-1, num_kv_heads, head_dim)[rows] = k
    value_cache.view(-1, num_kv_heads, head_dim)[rows] = v


def gather_kv_ignores_seq_len(cache: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    return cache[torch.tensor(block_table, dtype=torch.long)].flatten(0, 1)  # the padding of the last block too


def gather_kv_sorted_blocks(cache: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    return cache[torch.tensor(sorted(block_table), dtype=torch.long)].flatten(0, 1)[:seq_len]


def paged_attention_over_new_tokens_only(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Forgets the context already in the cache: each sequence attends to this step's tokens only."""
    out = torch.empty_like(q)
    starts = metadata.query_start_loc.tolist()
    for b, block_table in enumerate(metadata.block_tables):
        seq_len, num_new = int(metadata.seq_lens[b]), starts[b + 1] - starts[b]
        keys = gather_kv(key_cache, block_table, seq_len)[seq_len - num_new :]
        values = gather_kv(value_cache, block_table, seq_len)[seq_len - num_new :]
        out[starts[b] : starts[b + 1]] = causal_attention(q[starts[b] : starts[b + 1]], keys, values, scale)
    return out


def paged_attention_one_sequence_context(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Uses the first sequence's block table for the whole batch."""
    out = torch.empty_like(q)
    starts = metadata.query_start_loc.tolist()
    for b in range(len(metadata.block_tables)):
        seq_len = min(int(metadata.seq_lens[b]), len(metadata.block_tables[0]) * key_cache.shape[1])
        keys = gather_kv(key_cache, metadata.block_tables[0], seq_len)
        values = gather_kv(value_cache, metadata.block_tables[0], seq_len)
        out[starts[b] : starts[b + 1]] = causal_attention(q[starts[b] : starts[b + 1]], keys, values, scale)
    return out


# --- generate_paged -----------------------------------------------------------------------------------------------


def generate_paged_skips_append_slot(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16
) -> list[list[int]]:
    """Allocates at prefill only: the first decode token past the prompt's last block has no slot."""
    num_blocks = sum(cdiv(len(p) + max_new_tokens, block_size) for p in prompts)
    block_manager = BlockManager(num_blocks, block_size)
    runner = ModelRunner(model, num_blocks, block_size)
    seqs = [Sequence(i, prompt) for i, prompt in enumerate(prompts)]
    for seq in seqs:
        block_manager.allocate(seq)
    for _ in range(max_new_tokens):
        logits = runner.execute_model(SchedulerOutput(seqs, [s.num_tokens - s.num_computed_tokens for s in seqs]))
        for seq, token_id in zip(seqs, torch.argmax(logits, dim=-1).tolist(), strict=True):
            seq.append_token(token_id)
    return [seq.output_token_ids for seq in seqs]


def generate_paged_appends_to_the_prompt(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16
) -> list[list[int]]:
    """Right tokens, but grows the caller's prompt lists in place while doing it."""
    outputs = generate_paged(model, prompts, max_new_tokens, block_size)
    for prompt, output in zip(prompts, outputs, strict=True):
        prompt.extend(output)
    return outputs


def generate_paged_one_sequence_at_a_time(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16
) -> list[list[int]]:
    """Shares one cache between sequences run one after another, but sizes it for one sequence only."""
    num_blocks = max(cdiv(len(p) + max_new_tokens, block_size) for p in prompts)
    block_manager = BlockManager(num_blocks, block_size)
    runner = ModelRunner(model, num_blocks, block_size)
    outputs = []
    for i, prompt in enumerate(prompts):
        seq = Sequence(i, prompt)
        block_manager.allocate(seq)
        for _ in range(max_new_tokens):
            step = SchedulerOutput([seq], [seq.num_tokens - seq.num_computed_tokens])
            seq.append_token(int(runner.execute_model(step)[0].argmax()))
            block_manager.append_slot(seq)
        outputs.append(seq.output_token_ids)  # the blocks are never freed: the next sequence finds none
    return outputs


MUTANTS = {
    "queue_remove_forgets_back_link": {"FreeKVCacheBlockQueue": RemoveForgetsBackLink},
    "queue_remove_keeps_its_links": {"FreeKVCacheBlockQueue": RemoveKeepsItsLinks},
    "queue_popleft_takes_the_tail": {"FreeKVCacheBlockQueue": PopleftTakesTheTail},
    "free_forgets_the_last_block": {"BlockManager": FreeForgetsTheLastBlock},
    "free_in_table_order": {"BlockManager": FreeInTableOrder},
    "allocate_rounds_down": {"BlockManager": AllocateRoundsDown},
    "can_allocate_strict": {"BlockManager": CanAllocateStrict},
    "append_slot_one_token_early": {"BlockManager": AppendSlotOneTokenEarly},
    "append_slot_one_token_late": {"BlockManager": AppendSlotOneTokenLate},
    "slot_mapping_off_by_one": {"slot_mapping": slot_mapping_off_by_one},
    "slot_mapping_without_block_size": {"slot_mapping": slot_mapping_without_block_size},
    "slot_mapping_without_check": {"slot_mapping": slot_mapping_without_check},
    "write_to_kv_cache_into_a_copy": {"write_to_kv_cache": write_to_kv_cache_into_a_copy},
    "write_to_kv_cache_by_position": {"write_to_kv_cache": write_to_kv_cache_by_position},
    "gather_kv_ignores_seq_len": {"gather_kv": gather_kv_ignores_seq_len},
    "gather_kv_sorted_blocks": {"gather_kv": gather_kv_sorted_blocks},
    "paged_attention_over_new_tokens_only": {"paged_attention": paged_attention_over_new_tokens_only},
    "paged_attention_one_sequence_context": {"paged_attention": paged_attention_one_sequence_context},
    "generate_paged_skips_append_slot": {"generate_paged": generate_paged_skips_append_slot},
    "generate_paged_appends_to_the_prompt": {"generate_paged": generate_paged_appends_to_the_prompt},
    "generate_paged_one_sequence_at_a_time": {"generate_paged": generate_paged_one_sequence_at_a_time},
}

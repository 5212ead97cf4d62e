"""Plausible wrong answers to chapter 03's exercises. Each must fail at least one test of its exercise.

Class exercises are mutated by subclassing the reference and overriding the one method that goes wrong.
"""

import torch
import torch.nn.functional as F

from solutions.attention.causal import causal_attention
from solutions.attention.paged import AttentionMetadata, KVCache, PagedAttention, gather_kv
from solutions.baselines.paged_generation import generate_paged
from solutions.core.block_manager import BlockManager
from solutions.core.block_pool import FreeKVCacheBlockQueue, KVCacheBlock
from solutions.core.sched.output import SchedulerOutput
from solutions.core.sequence import Sequence
from solutions.model.llama import LlamaForCausalLM
from solutions.utils.math_utils import cdiv
from solutions.worker.model_runner import prepare_inputs

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


class AppendAtTheHead(FreeKVCacheBlockQueue):
    """Links a freed block in right after `head`: the most recently freed block is handed out first."""

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"block {block.block_id} is already in the free block queue")
        first = self.head.next_free_block
        self.head.next_free_block = block
        block.prev_free_block = self.head
        block.next_free_block = first
        first.prev_free_block = block
        self.num_free_blocks += 1


class AppendForgetsTheCount(FreeKVCacheBlockQueue):
    """Links the block in but never counts it: `num_free_blocks` only ever goes down."""

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"block {block.block_id} is already in the free block queue")
        last = self.tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.tail
        self.tail.prev_free_block = block


class AppendTakesABlockTwice(FreeKVCacheBlockQueue):
    """No check that the block is already queued: a double free relinks it and corrupts the list silently."""

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.tail
        self.tail.prev_free_block = block
        self.num_free_blocks += 1


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


class AllocateOneBlockTooManyAtABoundary(BlockManager):
    """`num_tokens // block_size + 1` blocks: right unless the prompt fills its last block exactly."""

    def can_allocate(self, seq: Sequence) -> bool:
        return seq.num_tokens // self.block_size + 1 <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        num_new_blocks = seq.num_tokens // self.block_size + 1
        if num_new_blocks > self.num_free_blocks:
            raise ValueError(f"{num_new_blocks} blocks needed, {self.num_free_blocks} free")
        seq.block_table.extend(block.block_id for block in self.block_pool.get_new_blocks(num_new_blocks))


class CanAppendSlotNeedsAFreeBlockEveryTime(BlockManager):
    """Asks for a free block at every decode step, not only when the newest token starts a block."""

    def can_append_slot(self, seq: Sequence) -> bool:
        return self.num_free_blocks >= 1


class FreeKeepsTheBlockTable(BlockManager):
    """Returns the blocks but leaves the ids in `seq.block_table`: the sequence still points at freed blocks."""

    def free(self, seq: Sequence) -> None:
        blocks = self.block_pool.blocks
        self.block_pool.free_blocks(blocks[block_id] for block_id in reversed(seq.block_table))


# --- slot_mapping -------------------------------------------------------------------------------------------------


def slot_mapping_off_by_one(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size + 1 for p in range(start, end)]


def slot_mapping_without_block_size(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] + p % block_size for p in range(start, end)]  # a block id is not a slot


def slot_mapping_without_check(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    # positions past the table wrap around to the first blocks instead of raising
    table = block_table * 2
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def slot_mapping_from_zero(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    # counts positions from the start of the range, not of the sequence: right for a prefill only
    if not 0 <= start <= end <= len(block_table) * block_size:
        raise ValueError(f"positions [{start}, {end}) are outside the block table")
    return [block_table[i // block_size] * block_size + i % block_size for i in range(end - start)]


def slot_mapping_rejects_a_full_table(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    # `<` for `<=`: a sequence whose last block is exactly full is refused
    if not 0 <= start <= end < len(block_table) * block_size:
        raise ValueError(f"positions [{start}, {end}) are outside the block table")
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


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


def write_to_kv_cache_value_gets_the_keys(
    k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k
    value_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k  # copied from the line above, k left in place


def write_to_kv_cache_block_size_from_the_wrong_dim(
    k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    block_size = key_cache.shape[0]  # the number of blocks: the layout is (num_blocks, block_size, Hkv, D)
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size  # (T,), (T,)
    key_cache[blocks, offsets] = k
    value_cache[blocks, offsets] = v


def gather_kv_ignores_seq_len(cache: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    return cache[torch.tensor(block_table, dtype=torch.long)].flatten(0, 1)  # the padding of the last block too


def gather_kv_sorted_blocks(cache: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    return cache[torch.tensor(sorted(block_table), dtype=torch.long)].flatten(0, 1)[:seq_len]


def gather_kv_drops_the_partial_last_block(cache: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    block_size = cache.shape[1]
    blocks = block_table[: seq_len // block_size]  # floor, not ceiling: a partly filled last block is left out
    return cache[torch.tensor(blocks, dtype=torch.long)].flatten(0, 1)[:seq_len]


def gather_kv_as_if_contiguous(cache: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    first = block_table[0] * cache.shape[1]  # reads seq_len consecutive slots from the first block on
    return cache.flatten(0, 1)[first : first + seq_len]


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


def paged_attention_top_left_causal_mask(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """PyTorch's `is_causal=True` with fewer queries than keys aligns the mask to the top left: query i sees keys
    0..i, as if the new tokens were the first of the context rather than the last."""
    out = torch.empty_like(q)
    starts = metadata.query_start_loc.tolist()
    for b, block_table in enumerate(metadata.block_tables):
        rows, seq_len = slice(starts[b], starts[b + 1]), int(metadata.seq_lens[b])
        keys = gather_kv(key_cache, block_table, seq_len)  # (seq_len, Hkv, D)
        values = gather_kv(value_cache, block_table, seq_len)
        attended = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), is_causal=True, scale=scale,
            enable_gqa=True,
        )  # (Hq, Tq, D)
        out[rows] = attended.transpose(0, 1)
    return out


def paged_attention_tiles_the_kv_heads(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Shares the KV heads with `repeat` (0, 1, 0, 1) where GQA groups neighbouring query heads (0, 0, 1, 1)."""
    out = torch.empty_like(q)
    starts = metadata.query_start_loc.tolist()
    for b, block_table in enumerate(metadata.block_tables):
        rows, seq_len = slice(starts[b], starts[b + 1]), int(metadata.seq_lens[b])
        keys = gather_kv(key_cache, block_table, seq_len)  # (seq_len, Hkv, D)
        values = gather_kv(value_cache, block_table, seq_len)
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat(1, group, 1), values.repeat(1, group, 1)  # (seq_len, Hq, D), tiled
        out[rows] = causal_attention(q[rows], keys, values, scale)
    return out


def paged_attention_default_scale(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Ignores the `scale` argument and uses 1/sqrt(D): right for this model, wrong for any caller that passes
    another scale (a softmax temperature, a model with a `query_pre_attn_scalar`)."""
    out = torch.empty_like(q)
    starts = metadata.query_start_loc.tolist()
    for b, block_table in enumerate(metadata.block_tables):
        rows, seq_len = slice(starts[b], starts[b + 1]), int(metadata.seq_lens[b])
        keys = gather_kv(key_cache, block_table, seq_len)
        values = gather_kv(value_cache, block_table, seq_len)
        out[rows] = causal_attention(q[rows], keys, values, q.shape[-1] ** -0.5)
    return out


# --- generate_paged -----------------------------------------------------------------------------------------------


def _forward_step(model: LlamaForCausalLM, kv_cache: KVCache, seqs: list[Sequence], block_size: int) -> torch.Tensor:
    """The reference's step, right: every uncomputed token of each sequence -> logits (B, V) at its last one."""
    num_new = [seq.num_tokens - seq.num_computed_tokens for seq in seqs]
    input_ids, positions, metadata = prepare_inputs(SchedulerOutput(seqs, num_new), block_size)
    hidden = model(input_ids, positions, PagedAttention(kv_cache, metadata))  # (T, D_model)
    for seq, n in zip(seqs, num_new, strict=True):
        seq.num_computed_tokens += n
    return model.compute_logits(hidden[metadata.query_start_loc[1:] - 1])  # (B, V)


def generate_paged_skips_append_slot(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16
) -> list[list[int]]:
    """Allocates at prefill only: the first decode token past the prompt's last block has no slot."""
    num_blocks = sum(cdiv(len(p) + max_new_tokens, block_size) for p in prompts)
    block_manager = BlockManager(num_blocks, block_size)
    kv_cache = KVCache.allocate(model.config, num_blocks, block_size)
    seqs = [Sequence(i, prompt) for i, prompt in enumerate(prompts)]
    for seq in seqs:
        block_manager.allocate(seq)
    for _ in range(max_new_tokens):
        logits = _forward_step(model, kv_cache, seqs, block_size)
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
    kv_cache = KVCache.allocate(model.config, num_blocks, block_size)
    outputs = []
    for i, prompt in enumerate(prompts):
        seq = Sequence(i, prompt)
        block_manager.allocate(seq)
        for _ in range(max_new_tokens):
            seq.append_token(int(_forward_step(model, kv_cache, [seq], block_size)[0].argmax()))
            block_manager.append_slot(seq)
        outputs.append(seq.output_token_ids)  # the blocks are never freed: the next sequence finds none
    return outputs


def generate_paged_logits_of_the_first_new_token(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16
) -> list[list[int]]:
    """Samples from each sequence's *first* new row (`query_start_loc[:-1]`): the same row for a decode, but for
    the prefill the prediction after the prompt's first token, not its last."""
    num_blocks = sum(cdiv(len(p) + max_new_tokens, block_size) for p in prompts)
    block_manager = BlockManager(num_blocks, block_size)
    kv_cache = KVCache.allocate(model.config, num_blocks, block_size)
    seqs = [Sequence(i, prompt) for i, prompt in enumerate(prompts)]
    for seq in seqs:
        block_manager.allocate(seq)
    for _ in range(max_new_tokens):
        num_new = [seq.num_tokens - seq.num_computed_tokens for seq in seqs]
        input_ids, positions, metadata = prepare_inputs(SchedulerOutput(seqs, num_new), block_size)
        hidden = model(input_ids, positions, PagedAttention(kv_cache, metadata))  # (T, D_model)
        logits = model.compute_logits(hidden[metadata.query_start_loc[:-1]])  # (B, V)
        for seq, n, token_id in zip(seqs, num_new, torch.argmax(logits, dim=-1).tolist(), strict=True):
            seq.num_computed_tokens += n
            seq.append_token(token_id)
            block_manager.append_slot(seq)
    for seq in seqs:
        block_manager.free(seq)
    return [seq.output_token_ids for seq in seqs]


def generate_paged_pool_for_the_prompts_only(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16
) -> list[list[int]]:
    """Sizes the pool for the prompts, forgetting the tokens still to come: decode runs out of blocks."""
    num_blocks = sum(cdiv(len(p), block_size) for p in prompts)
    block_manager = BlockManager(num_blocks, block_size)
    kv_cache = KVCache.allocate(model.config, num_blocks, block_size)
    seqs = [Sequence(i, prompt) for i, prompt in enumerate(prompts)]
    for seq in seqs:
        block_manager.allocate(seq)
    for _ in range(max_new_tokens):
        logits = _forward_step(model, kv_cache, seqs, block_size)
        for seq, token_id in zip(seqs, torch.argmax(logits, dim=-1).tolist(), strict=True):
            seq.append_token(token_id)
            block_manager.append_slot(seq)
    for seq in seqs:
        block_manager.free(seq)
    return [seq.output_token_ids for seq in seqs]


MUTANTS = {
    "queue_remove_forgets_back_link": {"FreeKVCacheBlockQueue": RemoveForgetsBackLink},
    "queue_remove_keeps_its_links": {"FreeKVCacheBlockQueue": RemoveKeepsItsLinks},
    "queue_popleft_takes_the_tail": {"FreeKVCacheBlockQueue": PopleftTakesTheTail},
    "queue_append_at_the_head": {"FreeKVCacheBlockQueue": AppendAtTheHead},
    "queue_append_forgets_the_count": {"FreeKVCacheBlockQueue": AppendForgetsTheCount},
    "queue_append_takes_a_block_twice": {"FreeKVCacheBlockQueue": AppendTakesABlockTwice},
    "free_forgets_the_last_block": {"BlockManager": FreeForgetsTheLastBlock},
    "free_in_table_order": {"BlockManager": FreeInTableOrder},
    "free_keeps_the_block_table": {"BlockManager": FreeKeepsTheBlockTable},
    "allocate_rounds_down": {"BlockManager": AllocateRoundsDown},
    "allocate_one_block_too_many_at_a_boundary": {"BlockManager": AllocateOneBlockTooManyAtABoundary},
    "can_allocate_strict": {"BlockManager": CanAllocateStrict},
    "can_append_slot_needs_a_free_block_every_time": {"BlockManager": CanAppendSlotNeedsAFreeBlockEveryTime},
    "append_slot_one_token_early": {"BlockManager": AppendSlotOneTokenEarly},
    "append_slot_one_token_late": {"BlockManager": AppendSlotOneTokenLate},
    "slot_mapping_off_by_one": {"slot_mapping": slot_mapping_off_by_one},
    "slot_mapping_without_block_size": {"slot_mapping": slot_mapping_without_block_size},
    "slot_mapping_without_check": {"slot_mapping": slot_mapping_without_check},
    "slot_mapping_from_zero": {"slot_mapping": slot_mapping_from_zero},
    "slot_mapping_rejects_a_full_table": {"slot_mapping": slot_mapping_rejects_a_full_table},
    "write_to_kv_cache_into_a_copy": {"write_to_kv_cache": write_to_kv_cache_into_a_copy},
    "write_to_kv_cache_by_position": {"write_to_kv_cache": write_to_kv_cache_by_position},
    "write_to_kv_cache_value_gets_the_keys": {"write_to_kv_cache": write_to_kv_cache_value_gets_the_keys},
    "write_to_kv_cache_block_size_from_the_wrong_dim": {
        "write_to_kv_cache": write_to_kv_cache_block_size_from_the_wrong_dim
    },
    "gather_kv_ignores_seq_len": {"gather_kv": gather_kv_ignores_seq_len},
    "gather_kv_sorted_blocks": {"gather_kv": gather_kv_sorted_blocks},
    "gather_kv_drops_the_partial_last_block": {"gather_kv": gather_kv_drops_the_partial_last_block},
    "gather_kv_as_if_contiguous": {"gather_kv": gather_kv_as_if_contiguous},
    "paged_attention_over_new_tokens_only": {"paged_attention": paged_attention_over_new_tokens_only},
    "paged_attention_one_sequence_context": {"paged_attention": paged_attention_one_sequence_context},
    "paged_attention_top_left_causal_mask": {"paged_attention": paged_attention_top_left_causal_mask},
    "paged_attention_tiles_the_kv_heads": {"paged_attention": paged_attention_tiles_the_kv_heads},
    "paged_attention_default_scale": {"paged_attention": paged_attention_default_scale},
    "generate_paged_skips_append_slot": {"generate_paged": generate_paged_skips_append_slot},
    "generate_paged_appends_to_the_prompt": {"generate_paged": generate_paged_appends_to_the_prompt},
    "generate_paged_one_sequence_at_a_time": {"generate_paged": generate_paged_one_sequence_at_a_time},
    "generate_paged_logits_of_the_first_new_token": {"generate_paged": generate_paged_logits_of_the_first_new_token},
    "generate_paged_pool_for_the_prompts_only": {"generate_paged": generate_paged_pool_for_the_prompts_only},
}

# For each exercise, a mutant that breaks the capstone (SmolLM2 through every piece at once), which proves the
# capstone's generation runs through that exercise. The last five change the tokens. The first two cannot: the
# pool never hands out a block twice and the slot mapping refuses a position outside the block table, so they
# fail there, mid-generation, as a real engine would.
CAPSTONE_MUTANTS = {
    "FreeKVCacheBlockQueue": "queue_remove_forgets_back_link",
    "BlockManager": "append_slot_one_token_late",
    "slot_mapping": "slot_mapping_from_zero",
    "write_to_kv_cache": "write_to_kv_cache_into_a_copy",
    "gather_kv": "gather_kv_ignores_seq_len",
    "paged_attention": "paged_attention_over_new_tokens_only",
    "generate_paged": "generate_paged_logits_of_the_first_new_token",
}

# The statements each exercise's question is about, as `ast.unparse` writes them (a compound statement by its
# header). Hint 2 may show none of them, and nothing under chapters/ may state them (tests/test_hints.py): they
# live here, beside the wrong answers, because a learner reads the chapter's test file.
DECISIVE = {
    "FreeKVCacheBlockQueue": [
        'next_.prev_free_block = prev',
        'block.prev_free_block = block.next_free_block = None',
        'self.tail.prev_free_block = block',
    ],
    "BlockManager": [
        'num_missing = cdiv(seq.num_tokens, self.block_size) - len(seq.block_table)',
        'self.block_pool.free_blocks((blocks[block_id] for block_id in reversed(seq.block_table)))',
    ],
    "slot_mapping": [
        'return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]',
    ],
    "write_to_kv_cache": [
        'key_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k',
    ],
    "gather_kv": [
        'blocks = cache[torch.tensor(block_table, dtype=torch.long)]',
        'return blocks.flatten(0, 1)[:seq_len]',
    ],
    "paged_attention": [
        'rows = slice(starts[b], starts[b + 1])',
        'keys = gather_kv(key_cache, block_table, seq_len)',
    ],
    "generate_paged": [
        'logits = model.compute_logits(hidden[metadata.query_start_loc[1:] - 1])',
        'seq.num_computed_tokens += n',
        'block_manager.append_slot(seq)',
    ],
}

"""Plausible wrong answers to chapter 04's exercises. Each must fail at least one test of its exercise.

Class exercises are mutated by subclassing the reference and overriding the one method that goes wrong.
"""

import hashlib
from array import array
from collections.abc import Iterable, Iterator, Sequence as Seq

import torch

from solutions.attention.paged import KVCache
from solutions.beam_search import Beam, beam_search_step
from solutions.core.block_hash import extend_block_hashes
from solutions.core.block_pool import BlockPool, KVCacheBlock
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sequence import Sequence

# --- BlockPool ----------------------------------------------------------------------------------------------------


class TouchLeavesTheBlockQueued(BlockPool):
    """Counts the new holder but leaves a revived block in the free queue: it is handed out (evicted) while held."""

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        blocks = [self.free_block_queue.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        return blocks


class ReuseKeepsTheHash(BlockPool):
    """Hands out a cached block without forgetting its hash: a later hit finds other tokens there."""

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        blocks = [self.free_block_queue.popleft() for _ in range(num_blocks)]
        for block in blocks:
            block.ref_cnt = 1
        return blocks


class FreeIgnoresOtherHolders(BlockPool):
    """Returns a block to the free queue on any free, though another sequence still holds it."""

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            block.ref_cnt = max(block.ref_cnt - 1, 0)
            if block.prev_free_block is None:
                self.free_block_queue.append(block)


class EvictMostRecentlyFreed(BlockPool):
    """Freed blocks go to the head: the most recently freed (most likely reused) prefix is evicted first."""

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue = self.free_block_queue
                first = queue.head.next_free_block
                queue.head.next_free_block, block.prev_free_block = block, queue.head
                block.next_free_block, first.prev_free_block = first, block
                queue.num_free_blocks += 1


# --- hash_block_tokens --------------------------------------------------------------------------------------------


def hash_ignores_the_parent(parent_block_hash: bytes | None, token_ids: Seq[int]) -> bytes:
    return hashlib.sha256(array("q", token_ids).tobytes()).digest()


def hash_of_the_token_sum(parent_block_hash: bytes | None, token_ids: Seq[int]) -> bytes:
    """Order-blind: a sum cannot tell [1, 2] from [2, 1]."""
    return hashlib.sha256((parent_block_hash or b"") + str(sum(token_ids)).encode()).digest()


# --- KVCacheManager -----------------------------------------------------------------------------------------------


class ForkWithoutRefCounts(KVCacheManager):
    """Copies the block table but not the ownership: the parent's free returns blocks the child still reads."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_table.extend(parent.block_table)


class CopyOnWriteNeverCopies(KVCacheManager):
    """Writes the newest token into the shared block, overwriting the other sequence's token at that slot."""

    def append_slot(self, seq: Sequence) -> list[tuple[int, int]]:
        if (seq.num_tokens - 1) // self.block_size == len(seq.block_table):
            seq.block_table.extend(block.block_id for block in self.block_pool.get_new_blocks(1))
        return []


class CopyOnWriteCopiesTheWrongBlock(KVCacheManager):
    """Replaces the right block but reports the sequence's first block as the source of the copy."""

    def copy_on_write(self, seq: Sequence, logical_block: int) -> tuple[int, int]:
        src, dst = super().copy_on_write(seq, logical_block)
        return seq.block_table[0], dst


class CopyOnWriteKeepsBothReferences(KVCacheManager):
    """Takes the copy but never drops the reference to the shared block: it leaks when the others free it."""

    def copy_on_write(self, seq: Sequence, logical_block: int) -> tuple[int, int]:
        src = seq.block_table[logical_block]
        (dst,) = self.block_pool.get_new_blocks(1)
        seq.block_table[logical_block] = dst.block_id
        self.num_blocks_copied += 1
        return src, dst.block_id


class LookupCountsTheLastToken(KVCacheManager):
    """Lets a prompt of whole blocks be all cached: nothing is left to compute the next token's logits from."""

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVCacheBlock], int]:
        if not self.enable_prefix_caching:
            return [], 0
        extend_block_hashes(seq.block_hashes, seq.token_ids, seq.num_tokens, self.block_size)
        hits = []
        for block_hash in seq.block_hashes[: seq.num_tokens // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_stats.queries += seq.num_tokens
        self.prefix_cache_stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size


# --- copy_blocks --------------------------------------------------------------------------------------------------


def copy_blocks_keys_only(kv_cache: KVCache, blocks_to_copy: list[tuple[int, int]]) -> None:
    for src, dst in blocks_to_copy:
        for cache in kv_cache.key_caches:
            cache[dst] = cache[src]


def copy_blocks_first_layer_only(kv_cache: KVCache, blocks_to_copy: list[tuple[int, int]]) -> None:
    for src, dst in blocks_to_copy:
        kv_cache.key_caches[0][dst] = kv_cache.key_caches[0][src]
        kv_cache.value_caches[0][dst] = kv_cache.value_caches[0][src]


def copy_blocks_into_a_copy(kv_cache: KVCache, blocks_to_copy: list[tuple[int, int]]) -> None:
    for src, dst in blocks_to_copy:
        for cache in kv_cache.key_caches + kv_cache.value_caches:
            cache[[dst]].copy_(cache[[src]])  # advanced indexing makes a copy: the cache never changes


# --- beam_search_step ---------------------------------------------------------------------------------------------


def beam_step_ranks_by_token_logprob(
    manager: KVCacheManager, beams: list[Beam], logprobs: torch.Tensor, beam_width: int, eos_token_id: int | None,
    seq_ids: Iterator[int],
) -> tuple[list[Beam], list[Beam]]:
    """Keeps the candidates whose *last token* is likeliest, forgetting each beam's history."""
    flat_beams = [Beam(b.seq, 0.0, b.logprobs) for b in beams]
    live, finished = beam_search_step(manager, flat_beams, logprobs, beam_width, eos_token_id, seq_ids)
    for beam in live + finished:
        parent = next(b for b in beams if b.seq.token_ids == beam.seq.token_ids[:-1])
        beam.cum_logprob += parent.cum_logprob
    return live, finished


def beam_step_best_token_per_beam(
    manager: KVCacheManager, beams: list[Beam], logprobs: torch.Tensor, beam_width: int, eos_token_id: int | None,
    seq_ids: Iterator[int],
) -> tuple[list[Beam], list[Beam]]:
    """Each beam keeps its own best continuation: never two survivors from one beam (a greedy search per beam)."""
    live = []
    for beam, row in zip(beams, logprobs, strict=True):
        token = int(row.argmax())
        child = beam.seq.fork(next(seq_ids))
        manager.fork(beam.seq, child)
        child.append_token(token)
        live.append(Beam(child, beam.cum_logprob + float(row[token]), beam.logprobs + [float(row[token])]))
    for beam in beams:
        manager.free(beam.seq)
    live.sort(key=lambda b: -b.cum_logprob)
    return live[:beam_width], []


def beam_step_never_frees_parents(
    manager: KVCacheManager, beams: list[Beam], logprobs: torch.Tensor, beam_width: int, eos_token_id: int | None,
    seq_ids: Iterator[int],
) -> tuple[list[Beam], list[Beam]]:
    """Right beams, but the dropped ones (and every parent's reference) leak."""
    free = manager.free
    manager.free = lambda seq: None
    try:
        return beam_search_step(manager, beams, logprobs, beam_width, eos_token_id, seq_ids)
    finally:
        manager.free = free


MUTANTS = {
    "touch_leaves_the_block_queued": {"BlockPool": TouchLeavesTheBlockQueued},
    "reuse_keeps_the_hash": {"BlockPool": ReuseKeepsTheHash},
    "free_ignores_other_holders": {"BlockPool": FreeIgnoresOtherHolders},
    "evict_most_recently_freed": {"BlockPool": EvictMostRecentlyFreed},
    "hash_ignores_the_parent": {"hash_block_tokens": hash_ignores_the_parent},
    "hash_of_the_token_sum": {"hash_block_tokens": hash_of_the_token_sum},
    "fork_without_ref_counts": {"KVCacheManager": ForkWithoutRefCounts},
    "copy_on_write_never_copies": {"KVCacheManager": CopyOnWriteNeverCopies},
    "copy_on_write_copies_the_wrong_block": {"KVCacheManager": CopyOnWriteCopiesTheWrongBlock},
    "copy_on_write_keeps_both_references": {"KVCacheManager": CopyOnWriteKeepsBothReferences},
    "lookup_counts_the_last_token": {"KVCacheManager": LookupCountsTheLastToken},
    "copy_blocks_keys_only": {"copy_blocks": copy_blocks_keys_only},
    "copy_blocks_first_layer_only": {"copy_blocks": copy_blocks_first_layer_only},
    "copy_blocks_into_a_copy": {"copy_blocks": copy_blocks_into_a_copy},
    "beam_step_ranks_by_token_logprob": {"beam_search_step": beam_step_ranks_by_token_logprob},
    "beam_step_best_token_per_beam": {"beam_search_step": beam_step_best_token_per_beam},
    "beam_step_never_frees_parents": {"beam_search_step": beam_step_never_frees_parents},
}

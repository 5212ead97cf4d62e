"""Plausible wrong answers to chapter 04's exercises. Each must fail at least one test of its exercise.

Class exercises are mutated by subclassing the reference and overriding the one method that goes wrong.
`CAPSTONE_MUTANTS` names, per exercise, one mutant that must also make the capstone fail: proof that the engine,
in the capstone, really runs on that piece of the learner's.
"""

import hashlib
from array import array
from collections.abc import Iterable, Iterator, Sequence as Seq

import torch

from solutions.attention.paged import KVCache
from solutions.beam_search import Beam, beam_search_step
from solutions.core.block_hash import NONE_HASH, extend_block_hashes, hash_block_tokens
from solutions.core.block_pool import BlockPool, KVCacheBlock
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sequence import Sequence
from solutions.utils.math_utils import cdiv

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


class FreeSkipsTheDoubleFreeCheck(BlockPool):
    """Trusts the caller: a double free drives a ref_cnt below zero (or queues a block another sequence holds)."""

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)


class FreeChecksAsItGoes(BlockPool):
    """Catches the double free, but only on reaching it: the blocks before it were already freed."""

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed but its ref_cnt is {block.ref_cnt} (double free?)")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)


class GetNewBlocksWithoutTheCountCheck(BlockPool):
    """Pops until the queue runs dry: the caller gets the queue's RuntimeError, and the blocks popped are lost."""

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks


# --- hash_block_tokens --------------------------------------------------------------------------------------------


def hash_ignores_the_parent(parent_block_hash: bytes | None, token_ids: Seq[int]) -> bytes:
    return hashlib.sha256(array("q", token_ids).tobytes()).digest()


def hash_of_the_token_sum(parent_block_hash: bytes | None, token_ids: Seq[int]) -> bytes:
    """Order-blind: a sum cannot tell [1, 2] from [2, 1]."""
    return hashlib.sha256((parent_block_hash or b"") + str(sum(token_ids)).encode()).digest()


def hash_with_python_hash(parent_block_hash: bytes | None, token_ids: Seq[int]) -> bytes:
    """Python's `hash`: 64 bits, and the hash of bytes (the parent) is salted per process — another process
    (a restarted server, a second worker) finds other hashes for the same prefix."""
    return hash((parent_block_hash, tuple(token_ids))).to_bytes(8, "little", signed=True)


def hash_of_the_joined_digits(parent_block_hash: bytes | None, token_ids: Seq[int]) -> bytes:
    """Token ids written side by side as text: [1, 23] and [12, 3] are both "123"."""
    return hashlib.sha256((parent_block_hash or NONE_HASH) + "".join(map(str, token_ids)).encode()).digest()


def hash_of_one_byte_per_token(parent_block_hash: bytes | None, token_ids: Seq[int]) -> bytes:
    """`bytes(token_ids)`: one byte per id, so every id of 256 or more (most of a real vocabulary) raises."""
    return hashlib.sha256((parent_block_hash or NONE_HASH) + bytes(token_ids)).digest()


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


class ForkIntoAChildThatHoldsBlocks(KVCacheManager):
    """Skips the check that the child is empty: a child that holds blocks ends up with both tables, and leaks."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for block_id in parent.block_table:
            self.block_pool.blocks[block_id].ref_cnt += 1
        child.block_table.extend(parent.block_table)


class CopiesNeverCounted(KVCacheManager):
    """Makes the copy but never adds it to `num_blocks_copied`: the cost of copy-on-write is invisible."""

    def copy_on_write(self, seq: Sequence, logical_block: int) -> tuple[int, int]:
        src = self.block_pool.blocks[seq.block_table[logical_block]]
        (dst,) = self.block_pool.get_new_blocks(1)
        seq.block_table[logical_block] = dst.block_id
        self.block_pool.free_blocks([src])
        return src.block_id, dst.block_id


class CopyOnWriteOfAFullBlock(KVCacheManager):
    """Looks at the last block the table *has*, not the block the newest token goes into: at a block boundary it
    copies a full shared block that nobody will write again (and still needs the new block)."""

    def append_slot(self, seq: Sequence) -> list[tuple[int, int]]:
        copies = []
        if self.block_pool.blocks[seq.block_table[-1]].ref_cnt > 1:
            copies.append(self.copy_on_write(seq, len(seq.block_table) - 1))
        if (seq.num_tokens - 1) // self.block_size == len(seq.block_table):
            seq.block_table.extend(block.block_id for block in self.block_pool.get_new_blocks(1))
        return copies


class LookupNeverCountsRequests(KVCacheManager):
    """Counts the tokens of each lookup but not the lookup itself: `prefix_cache_stats.num_requests` stays 0."""

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVCacheBlock], int]:
        hits, num_tokens = super().get_computed_blocks(seq)
        if self.enable_prefix_caching:
            self.prefix_cache_stats.num_requests -= 1
        return hits, num_tokens


class LookupContinuesAfterAMiss(KVCacheManager):
    """Skips a missing block and keeps looking: a later block still cached is returned after a gap."""

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVCacheBlock], int]:
        if not self.enable_prefix_caching:
            return [], 0
        extend_block_hashes(seq.block_hashes, seq.token_ids, seq.num_tokens, self.block_size)
        hits = []
        for block_hash in seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is not None:
                hits.append(block)
        self.prefix_cache_stats.num_requests += 1
        self.prefix_cache_stats.queries += seq.num_tokens
        self.prefix_cache_stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size


class LookupHashesThePartialBlock(KVCacheManager):
    """Hashes every block of the prompt, the partial last one too, into `seq.block_hashes`: when decoding fills
    that block, it is registered under the hash of its first tokens only, and no later prompt finds it."""

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVCacheBlock], int]:
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        for i in range(len(seq.block_hashes), cdiv(seq.num_tokens, bs)):
            parent = seq.block_hashes[i - 1] if i > 0 else None
            seq.block_hashes.append(hash_block_tokens(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        hits = []
        for block_hash in seq.block_hashes[: (seq.num_tokens - 1) // bs]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_stats.num_requests += 1
        self.prefix_cache_stats.queries += seq.num_tokens
        self.prefix_cache_stats.hits += len(hits) * bs
        return hits, len(hits) * bs


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


def copy_blocks_backwards(kv_cache: KVCache, blocks_to_copy: list[tuple[int, int]]) -> None:
    """Reads the pair as (dst, src): the fresh block's garbage overwrites the shared block everyone reads."""
    for src, dst in blocks_to_copy:
        for cache in kv_cache.key_caches + kv_cache.value_caches:
            cache[src] = cache[dst]


def copy_blocks_first_pair_only(kv_cache: KVCache, blocks_to_copy: list[tuple[int, int]]) -> None:
    """Handles one copy per step, as if at most one sequence could write into a shared block at a time."""
    if blocks_to_copy:
        src, dst = blocks_to_copy[0]
        for cache in kv_cache.key_caches + kv_cache.value_caches:
            cache[dst] = cache[src]


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


def beam_step_extends_eos_beams(
    manager: KVCacheManager, beams: list[Beam], logprobs: torch.Tensor, beam_width: int, eos_token_id: int | None,
    seq_ids: Iterator[int],
) -> tuple[list[Beam], list[Beam]]:
    """Treats EOS as any other token: a beam that ended stays live and is extended past its end."""
    return beam_search_step(manager, beams, logprobs, beam_width, None, seq_ids)


def beam_step_finishes_every_eos(
    manager: KVCacheManager, beams: list[Beam], logprobs: torch.Tensor, beam_width: int, eos_token_id: int | None,
    seq_ids: Iterator[int],
) -> tuple[list[Beam], list[Beam]]:
    """Sets aside every EOS candidate it meets, also those ranked below the first `beam_width` (HF skips them)."""
    vocab_size = logprobs.shape[1]
    cum = torch.tensor([beam.cum_logprob for beam in beams], dtype=torch.float32)
    top_scores, top_ids = (cum[:, None] + logprobs.float()).flatten().topk(min(2 * beam_width, logprobs.numel()))
    live, finished = [], []
    for score, flat_id in zip(top_scores.tolist(), top_ids.tolist(), strict=True):
        parent, token_id = divmod(flat_id, vocab_size)
        child = beams[parent].seq.fork(next(seq_ids))
        if token_id != eos_token_id:
            manager.fork(beams[parent].seq, child)
        child.append_token(token_id)
        beam = Beam(child, score, beams[parent].logprobs + [float(logprobs[parent, token_id])])
        (finished if token_id == eos_token_id else live).append(beam)
        if len(live) == beam_width:
            break
    for beam in beams:
        manager.free(beam.seq)
    return live, finished


def beam_step_frees_parents_first(
    manager: KVCacheManager, beams: list[Beam], logprobs: torch.Tensor, beam_width: int, eos_token_id: int | None,
    seq_ids: Iterator[int],
) -> tuple[list[Beam], list[Beam]]:
    """Frees the parents before forking the survivors: their blocks went back to the free queue (to be
    overwritten), and the children fork empty block tables."""
    vocab_size = logprobs.shape[1]
    cum = torch.tensor([beam.cum_logprob for beam in beams], dtype=torch.float32)
    top_scores, top_ids = (cum[:, None] + logprobs.float()).flatten().topk(min(2 * beam_width, logprobs.numel()))
    for beam in beams:
        manager.free(beam.seq)
    live, finished = [], []
    for rank, (score, flat_id) in enumerate(zip(top_scores.tolist(), top_ids.tolist(), strict=True)):
        parent, token_id = divmod(flat_id, vocab_size)
        is_eos = token_id == eos_token_id
        if is_eos and rank >= beam_width:
            continue
        child = beams[parent].seq.fork(next(seq_ids))
        if not is_eos:
            manager.fork(beams[parent].seq, child)
        child.append_token(token_id)
        beam = Beam(child, score, beams[parent].logprobs + [float(logprobs[parent, token_id])])
        (finished if is_eos else live).append(beam)
        if len(live) == beam_width:
            break
    return live, finished


def beam_step_keeps_every_tie(
    manager: KVCacheManager, beams: list[Beam], logprobs: torch.Tensor, beam_width: int, eos_token_id: int | None,
    seq_ids: Iterator[int],
) -> tuple[list[Beam], list[Beam]]:
    """Keeps every candidate scoring at least the `beam_width`-th best score: ties at the cut give extra beams."""
    vocab_size = logprobs.shape[1]
    scores = (torch.tensor([b.cum_logprob for b in beams], dtype=torch.float32)[:, None] + logprobs.float()).flatten()
    threshold = sorted(scores.tolist())[-beam_width]
    order = sorted(range(scores.numel()), key=lambda i: -float(scores[i]))
    live = []
    for flat_id in order:
        if float(scores[flat_id]) < threshold:
            break
        parent, token_id = divmod(flat_id, vocab_size)
        child = beams[parent].seq.fork(next(seq_ids))
        manager.fork(beams[parent].seq, child)
        child.append_token(token_id)
        live.append(Beam(child, float(scores[flat_id]), beams[parent].logprobs + [float(logprobs[parent, token_id])]))
    for beam in beams:
        manager.free(beam.seq)
    return live, []


MUTANTS = {
    "touch_leaves_the_block_queued": {"BlockPool": TouchLeavesTheBlockQueued},
    "reuse_keeps_the_hash": {"BlockPool": ReuseKeepsTheHash},
    "free_ignores_other_holders": {"BlockPool": FreeIgnoresOtherHolders},
    "evict_most_recently_freed": {"BlockPool": EvictMostRecentlyFreed},
    "free_skips_the_double_free_check": {"BlockPool": FreeSkipsTheDoubleFreeCheck},
    "free_checks_as_it_goes": {"BlockPool": FreeChecksAsItGoes},
    "get_new_blocks_without_the_count_check": {"BlockPool": GetNewBlocksWithoutTheCountCheck},
    "hash_ignores_the_parent": {"hash_block_tokens": hash_ignores_the_parent},
    "hash_of_the_token_sum": {"hash_block_tokens": hash_of_the_token_sum},
    "hash_with_python_hash": {"hash_block_tokens": hash_with_python_hash},
    "hash_of_the_joined_digits": {"hash_block_tokens": hash_of_the_joined_digits},
    "hash_of_one_byte_per_token": {"hash_block_tokens": hash_of_one_byte_per_token},
    "fork_without_ref_counts": {"KVCacheManager": ForkWithoutRefCounts},
    "copy_on_write_never_copies": {"KVCacheManager": CopyOnWriteNeverCopies},
    "copy_on_write_copies_the_wrong_block": {"KVCacheManager": CopyOnWriteCopiesTheWrongBlock},
    "copy_on_write_keeps_both_references": {"KVCacheManager": CopyOnWriteKeepsBothReferences},
    "lookup_counts_the_last_token": {"KVCacheManager": LookupCountsTheLastToken},
    "fork_into_a_child_that_holds_blocks": {"KVCacheManager": ForkIntoAChildThatHoldsBlocks},
    "copies_never_counted": {"KVCacheManager": CopiesNeverCounted},
    "copy_on_write_of_a_full_block": {"KVCacheManager": CopyOnWriteOfAFullBlock},
    "lookup_never_counts_requests": {"KVCacheManager": LookupNeverCountsRequests},
    "lookup_continues_after_a_miss": {"KVCacheManager": LookupContinuesAfterAMiss},
    "lookup_hashes_the_partial_block": {"KVCacheManager": LookupHashesThePartialBlock},
    "copy_blocks_keys_only": {"copy_blocks": copy_blocks_keys_only},
    "copy_blocks_first_layer_only": {"copy_blocks": copy_blocks_first_layer_only},
    "copy_blocks_into_a_copy": {"copy_blocks": copy_blocks_into_a_copy},
    "copy_blocks_backwards": {"copy_blocks": copy_blocks_backwards},
    "copy_blocks_first_pair_only": {"copy_blocks": copy_blocks_first_pair_only},
    "beam_step_ranks_by_token_logprob": {"beam_search_step": beam_step_ranks_by_token_logprob},
    "beam_step_best_token_per_beam": {"beam_search_step": beam_step_best_token_per_beam},
    "beam_step_never_frees_parents": {"beam_search_step": beam_step_never_frees_parents},
    "beam_step_extends_eos_beams": {"beam_search_step": beam_step_extends_eos_beams},
    "beam_step_finishes_every_eos": {"beam_search_step": beam_step_finishes_every_eos},
    "beam_step_frees_parents_first": {"beam_search_step": beam_step_frees_parents_first},
    "beam_step_keeps_every_tie": {"beam_search_step": beam_step_keeps_every_tie},
}

CAPSTONE_MUTANTS = {
    "BlockPool": "touch_leaves_the_block_queued",  # a revived system-prompt block is handed out while held
    "hash_block_tokens": "hash_of_the_token_sum",  # Q1's swapped tokens hit prompt 0's block
    "KVCacheManager": "fork_without_ref_counts",  # beams and samples free blocks their siblings still read
    "copy_blocks": "copy_blocks_keys_only",  # the copied partial block has no values: other beams, other tokens
    "beam_search_step": "beam_step_best_token_per_beam",  # not Hugging Face's beams
}

# The statements each exercise's question is about, as `ast.unparse` writes them (a compound statement by its
# header). Hint 2 may show none of them, and nothing under chapters/ may state them (tests/test_hints.py): they
# live here, beside the wrong answers, because a learner reads the chapter's test file.
DECISIVE = {
    "BlockPool": [
        'if block.ref_cnt == 0:',
        'self.free_block_queue.append(block)',
        'self.free_block_queue.remove(block)',
    ],
    "hash_block_tokens": [
        'parent = NONE_HASH if parent_block_hash is None else parent_block_hash',
        "return hashlib.sha256(parent + array('q', token_ids).tobytes()).digest()",
    ],
    "KVCacheManager": [
        'if src.ref_cnt < 2:',
        'max_blocks = (seq.num_tokens - 1) // self.block_size',
        'num_revived = sum((block.ref_cnt == 0 for block in new_computed_blocks))',
    ],
    "copy_blocks": [
        'for cache in kv_cache.key_caches + kv_cache.value_caches:',
        'cache[dst] = cache[src]',
    ],
    "beam_search_step": [
        'scores = (cum[:, None] + logprobs.float()).flatten()',
        'top_scores, top_ids = scores.topk(min(2 * beam_width, scores.numel()))',
        'if is_eos and rank >= beam_width:',
    ],
}

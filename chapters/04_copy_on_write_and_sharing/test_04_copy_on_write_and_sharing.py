"""Grading tests for chapter 04 — sharing blocks: reference counts, copy-on-write, prefix caching, beam search.

Each test grades one exercise (`@pytest.mark.exercise`). The oracles are independent of the code under test: a
count of the block tables holding each block for `ref_cnt`, a plain list for the free queue, the token ids
themselves for what a prefix hit may return, element-wise tensor copies for `copy_blocks`, and a brute-force
sort of every (beam, token) candidate for the beam-search step.

The capstone runs every exercise together inside the engine on SmolLM2 and compares with Hugging Face's stored
greedy tokens and beams.
"""

import hashlib
import itertools
from array import array

import pytest
import torch

from grading import exercising, expect_equal, expect_raises
from grading.differential import differential_test, scheduler_workloads
from grading.capstone import CAPSTONE_PROMPTS, HF_BEAM_TOKENS, HF_BEAM_WIDTH, smollm2, smollm2_beams, smollm2_greedy, swap_in
from solutions import LLM, BeamSearchParams, SamplingParams
from solutions import beam_search
from solutions.attention import paged
from solutions.attention.paged import KVCache
from solutions.core import block_hash, block_pool, kv_cache_manager
from solutions.core.block_hash import NONE_HASH
from solutions.core.block_pool import KVCacheBlock
from solutions.core.sequence import Sequence

REFERENCE = {
    "BlockPool": block_pool.BlockPool,
    "hash_block_tokens": block_hash.hash_block_tokens,
    "KVCacheManager": kv_cache_manager.KVCacheManager,
    "copy_blocks": paged.copy_blocks,
    "beam_search_step": beam_search.beam_search_step,
}

pytestmark = pytest.mark.timeout(60)



def queue_ids(pool) -> list[int]:
    ids, block = [], pool.free_block_queue.head.next_free_block
    while block is not pool.free_block_queue.tail and block is not None and len(ids) < 100:
        ids.append(block.block_id)
        block = block.next_free_block
    return ids


# --- BlockPool ----------------------------------------------------------------------------------------------------


@pytest.mark.exercise("BlockPool")
def test_free_blocks_returns_a_block_only_when_its_last_holder_frees_it(impl):
    inputs = "BlockPool(4), get_new_blocks(2), touch(block 0) (a second holder), free_blocks([1, 0]) then ([0])"
    with exercising("BlockPool", inputs):
        pool = impl.BlockPool(4)
        a, b = pool.get_new_blocks(2)
        pool.touch([a])
        pool.free_blocks([b, a])
        expect_equal((queue_ids(pool), a.ref_cnt, b.ref_cnt), ([2, 3, 1], 1, 0), inputs=f"{inputs}; after the first free: queue, ref_cnts")
        pool.free_blocks([a])
    expect_equal((queue_ids(pool), a.ref_cnt), ([2, 3, 1, 0], 0), inputs=f"{inputs}; after the second free")


@pytest.mark.exercise("BlockPool")
def test_touch_revives_a_free_cached_block_from_the_middle_of_the_queue(impl):
    inputs = "BlockPool(5), all 5 taken, block 2 cached as b'h', all freed in order 0..4, then touch(get_cached_block(b'h'))"
    with exercising("BlockPool", inputs):
        pool = impl.BlockPool(5)
        blocks = pool.get_new_blocks(5)
        pool.cache_full_block(blocks[2], b"h")
        pool.free_blocks(blocks)
        hit = pool.get_cached_block(b"h")
        pool.touch([hit])
        expect_equal((hit.block_id, hit.ref_cnt), (2, 1), inputs=f"{inputs}; the hit block and its ref_cnt")
        expect_equal((queue_ids(pool), pool.num_free_blocks), ([0, 1, 3, 4], 4), inputs=f"{inputs}; the free queue")
        taken = [blk.block_id for blk in pool.get_new_blocks(4)]
    expect_equal(taken, [0, 1, 3, 4], inputs=f"{inputs}, then get_new_blocks(4): a touched block is never handed out")


@pytest.mark.exercise("BlockPool")
def test_get_new_blocks_evicts_the_hash_of_a_reused_block(impl):
    inputs = "BlockPool(2), both cached (b'x' on 0, b'y' on 1), freed [1, 0], then get_new_blocks(1)"
    with exercising("BlockPool", inputs):
        pool = impl.BlockPool(2)
        a, b = pool.get_new_blocks(2)
        pool.cache_full_block(a, b"x")
        pool.cache_full_block(b, b"y")
        pool.free_blocks([b, a])
        (reused,) = pool.get_new_blocks(1)
        found = (pool.get_cached_block(b"x") is not None, pool.get_cached_block(b"y") is not None)
    expect_equal(reused.block_id, 1, inputs=f"{inputs}; the block handed out (the least recently freed)")
    expect_equal((reused.block_hash, reused.ref_cnt), (None, 1), inputs=f"{inputs}; its hash and ref_cnt")
    expect_equal(found, (True, False), inputs=f"{inputs}; (b'x' still cached, b'y' still cached)")


@pytest.mark.exercise("BlockPool")
def test_eviction_follows_the_order_blocks_were_freed(impl):
    inputs = "BlockPool(3), blocks 0, 1, 2 cached as b'0', b'1', b'2', freed as [2], [0], [1], then get_new_blocks(2)"
    with exercising("BlockPool", inputs):
        pool = impl.BlockPool(3)
        blocks = pool.get_new_blocks(3)
        for blk in blocks:
            pool.cache_full_block(blk, str(blk.block_id).encode())
        for i in (2, 0, 1):
            pool.free_blocks([blocks[i]])
        pool.get_new_blocks(2)
        still = [pool.get_cached_block(str(i).encode()) is not None for i in range(3)]
    expect_equal(still, [False, True, False], inputs=f"{inputs}; which hashes are still cached")


@pytest.mark.exercise("BlockPool")
def test_free_blocks_catches_a_double_free_before_changing_anything(impl):
    inputs = "BlockPool(4), get_new_blocks(2) (blocks 0, 1), free_blocks([0]), then free_blocks([1, 0]) and ([1, 1])"
    with exercising("BlockPool", inputs):
        pool = impl.BlockPool(4)
        a, b = pool.get_new_blocks(2)
        pool.free_blocks([a])
        expect_raises(RuntimeError, lambda: pool.free_blocks([b, a]), inputs=f"{inputs}; free_blocks([1, 0]): block 0 is free already")
        expect_equal((queue_ids(pool), b.ref_cnt, a.ref_cnt), ([2, 3, 0], 1, 0),
                     inputs=f"{inputs}; after the refused free_blocks([1, 0]): queue, ref_cnt of 1 and 0 (nothing changed)")
        expect_raises(RuntimeError, lambda: pool.free_blocks([b, b]), inputs=f"{inputs}; free_blocks([1, 1]): block 1 has one holder")
    expect_equal((queue_ids(pool), b.ref_cnt), ([2, 3, 0], 1), inputs=f"{inputs}; after the refused free_blocks([1, 1])")


@pytest.mark.exercise("BlockPool")
def test_get_new_blocks_beyond_the_free_count_raises_and_changes_nothing(impl):
    inputs = "BlockPool(3), get_new_blocks(2), then get_new_blocks(2) with one block free"
    with exercising("BlockPool", inputs):
        pool = impl.BlockPool(3)
        pool.get_new_blocks(2)
        expect_raises(ValueError, lambda: pool.get_new_blocks(2), inputs=f"{inputs}: asking for more than are free")
        expect_equal((pool.num_free_blocks, queue_ids(pool), pool.blocks[2].ref_cnt), (1, [2], 0),
                     inputs=f"{inputs}; afterwards: free blocks, the queue, ref_cnt of block 2")


# --- hash_block_tokens --------------------------------------------------------------------------------------------


@pytest.mark.exercise("hash_block_tokens")
def test_hash_is_deterministic_bytes(impl):
    first = impl.hash_block_tokens(None, [1, 2, 3, 4])
    expect_equal(isinstance(first, bytes), True, inputs="hash_block_tokens(None, [1, 2, 3, 4]) is bytes")
    expect_equal(impl.hash_block_tokens(None, [1, 2, 3, 4]), first, inputs="the same call twice")


@pytest.mark.exercise("hash_block_tokens")
def test_hash_is_sha256_of_the_parent_and_the_int64_token_ids(impl):
    """The documented bytes, so that every process and every machine finds the same hash for the same prefix."""
    first = hashlib.sha256(NONE_HASH + array("q", [1, 2, 3, 4]).tobytes()).digest()
    second = hashlib.sha256(first + array("q", [49151, 300, 0, 7]).tobytes()).digest()
    inputs = "hash_block_tokens(None, [1, 2, 3, 4]), then its child block [49151, 300, 0, 7] (ids from a real vocabulary)"
    with exercising("hash_block_tokens", inputs):
        got = (impl.hash_block_tokens(None, [1, 2, 3, 4]), impl.hash_block_tokens(first, [49151, 300, 0, 7]))
    expect_equal(got, (first, second), inputs=f"{inputs}: SHA-256 of (the parent's hash, NONE_HASH for the first "
                 "block) followed by each token id as 8 bytes, array('q')")


@pytest.mark.exercise("hash_block_tokens")
def test_hash_depends_on_the_tokens_and_their_order(impl):
    base = impl.hash_block_tokens(None, [1, 2, 3, 4])
    others = [impl.hash_block_tokens(None, t) for t in ([1, 2, 3, 5], [2, 1, 3, 4], [1, 2, 3, 4, 0], [12, 34])]
    expect_equal(len({base, *others}), 5, inputs="[1,2,3,4] against [1,2,3,5], [2,1,3,4], [1,2,3,4,0], [12,34]: distinct hashes")


@pytest.mark.exercise("hash_block_tokens")
def test_hash_depends_on_the_parent(impl):
    root = impl.hash_block_tokens(None, [1, 2])
    other_root = impl.hash_block_tokens(None, [3, 4])
    child = impl.hash_block_tokens(root, [5, 6])
    expect_equal(child == impl.hash_block_tokens(other_root, [5, 6]), False,
                 inputs="block [5, 6] after [1, 2] vs after [3, 4] (equal hashes must mean equal prefixes)")
    expect_equal(child == impl.hash_block_tokens(None, [5, 6]), False, inputs="block [5, 6] after [1, 2] vs first")
    expect_equal(child, impl.hash_block_tokens(root, [5, 6]), inputs="the same chain twice")


# --- KVCacheManager -----------------------------------------------------------------------------------------------


def admitted(manager, seq_id: int, num_tokens: int) -> Sequence:
    """A sequence whose prompt is allocated (through the given allocate_slots) and computed."""
    seq = Sequence(seq_id, list(range(100, 100 + num_tokens)))
    manager.allocate_slots(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    return seq


def holders(manager, seqs: list[Sequence]) -> list[int]:
    counts = [0] * manager.num_blocks
    for seq in seqs:
        for block_id in seq.block_table:
            counts[block_id] += 1
    return counts


@pytest.mark.exercise("KVCacheManager")
def test_fork_shares_the_parents_blocks_and_counts_references(impl):
    inputs = "KVCacheManager(8, 4), a 6-token parent, fork a child"
    with exercising("KVCacheManager", inputs):
        manager = impl.KVCacheManager(8, 4)
        parent = admitted(manager, 0, 6)
        child = parent.fork(1)
        manager.fork(parent, child)
    expect_equal(child.block_table, parent.block_table, inputs=f"{inputs}; the child's block table")
    expect_equal([b.ref_cnt for b in manager.block_pool.blocks], holders(manager, [parent, child]),
                 inputs=f"{inputs}; every block's ref_cnt (must equal the number of block tables holding it)")
    expect_equal(manager.num_free_blocks, 6, inputs=f"{inputs}; num_free_blocks")


@pytest.mark.exercise("KVCacheManager")
def test_fork_into_a_child_that_holds_blocks_raises(impl):
    inputs = "KVCacheManager(8, 4), a 6-token parent, a 3-token sequence holding its own block, fork(parent, it)"
    with exercising("KVCacheManager", inputs):
        manager = impl.KVCacheManager(8, 4)
        parent = admitted(manager, 0, 6)
        other = admitted(manager, 1, 3)
        table = list(other.block_table)
        expect_raises(ValueError, lambda: manager.fork(parent, other), inputs=inputs)
    expect_equal(other.block_table, table, inputs=f"{inputs}; its block table afterwards (unchanged)")
    expect_equal([b.ref_cnt for b in manager.block_pool.blocks], holders(manager, [parent, other]), inputs=f"{inputs}; ref_cnts")


@pytest.mark.exercise("KVCacheManager")
def test_forked_blocks_are_freed_when_the_last_holder_frees(impl):
    inputs = "KVCacheManager(8, 4), a 6-token parent, two forks, free the parent, then both children"
    with exercising("KVCacheManager", inputs):
        manager = impl.KVCacheManager(8, 4)
        parent = admitted(manager, 0, 6)
        children = [parent.fork(1), parent.fork(2)]
        for child in children:
            manager.fork(parent, child)
        manager.free(parent)
        expect_equal(manager.num_free_blocks, 6, inputs=f"{inputs}; free blocks after freeing the parent")
        for child in children:
            manager.free(child)
    expect_equal((manager.num_free_blocks, [b.ref_cnt for b in manager.block_pool.blocks]), (8, [0] * 8),
                 inputs=f"{inputs}; free blocks and ref_cnts at the end")


@pytest.mark.exercise("KVCacheManager")
def test_copy_on_write_gives_a_private_copy_of_the_shared_block(impl):
    inputs = "KVCacheManager(8, 4), a 6-token parent, fork, copy_on_write(parent, 1)"
    with exercising("KVCacheManager", inputs):
        manager = impl.KVCacheManager(8, 4)
        parent = admitted(manager, 0, 6)
        child = parent.fork(1)
        manager.fork(parent, child)
        shared = parent.block_table[1]
        copy = manager.copy_on_write(parent, 1)
    expect_equal(copy, (shared, parent.block_table[1]), inputs=f"{inputs}; the (src, dst) returned")
    expect_equal(parent.block_table[1] not in (shared, parent.block_table[0]), True, inputs=f"{inputs}; dst is a fresh block")
    expect_equal(child.block_table[1], shared, inputs=f"{inputs}; the child keeps the shared block")
    expect_equal([b.ref_cnt for b in manager.block_pool.blocks], holders(manager, [parent, child]), inputs=f"{inputs}; ref_cnts")
    expect_equal(manager.num_blocks_copied, 1, inputs=f"{inputs}; num_blocks_copied")


@pytest.mark.exercise("KVCacheManager")
@pytest.mark.parametrize("first", ["parent", "child"])
def test_append_slot_copies_a_shared_partial_block_once(impl, first):
    inputs = f"KVCacheManager(8, 4), a 6-token parent, fork, append one token to the {first} then the other"
    with exercising("KVCacheManager", inputs):
        manager = impl.KVCacheManager(8, 4)
        parent = admitted(manager, 0, 6)
        child = parent.fork(1)
        manager.fork(parent, child)
        shared = parent.block_table[1]
        writer, other = (parent, child) if first == "parent" else (child, parent)
        writer.append_token(7)
        copies = manager.append_slot(writer)
        expect_equal(copies, [(shared, writer.block_table[1])], inputs=f"{inputs}; copies for the first writer")
        expect_equal(other.block_table[1], shared, inputs=f"{inputs}; the other sequence keeps block {shared}")
        other.append_token(8)
        expect_equal(manager.append_slot(other), [], inputs=f"{inputs}; copies for the second writer (sole holder now)")
    expect_equal(writer.block_table[1] != other.block_table[1], True, inputs=f"{inputs}; the two last blocks differ")
    expect_equal([b.ref_cnt for b in manager.block_pool.blocks], holders(manager, [parent, child]), inputs=f"{inputs}; ref_cnts")


@pytest.mark.exercise("KVCacheManager")
def test_append_slot_at_a_block_boundary_takes_a_new_block_and_copies_nothing(impl):
    inputs = "KVCacheManager(8, 4), an 8-token parent (two full blocks), fork, one token each"
    with exercising("KVCacheManager", inputs):
        manager = impl.KVCacheManager(8, 4)
        parent = admitted(manager, 0, 8)
        child = parent.fork(1)
        manager.fork(parent, child)
        parent.append_token(1)
        child.append_token(2)
        copies = manager.append_slot(parent) + manager.append_slot(child)
    expect_equal(copies, [], inputs=f"{inputs}; copies (a full block is never written again)")
    expect_equal((len(parent.block_table), len(child.block_table), parent.block_table[:2] == child.block_table[:2]),
                 (3, 3, True), inputs=f"{inputs}; blocks of each, first two shared")
    expect_equal(parent.block_table[2] != child.block_table[2], True, inputs=f"{inputs}; third blocks are their own")


@pytest.mark.exercise("KVCacheManager")
def test_append_slot_on_a_private_block_writes_in_place(impl):
    inputs = "KVCacheManager(8, 4), a 5-token sequence, decode to 8 tokens"
    with exercising("KVCacheManager", inputs):
        manager = impl.KVCacheManager(8, 4)
        seq = admitted(manager, 0, 5)
        got = []
        for token in (1, 2, 3):
            seq.append_token(token)
            got.append(manager.append_slot(seq))
    expect_equal((got, len(seq.block_table)), ([[], [], []], 2), inputs=f"{inputs}; copies per token, blocks at the end")


def cached_manager(impl, prompt_len: int, block_size: int = 4):
    manager = impl.KVCacheManager(16, block_size)
    donor = admitted(manager, 0, prompt_len)  # the given allocate_slots registers its full blocks
    return manager, donor


@pytest.mark.exercise("KVCacheManager")
@pytest.mark.parametrize("prompt_len, want_blocks", [(8, 1), (9, 2), (12, 2), (13, 3), (3, 0)])
def test_get_computed_blocks_never_counts_the_last_prompt_token(impl, prompt_len, want_blocks):
    inputs = f"KVCacheManager(16, 4) caching a 16-token prompt, then get_computed_blocks of its first {prompt_len} tokens"
    with exercising("KVCacheManager", inputs):
        manager, donor = cached_manager(impl, 16)
        hits, num_tokens = manager.get_computed_blocks(Sequence(1, donor.token_ids[:prompt_len]))
    expect_equal(([b.block_id for b in hits], num_tokens), (donor.block_table[:want_blocks], 4 * want_blocks),
                 inputs=f"{inputs}; (hit block ids, cached tokens)")


@pytest.mark.exercise("KVCacheManager")
def test_get_computed_blocks_stops_at_the_first_miss(impl):
    inputs = "KVCacheManager(16, 4) caching tokens 100..115, then a prompt equal to it but for token 5"
    with exercising("KVCacheManager", inputs):
        manager, donor = cached_manager(impl, 16)
        tokens = list(donor.token_ids)
        tokens[5] = 0
        hits, num_tokens = manager.get_computed_blocks(Sequence(1, tokens + [1]))
    expect_equal(([b.block_id for b in hits], num_tokens), (donor.block_table[:1], 4), inputs=f"{inputs}; (hit block ids, cached tokens)")


@pytest.mark.exercise("KVCacheManager")
def test_get_computed_blocks_finds_nothing_after_an_evicted_first_block(impl):
    inputs = ("KVCacheManager(5, 4): A = tokens 100..107 and B = tokens 100..111 computed side by side (B's first two "
              "blocks are copies, only its third is cached); A freed; C takes A's two blocks (evicted); "
              "then get_computed_blocks of B's 12 tokens + 1")
    with exercising("KVCacheManager", inputs):
        manager = impl.KVCacheManager(5, 4)
        a = admitted(manager, 0, 8)
        b = admitted(manager, 1, 12)
        manager.free(a)
        manager.allocate_slots(Sequence(2, [7] * 8), 8)  # the only free blocks are A's: both evicted
        hits, num_tokens = manager.get_computed_blocks(Sequence(3, list(b.token_ids) + [1]))
    expect_equal(([blk.block_id for blk in hits], num_tokens), ([], 0),
                 inputs=f"{inputs}; (hit block ids, cached tokens): a run of hits ends at the first miss, even if a "
                 "later block is still cached")


@pytest.mark.exercise("KVCacheManager")
def test_a_block_filled_by_decoding_is_found_by_a_later_prompt(impl):
    inputs = ("KVCacheManager(16, 4): a 10-token prompt looked up then allocated (as the engine does), decoded to 12 "
              "tokens; then get_computed_blocks of those 12 tokens + 1")
    with exercising("KVCacheManager", inputs):
        manager = impl.KVCacheManager(16, 4)
        seq = Sequence(0, list(range(100, 110)))
        hits, num_cached = manager.get_computed_blocks(seq)
        manager.allocate_slots(seq, seq.num_tokens - num_cached, hits)
        seq.num_computed_tokens = seq.num_tokens
        for token in (7, 8):
            seq.append_token(token)
            manager.allocate_slots(seq, 1)
            seq.num_computed_tokens += 1
        hits, num_tokens = manager.get_computed_blocks(Sequence(1, list(seq.token_ids) + [9]))
    expect_equal(([blk.block_id for blk in hits], num_tokens), (seq.block_table[:3], 12),
                 inputs=f"{inputs}; (hit block ids, cached tokens): the third block, full since decoding, must hit")


@pytest.mark.exercise("KVCacheManager")
def test_get_computed_blocks_counts_the_query_and_touches_nothing(impl):
    inputs = "KVCacheManager(16, 4) caching a 10-token prompt (freed), then get_computed_blocks of the same 10 tokens"
    with exercising("KVCacheManager", inputs):
        manager, donor = cached_manager(impl, 10)
        table = list(donor.block_table)
        manager.free(donor)
        hits, num_tokens = manager.get_computed_blocks(Sequence(1, list(donor.token_ids)))
    expect_equal([b.block_id for b in hits], table[:2], inputs=f"{inputs}; hit block ids (free blocks still hold a prefix)")
    stats = manager.prefix_cache_stats
    expect_equal((stats.num_requests, stats.queries, stats.hits), (1, 10, 8),
                 inputs=f"{inputs}; prefix_cache_stats (num_requests, queries, hits), queries and hits in tokens")
    expect_equal((manager.num_free_blocks, [b.ref_cnt for b in hits]), (16, [0, 0]), inputs=f"{inputs}; a lookup changes no block")


@pytest.mark.exercise("KVCacheManager")
def test_get_computed_blocks_with_caching_off_finds_nothing(impl):
    inputs = "KVCacheManager(16, 4, enable_prefix_caching=False), a 10-token prompt, the same again"
    with exercising("KVCacheManager", inputs):
        manager = impl.KVCacheManager(16, 4, enable_prefix_caching=False)
        donor = admitted(manager, 0, 10)
        got = manager.get_computed_blocks(Sequence(1, list(donor.token_ids)))
    expect_equal(got, ([], 0), inputs=inputs)


# --- copy_blocks --------------------------------------------------------------------------------------------------


def random_cache(num_layers: int = 2, seed: int = 0) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    shape = (6, 4, 2, 3)  # (num_blocks, block_size, Hkv, D)
    return KVCache([torch.randn(shape, generator=g) for _ in range(num_layers)], [torch.randn(shape, generator=g) for _ in range(num_layers)])


@pytest.mark.exercise("copy_blocks")
@pytest.mark.parametrize("pairs", [[(1, 4)], [(0, 5), (2, 3), (0, 1)]])
def test_copy_blocks_copies_every_layers_keys_and_values(impl, pairs):
    cache = random_cache(num_layers=3)
    want = [t.clone() for t in cache.key_caches + cache.value_caches]
    for t in want:
        for src, dst in pairs:
            t[dst] = t[src]
    impl.copy_blocks(cache, pairs)
    got = cache.key_caches + cache.value_caches
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        what = f"{'key' if i < 3 else 'value'} cache of layer {i % 3}"
        expect_equal(torch.equal(g, w), True, inputs=f"3 layers of (6, 4, 2, 3) caches, copies {pairs}; {what} equals the expected copy")


@pytest.mark.exercise("copy_blocks")
def test_copy_blocks_with_no_copies_changes_nothing(impl):
    cache = random_cache()
    before = [t.clone() for t in cache.key_caches + cache.value_caches]
    impl.copy_blocks(cache, [(3, 3)])  # a no-op pair: the stub must still be reached
    impl.copy_blocks(cache, [])
    expect_equal(all(torch.equal(a, b) for a, b in zip(before, cache.key_caches + cache.value_caches, strict=True)), True,
                 inputs="copy_blocks(cache, [(3, 3)]) then ([]): the caches are unchanged")


# --- beam_search_step ---------------------------------------------------------------------------------------------


def live_beams(manager, prompts: list[list[int]], cums: list[float]):
    beams = []
    for i, (tokens, cum) in enumerate(zip(prompts, cums, strict=True)):
        seq = Sequence(i, tokens)
        manager.allocate_slots(seq, len(tokens))
        seq.num_computed_tokens = len(tokens)
        beams.append(beam_search.Beam(seq, cum))
    return beams


def brute_force(cums: list[float], logprobs: torch.Tensor, width: int) -> list[tuple[int, int]]:
    """(parent, token) of the `width` best candidates by cumulative logprob, every candidate enumerated."""
    candidates = [(cums[b] + float(logprobs[b, t]), b, t) for b in range(logprobs.shape[0]) for t in range(logprobs.shape[1])]
    return [(b, t) for _, b, t in sorted(candidates, key=lambda c: -c[0])[:width]]


@pytest.mark.exercise("beam_search_step")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_step_keeps_the_best_candidates_by_cumulative_logprob(impl, seed):
    g = torch.Generator().manual_seed(seed)
    manager = kv_cache_manager.KVCacheManager(32, 4)
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 7]]
    cums = [-1.0, -1.5, -4.0]
    beams = live_beams(manager, prompts, cums)
    logprobs = torch.log_softmax(3 * torch.randn(3, 6, generator=g), dim=-1)  # (B=3, V=6)
    live, finished = impl.beam_search_step(manager, beams, logprobs, 3, None, itertools.count(10))
    got = [(prompts.index(b.seq.token_ids[:-1]), b.seq.token_ids[-1]) for b in live]
    inputs = f"3 beams with cumulative logprobs {cums}, random logprobs (seed {seed}), beam_width 3, no EOS"
    expect_equal(got, brute_force(cums, logprobs, 3), inputs=f"{inputs}; (parent, token) of the live beams, best first")
    want_cums = [round(cums[b] + float(logprobs[b, t]), 4) for b, t in got]
    expect_equal([round(b.cum_logprob, 4) for b in live], want_cums, inputs=f"{inputs}; their cum_logprob")
    expect_equal(finished, [], inputs=f"{inputs}; finished beams")


@pytest.mark.exercise("beam_search_step")
def test_beam_step_forks_survivors_and_frees_all_parents(impl):
    manager = kv_cache_manager.KVCacheManager(32, 4)
    beams = live_beams(manager, [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7]], [0.0, -30.0])
    logprobs = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.4, 0.3, 0.3]]))
    inputs = "2 beams (cumulative 0 and -30), beam_width 2: both survivors come from beam 0"
    live, _ = impl.beam_search_step(manager, beams, logprobs, 2, None, itertools.count(10))
    expect_equal([b.seq.block_table for b in beams], [[], []], inputs=f"{inputs}; the parents' block tables afterwards")
    expect_equal([b.seq.block_table for b in live], [[0, 1], [0, 1]], inputs=f"{inputs}; the survivors' block tables (beam 0's)")
    expect_equal([b.ref_cnt for b in manager.block_pool.blocks[:4]], [2, 2, 0, 0], inputs=f"{inputs}; ref_cnts of blocks 0..3")
    expect_equal([b.seq.token_ids for b in live], [[1, 2, 3, 4, 5, 6, 0], [1, 2, 3, 4, 5, 6, 1]], inputs=f"{inputs}; tokens")


@pytest.mark.exercise("beam_search_step")
def test_beam_step_sets_aside_eos_among_the_first_beam_width(impl):
    manager = kv_cache_manager.KVCacheManager(32, 4)
    beams = live_beams(manager, [[1, 2, 3]], [0.0])
    logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    inputs = "1 beam, next-token probabilities [0.5, 0.3, 0.15, 0.05], EOS = token 0, beam_width 2"
    live, finished = impl.beam_search_step(manager, beams, logprobs, 2, 0, itertools.count(10))
    expect_equal(([b.seq.token_ids[-1] for b in finished], [b.seq.token_ids[-1] for b in live]), ([0], [1, 2]),
                 inputs=f"{inputs}; (finished last tokens, live last tokens)")
    expect_equal(finished[0].seq.block_table, [], inputs=f"{inputs}; a finished beam holds no blocks")
    expect_equal(manager.num_used_blocks, 1, inputs=f"{inputs}; blocks in use (the live beams share one)")


@pytest.mark.exercise("beam_search_step")
def test_beam_step_skips_an_eos_below_the_first_beam_width(impl):
    manager = kv_cache_manager.KVCacheManager(32, 4)
    beams = live_beams(manager, [[1, 2, 3], [1, 2, 4]], [0.0, -1.0])
    logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.25, 0.15]]))
    inputs = ("2 beams (cumulative 0 and -1), probabilities [0.5, 0.3, 0.2] and [0.6, 0.25, 0.15], EOS = token 0, "
              "beam_width 2: ranked (0, EOS), (0, 1), (1, EOS), (0, 2) — the second EOS ranks third")
    live, finished = impl.beam_search_step(manager, beams, logprobs, 2, 0, itertools.count(10))
    expect_equal(([b.seq.token_ids for b in finished], [b.seq.token_ids for b in live]),
                 ([[1, 2, 3, 0]], [[1, 2, 3, 1], [1, 2, 3, 2]]), inputs=f"{inputs}; (finished beams' tokens, live beams' tokens)")
    expect_equal(manager.num_used_blocks, 1, inputs=f"{inputs}; blocks in use (the live beams share one)")


@pytest.mark.exercise("beam_search_step")
def test_beam_step_keeps_beam_width_beams_when_scores_tie(impl):
    manager = kv_cache_manager.KVCacheManager(32, 4)
    beams = live_beams(manager, [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], [0.0, 0.0])
    logprobs = torch.log(torch.tensor([[0.4, 0.4, 0.2], [0.4, 0.4, 0.2]]))
    inputs = "2 beams (cumulative 0 and 0), both with probabilities [0.4, 0.4, 0.2], beam_width 3: four candidates tie for best"
    live, finished = impl.beam_search_step(manager, beams, logprobs, 3, None, itertools.count(10))
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]]
    got = [(prompts.index(b.seq.token_ids[:-1]), b.seq.token_ids[-1]) for b in live]
    expect_equal((len(got), len(set(got)), set(got) <= {(0, 0), (0, 1), (1, 0), (1, 1)}), (3, 3, True),
                 inputs=f"{inputs}; (live beams, distinct (parent, token), all among the tied best)")
    expect_equal([round(b.cum_logprob, 4) for b in live], [round(float(logprobs[0, 0]), 4)] * 3, inputs=f"{inputs}; their cum_logprob")
    expect_equal(finished, [], inputs=f"{inputs}; finished beams")
    expect_equal([b.ref_cnt for b in manager.block_pool.blocks], holders(manager, [b.seq for b in live]),
                 inputs=f"{inputs}; every block's ref_cnt (the number of live beams holding it; parents freed)")


# --- the exercises the scheduler's step runs, against the reference on generated workloads ---------------------------

SCHEDULED = ("BlockPool", "hash_block_tokens", "KVCacheManager")


test_each_exercise_the_scheduler_runs_leaves_the_references_state_on_generated_workloads = differential_test(
    REFERENCE, SCHEDULED, lambda _: scheduler_workloads()
)


# --- capstone -----------------------------------------------------------------------------------------------------

# SmolLM2 at block_size 4: the chat prompts' common system prompt fills 6 full blocks, which every chat prompt
# shares. Three crafted prompts continue or change a chat prompt: Q1 swaps two tokens of block 7 of prompt 0 (a hash
# blind to token order finds prompt 0's block), Q2 is prompt 2's first 7 blocks followed by prompt 0's tail (a hash
# blind to the parent finds prompt 0's blocks after the wrong prefix), Q3 is the next chat turn after prompt 0's
# answer (it must find the block that prompt 0's decoding filled). Their oracle is the engine with prefix caching
# off, which never looks a hash up.
CAPSTONE_BLOCK_SIZE = 4
CAPSTONE_NEW_TOKENS = 4
BEAM_KV_BLOCKS = 20  # Hugging Face's beams of both prompts hold 19 blocks at their peak: a block freed early is reused
GREEDY_KV_BLOCKS = 32  # at most 22 are held at once: never-used blocks suffice, and LRU evicts none that is cached
Q1 = CAPSTONE_PROMPTS[0][:28] + CAPSTONE_PROMPTS[0][29:27:-1] + CAPSTONE_PROMPTS[0][30:]
Q2 = CAPSTONE_PROMPTS[2][:28] + CAPSTONE_PROMPTS[0][28:]
Q3 = CAPSTONE_PROMPTS[0] + smollm2_greedy(0, CAPSTONE_NEW_TOKENS) + [2, 198]  # + "<|im_end|>\n"


def capstone_llm(num_kv_blocks: int, enable_prefix_caching: bool = True) -> LLM:
    smollm2()  # the model is loaded once per process
    return LLM(model="smollm2-135m", block_size=CAPSTONE_BLOCK_SIZE, num_kv_blocks=num_kv_blocks, max_model_len=128,
               max_num_seqs=8, enable_prefix_caching=enable_prefix_caching)


def cached_tokens(prompt: list[int], computed: list[list[int]], block_size: int) -> int:
    """Tokens of `prompt`'s leading full blocks that some computed sequence holds too (never its last token)."""
    best = 0
    for tokens in computed:
        n = 0
        while n < min(len(prompt), len(tokens)) and prompt[n] == tokens[n]:
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1) // block_size * block_size


@pytest.mark.exercise("capstone")
def test_capstone_beam_search_on_smollm2_gives_hugging_faces_beams(impl):
    """Your beam_search_step forks and frees the beams through your KVCacheManager and BlockPool (prefix hashes
    by your hash_block_tokens), and your copy_blocks copies the shared partial blocks: the beams must be those
    of Hugging Face `generate(num_beams=...)`."""
    prompts = [CAPSTONE_PROMPTS[0], CAPSTONE_PROMPTS[1]]
    inputs = (f"SmolLM2-135M-Instruct, prompts of {[len(p) for p in prompts]} tokens, beam_width {HF_BEAM_WIDTH}, "
              f"{HF_BEAM_TOKENS} tokens, EOS ignored, block_size {CAPSTONE_BLOCK_SIZE}, {BEAM_KV_BLOCKS} KV blocks; "
              "every exercise of the chapter in place of the reference")
    with swap_in(impl, REFERENCE):
        llm = capstone_llm(BEAM_KV_BLOCKS)
        try:
            outputs = llm.beam_search(prompts, BeamSearchParams(HF_BEAM_WIDTH, HF_BEAM_TOKENS, ignore_eos=True))
        except ValueError as error:
            if "cannot hold" not in str(error):
                raise
            raise AssertionError(
                f"on input {inputs}: {error}. Hugging Face's beams never hold more than 19 blocks at once: yours "
                "share fewer blocks than they should (other beams, or blocks that are never freed)"
            ) from None
        manager = llm.llm_engine.engine_core.scheduler.kv_cache_manager
        used, copied = manager.num_used_blocks, manager.num_blocks_copied
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        expect_equal([seq.tokens[len(prompt):] for seq in output.sequences], smollm2_beams(i),
                     inputs=f"{inputs}; prompt {i}'s beams, best first (expected: Hugging Face's)")
    expect_equal((used, copied > 0), (0, True),
                 inputs=f"{inputs}; (blocks in use afterwards, some shared block copied on write)")


@pytest.mark.exercise("capstone")
def test_capstone_prefix_caching_and_parallel_sampling_give_hugging_faces_tokens(impl):
    """Greedy generation with prefix caching on: a first call caches prompts 0 and 2; a second call runs Q1, Q2 and
    Q3, which share a prefix with the first call's sequences, beside prompt 5 with n = 2 (forked after its prefill;
    its partial block, two of its six tokens, is copied on write); then Q1, Q2 and Q3 again with caching off. The tokens must be
    Hugging Face's (Q1, Q2, Q3: those of the engine with caching off), and the prefix cache must count one lookup
    per request and hit exactly the full blocks each prompt shares with an earlier computed sequence (LRU
    eviction hands out never-used blocks first, so no cached block is lost)."""
    n, p = CAPSTONE_NEW_TOKENS, CAPSTONE_PROMPTS
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    two = SamplingParams(n=2, temperature=0.0, max_tokens=n, ignore_eos=True)
    inputs = (f"SmolLM2-135M-Instruct, greedy, {n} tokens, block_size {CAPSTONE_BLOCK_SIZE}, {GREEDY_KV_BLOCKS} KV "
              "blocks; every exercise of the chapter in place of the reference")
    with swap_in(impl, REFERENCE):
        llm = capstone_llm(GREEDY_KV_BLOCKS)
        manager = llm.llm_engine.engine_core.scheduler.kv_cache_manager
        stats = manager.prefix_cache_stats
        first = llm.generate([p[0], p[2]], greedy, use_tqdm=False)
        hits_first = stats.hits
        second = llm.generate([Q1, Q2, Q3, p[5]], [greedy, greedy, greedy, two], use_tqdm=False)
        on = (manager.num_used_blocks, manager.num_blocks_copied, stats.num_requests, hits_first, stats.hits - hits_first)
        llm_off = capstone_llm(GREEDY_KV_BLOCKS, enable_prefix_caching=False)
        off = llm_off.generate([Q1, Q2, Q3], greedy, use_tqdm=False)
        used_off = llm_off.llm_engine.engine_core.scheduler.kv_cache_manager.num_used_blocks

    def tokens(output) -> list[list[int]]:
        return [completion.token_ids for completion in output.outputs]

    expect_equal([tokens(o) for o in first], [[smollm2_greedy(0, n)], [smollm2_greedy(2, n)]],
                 inputs=f"{inputs}; caching on, first call: prompts 0 and 2 (expected: Hugging Face's tokens)")
    expect_equal(tokens(second[3]), [smollm2_greedy(5, n)] * 2,
                 inputs=f"{inputs}; caching on, second call: prompt 5 with n = 2, both samples (expected: Hugging Face's)")
    expect_equal([tokens(o) for o in off], [tokens(o) for o in second[:3]],
                 inputs=f"{inputs}; Q1, Q2 and Q3 with caching off (expected: the tokens they got with caching on)")
    computed = [p[i] + smollm2_greedy(i, n)[:-1] for i in (0, 2)]  # the last token is sampled, never computed
    want = (6, cached_tokens(p[2], [p[0]], CAPSTONE_BLOCK_SIZE),
            sum(cached_tokens(q, computed, CAPSTONE_BLOCK_SIZE) for q in (Q1, Q2, Q3, p[5])))
    expect_equal(on[2:], want, inputs=f"{inputs}; prefix_cache_stats: lookups (one per request), tokens hit in the "
                 "first call (prompt 2 on prompt 0's blocks, admitted in the same step) and in the second (Q1, Q2, Q3, "
                 "prompt 5): the full blocks each shares with an earlier computed sequence")
    expect_equal((on[0], on[1] > 0, used_off), (0, True, 0),
                 inputs=f"{inputs}; (blocks in use afterwards, some shared block copied on write) with caching on, "
                 "then blocks in use afterwards with caching off")

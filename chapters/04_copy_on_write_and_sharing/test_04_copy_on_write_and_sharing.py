"""Grading tests for chapter 04 — sharing blocks: reference counts, copy-on-write, prefix caching, beam search.

Each test grades one exercise (`@pytest.mark.exercise`). The oracles are independent of the code under test: a
count of the block tables holding each block for `ref_cnt`, a plain list for the free queue, the token ids
themselves for what a prefix hit may return, element-wise tensor copies for `copy_blocks`, and a brute-force
sort of every (beam, token) candidate for the beam-search step.
"""

import itertools

import pytest
import torch

from grading import exercising, expect_equal
from solutions import beam_search
from solutions.attention import paged
from solutions.attention.paged import KVCache
from solutions.core import block_hash, block_pool, kv_cache_manager
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


# --- hash_block_tokens --------------------------------------------------------------------------------------------


@pytest.mark.exercise("hash_block_tokens")
def test_hash_is_deterministic_bytes(impl):
    first = impl.hash_block_tokens(None, [1, 2, 3, 4])
    expect_equal(isinstance(first, bytes), True, inputs="hash_block_tokens(None, [1, 2, 3, 4]) is bytes")
    expect_equal(impl.hash_block_tokens(None, [1, 2, 3, 4]), first, inputs="the same call twice")


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
def test_get_computed_blocks_counts_the_query_and_touches_nothing(impl):
    inputs = "KVCacheManager(16, 4) caching a 10-token prompt (freed), then get_computed_blocks of the same 10 tokens"
    with exercising("KVCacheManager", inputs):
        manager, donor = cached_manager(impl, 10)
        table = list(donor.block_table)
        manager.free(donor)
        hits, num_tokens = manager.get_computed_blocks(Sequence(1, list(donor.token_ids)))
    expect_equal([b.block_id for b in hits], table[:2], inputs=f"{inputs}; hit block ids (free blocks still hold a prefix)")
    stats = manager.prefix_cache_stats
    expect_equal((stats.queries, stats.hits), (10, 8), inputs=f"{inputs}; prefix_cache_stats (queries, hits) in tokens")
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

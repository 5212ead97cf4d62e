"""Sharing KV blocks: chained block hashes, the prefix-caching `BlockPool`, `KVCacheManager`, `copy_blocks`.

Flat tests, one behaviour each, then a stateful property test that drives a `KVCacheManager` through long random
runs of admit (with prefix hits) / chunked prefill / decode / fork / free against a shadow cache: a dict from
slot to the token id written there. Reading a sequence back through its block table from the shadow must give
its tokens — which fails on a copy-on-write that does not copy, copies the wrong block, a hit on a block that
holds other tokens, or a block handed out while still held.
"""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from solutions.attention.paged import KVCache, copy_blocks
from solutions.core.block_hash import NONE_HASH, extend_block_hashes, hash_block_tokens
from solutions.core.block_pool import BlockPool
from solutions.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from solutions.core.sequence import Sequence


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


def ref_cnts(manager: KVCacheManager) -> list[int]:
    return [block.ref_cnt for block in manager.block_pool.blocks]


def prefill(manager: KVCacheManager, seq: Sequence) -> list[tuple[int, int]] | None:
    """Admit `seq` the way the scheduler does, and mark its prompt computed as the model runner would."""
    hits, num_cached = manager.get_computed_blocks(seq)
    copies = manager.allocate_slots(seq, seq.num_tokens - num_cached, hits)
    if copies is not None:
        seq.num_computed_tokens = seq.num_tokens
    return copies


def decode(manager: KVCacheManager, seq: Sequence, token_id: int) -> list[tuple[int, int]] | None:
    seq.append_token(token_id)
    copies = manager.allocate_slots(seq, 1)
    if copies is not None:
        seq.num_computed_tokens += 1
    return copies


# block hashes ----------------------------------------------------------------------------------------------------


def test_block_hash_is_a_sha256_digest_that_depends_on_tokens_and_parent():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(first, bytes) and len(first) == 32
    assert hash_block_tokens(None, [1, 2, 3, 4]) == first  # deterministic across calls (and processes)
    assert hash_block_tokens(None, [1, 2, 3, 5]) != first
    assert hash_block_tokens(first, [1, 2, 3, 4]) != first  # the same tokens after a prefix are another block
    assert hash_block_tokens(NONE_HASH, [1, 2, 3, 4]) == first


def test_equal_block_hashes_mean_equal_prefixes():
    a, b = [], []
    extend_block_hashes(a, [1, 2, 3, 4, 5, 6, 7, 8, 9], 9, 4)
    extend_block_hashes(b, [0, 2, 3, 4, 5, 6, 7, 8], 8, 4)
    assert len(a) == 2 and len(b) == 2  # full blocks only
    assert a[0] != b[0] and a[1] != b[1]  # the second blocks hold equal tokens after different first blocks


def test_extend_block_hashes_keeps_the_known_hashes_and_adds_new_full_blocks():
    hashes: list[bytes] = []
    tokens = list(range(10))
    extend_block_hashes(hashes, tokens, 5, 4)
    first = list(hashes)
    extend_block_hashes(hashes, tokens, 10, 4)
    assert len(first) == 1 and hashes[:1] == first and len(hashes) == 2
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])


# block pool ------------------------------------------------------------------------------------------------------


def test_touch_revives_a_free_cached_block_from_the_middle_of_the_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_block(blocks[1], b"h1")
    pool.free_blocks(blocks)
    assert free_ids(pool) == [0, 1, 2, 3]
    hit = pool.get_cached_block(b"h1")
    assert hit is blocks[1] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1 and free_ids(pool) == [0, 2, 3] and pool.num_free_blocks == 3
    pool.touch([hit])  # a second holder of a used block: no queue change
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 3


def test_freed_blocks_keep_their_hash_until_handed_out_again():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"ha")
    pool.free_blocks([b, a])  # tail first: b is evicted before a
    assert a.block_hash == b"ha" and pool.get_cached_block(b"ha") is a
    (first,) = pool.get_new_blocks(1)
    assert first is b and pool.get_cached_block(b"ha") is a
    (second,) = pool.get_new_blocks(1)
    assert second is a and a.block_hash is None and pool.get_cached_block(b"ha") is None  # evicted on reuse


def test_eviction_takes_the_least_recently_freed_cached_block():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for block, h in zip(blocks, [b"x", b"y", b"z"], strict=True):
        pool.cache_full_block(block, h)
    pool.free_blocks([blocks[2]])
    pool.free_blocks([blocks[0]])
    pool.free_blocks([blocks[1]])
    pool.get_new_blocks(2)
    assert [pool.get_cached_block(h) is not None for h in (b"x", b"y", b"z")] == [False, True, False]


def test_one_hash_one_block():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"h")
    pool.cache_full_block(b, b"h")  # the same prefix computed twice: the first copy stays the cached one
    assert pool.get_cached_block(b"h") is a and b.block_hash is None
    with pytest.raises(RuntimeError, match="another hash"):
        pool.cache_full_block(a, b"other")
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="only a held block"):
        pool.cache_full_block(a, b"h")


# fork, free and copy-on-write ------------------------------------------------------------------------------------


def test_fork_shares_every_block_and_raises_ref_counts():
    manager = KVCacheManager(8, 4)
    parent = Sequence(0, list(range(6)))
    prefill(manager, parent)
    child = parent.fork(1)
    manager.fork(parent, child)
    assert child.block_table == parent.block_table == [0, 1]
    assert ref_cnts(manager)[:3] == [2, 2, 0] and manager.num_used_blocks == 2
    with pytest.raises(ValueError, match="already holds"):
        manager.fork(parent, child)


def test_free_of_a_shared_block_keeps_it_until_the_last_holder_frees():
    manager = KVCacheManager(8, 4, enable_prefix_caching=False)
    parent = Sequence(0, list(range(6)))
    prefill(manager, parent)
    child = parent.fork(1)
    manager.fork(parent, child)
    manager.free(parent)
    assert parent.block_table == [] and ref_cnts(manager)[:2] == [1, 1] and manager.num_free_blocks == 6
    manager.free(child)
    assert manager.num_free_blocks == 8 and ref_cnts(manager) == [0] * 8


def test_append_into_a_shared_partial_block_copies_it_once():
    manager = KVCacheManager(8, 4)
    parent = Sequence(0, list(range(6)))  # block 1 holds 2 of 4 tokens
    prefill(manager, parent)
    child = parent.fork(1)
    manager.fork(parent, child)
    assert decode(manager, parent, 7) == [(1, 2)]  # parent gets block 2, a copy of block 1
    assert parent.block_table == [0, 2] and child.block_table == [0, 1]
    assert decode(manager, child, 8) == []  # block 1 is the child's alone now: written in place
    assert manager.num_blocks_copied == 1 and ref_cnts(manager)[:3] == [2, 1, 1]


def test_a_token_that_starts_a_block_never_copies():
    manager = KVCacheManager(8, 4)
    parent = Sequence(0, list(range(8)))  # two full blocks
    prefill(manager, parent)
    child = parent.fork(1)
    manager.fork(parent, child)
    assert decode(manager, parent, 1) == [] and decode(manager, child, 2) == []
    assert parent.block_table[:2] == child.block_table[:2] and parent.block_table[2] != child.block_table[2]
    assert manager.num_blocks_copied == 0


def test_append_slot_is_the_decode_verb_with_copy_on_write():
    manager = KVCacheManager(4, 2, enable_prefix_caching=False)
    parent = Sequence(0, [1, 2, 3])
    manager.allocate(parent)
    child = parent.fork(1)
    manager.fork(parent, child)
    parent.append_token(4)
    assert manager.can_append_slot(parent) and manager.append_slot(parent) == [(1, 2)]
    child.append_token(5)
    assert manager.append_slot(child) == []
    child.append_token(6)  # starts a block
    assert manager.append_slot(child) == [] and child.block_table == [0, 1, 3]
    parent.append_token(7)
    assert not manager.can_append_slot(parent)
    with pytest.raises(ValueError, match="0 of 4 blocks are free"):
        manager.append_slot(parent)


def test_allocate_slots_returns_none_and_changes_nothing_when_short():
    manager = KVCacheManager(3, 4)
    a = Sequence(0, list(range(6)))
    prefill(manager, a)
    b = a.fork(1)
    manager.fork(a, b)
    hog = Sequence(2, list(range(100, 104)))
    prefill(manager, hog)  # the last free block
    before = (list(a.block_table), ref_cnts(manager), manager.num_free_blocks)
    a.append_token(9)
    assert manager.allocate_slots(a, 1) is None  # needs a block for the copy
    assert (a.block_table, ref_cnts(manager), manager.num_free_blocks) == before


def test_allocate_slots_covers_chunks():
    manager = KVCacheManager(8, 4)
    seq = Sequence(0, list(range(11)))
    assert manager.allocate_slots(seq, 5) == [] and len(seq.block_table) == 2
    seq.num_computed_tokens = 5
    assert manager.allocate_slots(seq, 6) == [] and len(seq.block_table) == 3
    assert len(seq.block_hashes) == 2
    with pytest.raises(ValueError, match="has 11 tokens"):
        manager.allocate_slots(seq, 7)


# prefix caching --------------------------------------------------------------------------------------------------


def test_get_computed_blocks_finds_the_longest_cached_prefix():
    manager = KVCacheManager(16, 4)
    first = Sequence(0, list(range(14)))
    prefill(manager, first)
    manager.free(first)
    same_start = Sequence(1, list(range(9)) + [99, 98, 97])
    hits, num_cached = manager.get_computed_blocks(same_start)
    assert [b.block_id for b in hits] == first_blocks(first, manager)[:2] and num_cached == 8
    assert manager.prefix_cache_stats == PrefixCacheStats(num_requests=2, queries=26, hits=8)


def first_blocks(seq: Sequence, manager: KVCacheManager) -> list[int]:
    return [manager.block_pool.get_cached_block(h).block_id for h in seq.block_hashes]


@pytest.mark.parametrize("prompt_len, want_blocks", [(8, 1), (9, 2), (12, 2), (13, 3)])
def test_get_computed_blocks_never_covers_the_last_token(prompt_len, want_blocks):
    manager = KVCacheManager(16, 4)
    donor = Sequence(0, list(range(16)))
    prefill(manager, donor)
    hits, num_cached = manager.get_computed_blocks(Sequence(1, list(range(prompt_len))))
    assert len(hits) == want_blocks and num_cached == 4 * want_blocks < prompt_len


def test_a_miss_ends_the_hit_run():
    manager = KVCacheManager(16, 4)
    donor = Sequence(0, list(range(16)))
    prefill(manager, donor)
    other = Sequence(1, [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 12])  # block 2 equal in tokens, not in prefix
    hits, num_cached = manager.get_computed_blocks(other)
    assert num_cached == 4


def test_prefix_hits_skip_the_cached_tokens_and_share_the_blocks():
    manager = KVCacheManager(8, 4)
    a = Sequence(0, list(range(10)))
    prefill(manager, a)
    b = Sequence(1, list(range(10)))
    hits, num_cached = manager.get_computed_blocks(b)
    assert num_cached == 8
    assert manager.allocate_slots(b, b.num_tokens - num_cached, hits) == []
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert ref_cnts(manager)[:2] == [2, 2] and manager.num_used_blocks == 4


def test_a_hit_on_a_free_block_revives_it_and_it_no_longer_counts_as_free():
    manager = KVCacheManager(4, 4)
    a = Sequence(0, list(range(9)))
    prefill(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 4
    b = Sequence(1, list(range(9)) + [5, 5, 5, 5, 5, 5, 5])  # 16 tokens: 2 cached blocks + 2 new
    hits, num_cached = manager.get_computed_blocks(b)
    assert manager.allocate_slots(b, b.num_tokens - num_cached, hits) == []
    assert manager.num_free_blocks == 0 and sorted(ref_cnts(manager)) == [1, 1, 1, 1]


def test_caching_off_finds_nothing_and_registers_nothing():
    manager = KVCacheManager(8, 4, enable_prefix_caching=False)
    a = Sequence(0, list(range(10)))
    prefill(manager, a)
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.get_computed_blocks(Sequence(1, list(range(10)))) == ([], 0)


def test_blocks_registered_but_never_computed_are_forgotten_on_free():
    manager = KVCacheManager(8, 4)
    a = Sequence(0, list(range(10)))
    hits, _ = manager.get_computed_blocks(a)
    manager.allocate_slots(a, 10, hits)  # scheduled, then preempted before the forward pass ran
    manager.free(a)
    assert manager.block_pool.cached_block_hash_to_block == {}


def test_manager_rejects_a_non_bool_caching_flag():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        KVCacheManager(4, 4, enable_prefix_caching=1)


# copy_blocks -----------------------------------------------------------------------------------------------------


def test_copy_blocks_copies_k_and_v_of_every_layer():
    shape = (5, 2, 1, 3)  # (num_blocks, block_size, Hkv, D)
    g = torch.Generator().manual_seed(0)
    cache = KVCache([torch.randn(shape, generator=g) for _ in range(2)], [torch.randn(shape, generator=g) for _ in range(2)])
    want = [t.clone() for t in cache.key_caches + cache.value_caches]
    for t in want:
        t[3], t[4] = t[1].clone(), t[1].clone()
        t[0] = t[2].clone()
    copy_blocks(cache, [(1, 3), (2, 0), (1, 4)])
    for got, expected in zip(cache.key_caches + cache.value_caches, want, strict=True):
        assert torch.equal(got, expected)
    copy_blocks(cache, [])


# stateful property test ------------------------------------------------------------------------------------------

PREFIXES = [list(range(100, 112)), list(range(200, 206)), [300]]


class KVCacheManagerMachine(RuleBasedStateMachine):
    """Admit / prefill in chunks / decode / fork / free at random, with a shadow of every slot's contents."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.integers(1, 6), caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.seqs: list[Sequence] = []
        self.shadow: dict[int, int] = {}  # slot -> token id whose K/V the slot holds
        self.next_id = 0

    def slot(self, seq: Sequence, pos: int) -> int:
        bs = self.manager.block_size
        return seq.block_table[pos // bs] * bs + pos % bs

    def run_forward(self, seq: Sequence, copies: list[tuple[int, int]], num_new: int) -> None:
        """What the model runner does: apply the copies, then write the new tokens' K/V."""
        bs = self.manager.block_size
        for src, dst in copies:
            for offset in range(bs):
                if src * bs + offset in self.shadow:
                    self.shadow[dst * bs + offset] = self.shadow[src * bs + offset]
                else:
                    self.shadow.pop(dst * bs + offset, None)
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
            self.shadow[self.slot(seq, pos)] = seq.token_ids[pos]
        seq.num_computed_tokens += num_new

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), cut=st.integers(1, 12), suffix=st.lists(st.integers(0, 3), max_size=8))
    def admit(self, prefix, cut, suffix):
        seq = Sequence(self.next_id, PREFIXES[prefix][:cut] + suffix)
        self.next_id += 1
        hits, num_cached = self.manager.get_computed_blocks(seq)
        assert num_cached < seq.num_tokens and num_cached == len(hits) * self.manager.block_size
        for i, block in enumerate(hits):  # a hit holds exactly this request's tokens
            bs = self.manager.block_size
            got = [self.shadow.get(block.block_id * bs + o) for o in range(bs)]
            assert got == seq.token_ids[i * bs : (i + 1) * bs], "a prefix hit returned a block holding other tokens"
        num_new = max(1, (seq.num_tokens - num_cached) // 2)  # a first chunk
        free_before = self.manager.num_free_blocks
        copies = self.manager.allocate_slots(seq, num_new, hits)
        if copies is None:
            assert seq.block_table == [] and self.manager.num_free_blocks == free_before
            return
        assert copies == []
        seq.num_computed_tokens = num_cached  # the scheduler counts the hits as computed
        self.run_forward(seq, copies, num_new)
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 1000), token=st.integers(0, 3))
    def step(self, index, token):
        """The next prefill chunk, or (prompt done) one decode token."""
        seq = self.seqs[index % len(self.seqs)]
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(token)
        num_new = seq.num_tokens - seq.num_computed_tokens
        table_before = list(seq.block_table)
        cnts_before = ref_cnts(self.manager)
        copies = self.manager.allocate_slots(seq, num_new)
        if copies is None:  # the scheduler would preempt: here, free it
            assert seq.block_table == table_before and ref_cnts(self.manager) == cnts_before
            self.free_seq(seq)
            return
        for src, dst in copies:
            assert src in table_before and dst not in table_before and self.manager.block_pool.blocks[src].ref_cnt >= 1
        self.run_forward(seq, copies, num_new)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 1000))
    def fork(self, index):
        parent = self.seqs[index % len(self.seqs)]
        child = parent.fork(self.next_id)
        self.next_id += 1
        self.manager.fork(parent, child)
        self.seqs.append(child)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 1000))
    def free(self, index):
        self.free_seq(self.seqs[index % len(self.seqs)])

    def free_seq(self, seq: Sequence) -> None:
        self.manager.free(seq)
        self.seqs.remove(seq)
        assert seq.block_table == []

    @invariant()
    def ref_cnt_counts_block_tables(self):
        pool = self.manager.block_pool
        holders = [0] * self.manager.num_blocks
        for seq in self.seqs:
            for block_id in seq.block_table:
                holders[block_id] += 1
        assert ref_cnts(self.manager) == holders
        free = free_ids(pool)
        assert sorted(free) == [i for i, n in enumerate(holders) if n == 0], "free queue ⇔ ref_cnt 0"
        assert self.manager.num_free_blocks + self.manager.num_used_blocks == self.manager.num_blocks

    @invariant()
    def every_sequence_reads_back_its_tokens(self):
        for seq in self.seqs:
            got = [self.shadow.get(self.slot(seq, p)) for p in range(seq.num_computed_tokens)]
            assert got == seq.token_ids[: seq.num_computed_tokens], f"sequence {seq.seq_id} reads other tokens"

    @invariant()
    def cached_blocks_hold_their_hashed_tokens(self):
        pool = self.manager.block_pool
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash
        if not self.manager.enable_prefix_caching:
            assert pool.cached_block_hash_to_block == {}

    def teardown(self):
        for seq in list(self.seqs):
            self.free_seq(seq)
        assert self.manager.num_free_blocks == self.manager.num_blocks, "blocks leaked"
        assert ref_cnts(self.manager) == [0] * self.manager.num_blocks


TestKVCacheManagerMachine = KVCacheManagerMachine.TestCase
TestKVCacheManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)

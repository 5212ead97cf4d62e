"""The paged allocator: `Sequence`, the free block queue, `BlockPool` and `BlockManager`.

Flat tests, one behaviour each, then a stateful property test that drives a `BlockManager` through long random
runs of prefill / decode / finish / double free and checks every invariant after every step.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from solutions.core.block_manager import BlockManager, slot_mapping
from solutions.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.utils.math_utils import cdiv


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


# Sequence ----------------------------------------------------------------------------------------------------------


def test_sequence_copies_the_prompt_and_splits_prompt_from_outputs():
    prompt = [5, 6, 7]
    seq = Sequence(3, prompt)
    seq.append_token(8)
    seq.append_token(9)
    assert prompt == [5, 6, 7]  # the caller's list did not grow
    assert (seq.seq_id, seq.status, seq.block_table, seq.num_computed_tokens) == (3, SequenceStatus.WAITING, [], 0)
    assert seq.token_ids == [5, 6, 7, 8, 9]
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens, seq.last_token_id) == (5, 3, 2, 9)
    assert (seq.prompt_token_ids, seq.output_token_ids) == ([5, 6, 7], [8, 9])


def test_sequence_rejects_an_empty_prompt():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Sequence(0, [])


def test_sequence_has_no_instance_dict():
    with pytest.raises(AttributeError):
        Sequence(0, [1]).typo = 1


# free block queue ----------------------------------------------------------------------------------------------


def test_free_queue_pops_from_the_head_in_order():
    queue = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(4)])
    assert [queue.popleft().block_id for _ in range(4)] == [0, 1, 2, 3]
    assert queue.num_free_blocks == 0
    with pytest.raises(RuntimeError, match="empty"):
        queue.popleft()


def test_free_queue_appends_at_the_tail_in_lru_order():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue(blocks)
    first, second = queue.popleft(), queue.popleft()
    queue.append(second)
    queue.append(first)
    assert [b.block_id for b in queue.get_all_free_blocks()] == [2, 3, 1, 0]


def test_free_queue_removes_from_the_middle_by_relinking_neighbours():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 3, 4]
    assert blocks[1].next_free_block is blocks[3] and blocks[3].prev_free_block is blocks[1]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert queue.num_free_blocks == 4


def test_free_queue_refuses_a_block_twice_or_a_block_it_does_not_hold():
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(RuntimeError, match="already in the free block queue"):
        queue.append(blocks[1])
    queue.remove(blocks[1])
    with pytest.raises(RuntimeError, match="not in the free block queue"):
        queue.remove(blocks[1])
    assert queue.num_free_blocks == 2


# block pool ----------------------------------------------------------------------------------------------------


def test_pool_hands_out_blocks_with_one_reference():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1 and free_ids(pool) == [3]


def test_pool_refusal_names_requested_and_free_counts():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(ValueError, match=r"cannot get 2 blocks: only 1 of 4 are free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1


def test_pool_frees_to_the_tail_in_the_given_order():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_pool_double_free_raises_before_changing_anything():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    with pytest.raises(RuntimeError, match="block 1 freed 2 time"):
        pool.free_blocks([a, b, b])
    assert (a.ref_cnt, b.ref_cnt, pool.num_free_blocks) == (1, 1, 2)
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="ref_cnt is 0"):
        pool.free_blocks([a])


def test_pool_keeps_a_shared_block_until_its_last_reference_goes():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt += 1  # a second owner, as a fork will do
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2


# block manager -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["num_blocks", "block_size"])
@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "16"])
def test_block_manager_rejects_bad_constructor_args_naming_the_field(field, bad):
    kwargs = {"num_blocks": 8, "block_size": 4, field: bad}
    with pytest.raises(ValueError, match=field):
        BlockManager(**kwargs)


def test_cdiv_rounds_up():
    assert [cdiv(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_slot_mapping_follows_the_block_table():
    assert slot_mapping([7, 2], 0, 8, 4) == [28, 29, 30, 31, 8, 9, 10, 11]
    assert slot_mapping([7, 2], 3, 6, 4) == [31, 8, 9]
    assert slot_mapping([7, 2], 5, 5, 4) == []


def test_slot_mapping_rejects_positions_beyond_the_table():
    with pytest.raises(ValueError, match=r"positions \[6, 9\)"):
        slot_mapping([7, 2], 6, 9, 4)


def test_allocate_covers_every_prompt_token():
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence(0, list(range(9)))
    assert manager.can_allocate(seq)
    manager.allocate(seq)
    assert seq.block_table == [0, 1, 2]
    assert (manager.num_free_blocks, manager.num_used_blocks) == (5, 3)


def test_allocate_refuses_with_what_was_requested_and_what_is_free():
    manager = BlockManager(num_blocks=4, block_size=4)
    manager.allocate(Sequence(0, [1] * 9))
    seq = Sequence(1, [1] * 5)
    assert not manager.can_allocate(seq)
    with pytest.raises(ValueError, match=r"5 tokens need 2 blocks of 4, only 1 of 4 blocks are free"):
        manager.allocate(seq)
    assert seq.block_table == [] and manager.num_free_blocks == 1


def test_allocate_refuses_a_sequence_that_already_holds_blocks():
    manager = BlockManager(num_blocks=4, block_size=4)
    seq = Sequence(0, [1, 2])
    manager.allocate(seq)
    with pytest.raises(ValueError, match="already holds 1 blocks"):
        manager.allocate(seq)


def test_append_slot_allocates_only_at_block_boundaries():
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence(0, [1, 2, 3])
    manager.allocate(seq)
    num_blocks_after_each_token = []
    for token in range(10):  # tokens 4..13
        seq.append_token(token)
        manager.append_slot(seq)
        num_blocks_after_each_token.append(len(seq.block_table))
    assert num_blocks_after_each_token == [1, 2, 2, 2, 2, 3, 3, 3, 3, 4]


def test_can_append_slot_needs_a_free_block_only_at_a_boundary():
    manager = BlockManager(num_blocks=2, block_size=2)
    seq = Sequence(0, [1, 2, 3])
    manager.allocate(seq)  # both blocks
    seq.append_token(4)
    assert manager.can_append_slot(seq)  # slot 4 is in the second block
    manager.append_slot(seq)
    seq.append_token(5)
    assert not manager.can_append_slot(seq)
    with pytest.raises(ValueError, match="0 of 2 blocks are free"):
        manager.append_slot(seq)


def test_append_slot_requires_an_allocated_sequence():
    manager = BlockManager(num_blocks=2, block_size=2)
    with pytest.raises(ValueError, match="allocate it before decoding"):
        manager.can_append_slot(Sequence(0, [1]))


def test_append_slot_refuses_to_cover_more_than_one_new_token():
    manager = BlockManager(num_blocks=4, block_size=2)
    seq = Sequence(0, [1, 2])
    manager.allocate(seq)
    seq.append_token(3)
    seq.append_token(4)
    seq.append_token(5)
    with pytest.raises(RuntimeError, match="one new token per call"):
        manager.append_slot(seq)


def test_free_returns_the_blocks_tail_first_and_clears_the_table():
    manager = BlockManager(num_blocks=5, block_size=2)
    seq = Sequence(0, [1] * 6)
    manager.allocate(seq)
    table = seq.block_table
    manager.free(seq)
    assert seq.block_table == [] and table is seq.block_table
    assert free_ids(manager.block_pool) == [3, 4, 2, 1, 0]
    assert manager.num_free_blocks == 5


# stateful property test -----------------------------------------------------------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Random prefill / decode / preempt / finish runs against a `BlockManager`, checked after every step."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.integers(1, 8))
    def setup(self, num_blocks, block_size):
        self.manager = BlockManager(num_blocks, block_size)
        self.running: list[Sequence] = []
        self.next_id = 0

    @rule(prompt_len=st.integers(1, 40))
    def prefill(self, prompt_len):
        seq = Sequence(self.next_id, list(range(prompt_len)))
        self.next_id += 1
        free_before = self.manager.num_free_blocks
        if self.manager.can_allocate(seq):
            self.manager.allocate(seq)
            assert len(seq.block_table) == cdiv(prompt_len, self.manager.block_size)
            self.running.append(seq)
        else:
            with pytest.raises(ValueError, match=rf"need {cdiv(prompt_len, self.manager.block_size)} blocks.*"
                               rf"only {free_before} of"):
                self.manager.allocate(seq)
            assert seq.block_table == [] and self.manager.num_free_blocks == free_before

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 1000))
    def decode(self, index):
        seq = self.running[index % len(self.running)]
        seq.append_token(0)
        table_before = list(seq.block_table)
        if self.manager.can_append_slot(seq):
            self.manager.append_slot(seq)
            assert seq.block_table[: len(table_before)] == table_before  # never moves a written block
        else:  # the engine would preempt: the refusal must be explicit and harmless
            with pytest.raises(ValueError, match="0 of .* blocks are free"):
                self.manager.append_slot(seq)
            assert seq.block_table == table_before
            self.finish_seq(seq)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 1000))
    def finish(self, index):
        self.finish_seq(self.running[index % len(self.running)])

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 1000))
    def double_free_is_refused(self, index):
        seq = self.running[index % len(self.running)]
        blocks = [self.manager.block_pool.blocks[i] for i in seq.block_table]
        free_before = self.manager.num_free_blocks
        with pytest.raises(RuntimeError, match="double free"):
            self.manager.block_pool.free_blocks(blocks + blocks[-1:])
        assert self.manager.num_free_blocks == free_before

    def finish_seq(self, seq):
        num_blocks = len(seq.block_table)
        free_before = self.manager.num_free_blocks
        self.manager.free(seq)
        self.running.remove(seq)
        assert seq.block_table == [] and self.manager.num_free_blocks == free_before + num_blocks

    @invariant()
    def blocks_are_conserved_and_owned_once(self):
        manager = self.manager
        owned = [block_id for seq in self.running for block_id in seq.block_table]
        assert len(owned) == len(set(owned)), "a block is in two block tables"
        free = free_ids(manager.block_pool)
        assert len(free) == manager.num_free_blocks
        assert set(owned).isdisjoint(free), "a block is both owned and free"
        assert sorted(owned + free) == list(range(manager.num_blocks)), "a block leaked"
        assert manager.num_free_blocks + manager.num_used_blocks == manager.num_blocks
        for block in manager.block_pool.blocks:
            assert block.ref_cnt == (0 if block.block_id in free else 1)

    @invariant()
    def every_token_has_a_slot(self):
        for seq in self.running:
            assert len(seq.block_table) == cdiv(seq.num_tokens, self.manager.block_size)
            slots = slot_mapping(seq.block_table, 0, seq.num_tokens, self.manager.block_size)
            assert len(set(slots)) == seq.num_tokens


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)

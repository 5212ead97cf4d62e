"""Grading tests for chapter 03 — the block manager and paged attention.

Each test grades one exercise (`@pytest.mark.exercise`). The oracles are independent of the code under test:
a plain Python list for the free block queue, a count of `cdiv(num_tokens, block_size)` per sequence for the
block manager, `divmod` for the slot mapping, a dense `(seq_len, Hkv, D)` tensor for the cache, PyTorch's fused
attention over that dense tensor for paged attention, and Hugging Face `generate` for paged generation.
The capstone runs every exercise together on SmolLM2 and compares with Hugging Face's stored greedy tokens.
"""

import functools
import random

import pytest
import torch
import torch.nn.functional as F

from grading import exercising, expect_close, expect_equal, expect_raises
from grading.differential import differential_test, scheduler_workloads
from grading.capstone import CAPSTONE_PROMPTS, smollm2, smollm2_greedy, swap_in
from grading.tiny_models import hf_model, tiny_checkpoint, tiny_model
from solutions.attention import paged as paged_attention
from solutions.baselines import naive, paged_generation
from solutions.core import block_manager, block_pool
from solutions.core.block_pool import KVCacheBlock
from solutions.attention.paged import AttentionMetadata
from solutions.core.sequence import Sequence

REFERENCE = {
    "FreeKVCacheBlockQueue": block_pool.FreeKVCacheBlockQueue,
    "BlockManager": block_manager.BlockManager,
    "slot_mapping": block_manager.slot_mapping,
    "write_to_kv_cache": paged_attention.write_to_kv_cache,
    "gather_kv": paged_attention.gather_kv,
    "paged_attention": paged_attention.paged_attention,
    "generate_paged": paged_generation.generate_paged,
}

pytestmark = pytest.mark.timeout(60)


@functools.cache
def model_named(name: str):
    return tiny_model(name)  # loaded once per test run: the model holds no per-request state


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)




# --- FreeKVCacheBlockQueue --------------------------------------------------------------------------------------


def queue_ids(queue) -> list[int]:
    """Block ids head → tail, following `next_free_block` from the head sentinel (at most 100 hops)."""
    ids, block = [], queue.head.next_free_block
    while block is not queue.tail and block is not None and len(ids) < 100:
        ids.append(block.block_id)
        block = block.next_free_block
    return ids


def queue_ids_backward(queue) -> list[int]:
    """Block ids head → tail, found by following `prev_free_block` from the tail sentinel."""
    ids, block = [], queue.tail.prev_free_block
    while block is not queue.head and block is not None and len(ids) < 100:
        ids.append(block.block_id)
        block = block.prev_free_block
    return ids[::-1]


def expect_queue(queue, model: list[int], blocks: list[KVCacheBlock], inputs: str) -> None:
    """The linked list must hold `model`'s ids in order, both ways, with the count right and outsiders unlinked."""
    expect_equal(queue_ids(queue), model, inputs=f"{inputs}; ids from head to tail along next_free_block")
    expect_equal(queue_ids_backward(queue), model, inputs=f"{inputs}; ids from head to tail along prev_free_block")
    expect_equal(queue.num_free_blocks, len(model), inputs=f"{inputs}; num_free_blocks")
    unlinked = [(b.block_id, b.prev_free_block, b.next_free_block) for b in blocks if b.block_id not in model]
    expect_equal(
        unlinked, [(i, None, None) for i, *_ in unlinked], inputs=f"{inputs}; links of blocks not in the queue"
    )


@pytest.mark.exercise("FreeKVCacheBlockQueue")
def test_free_queue_holds_the_blocks_in_order(impl):
    blocks = [KVCacheBlock(i) for i in range(5)]
    with exercising("FreeKVCacheBlockQueue", "blocks 0..4"):
        queue = impl.FreeKVCacheBlockQueue(blocks)
    expect_queue(queue, [0, 1, 2, 3, 4], blocks, "FreeKVCacheBlockQueue(blocks 0..4)")


@pytest.mark.exercise("FreeKVCacheBlockQueue")
def test_free_queue_popleft_takes_the_head_and_append_goes_to_the_tail(impl):
    blocks = [KVCacheBlock(i) for i in range(4)]
    inputs = "blocks 0..3, popleft ×2, then append(block 0)"
    with exercising("FreeKVCacheBlockQueue", inputs):
        queue = impl.FreeKVCacheBlockQueue(blocks)
        popped = [queue.popleft().block_id, queue.popleft().block_id]
        expect_equal(popped, [0, 1], inputs=f"{inputs}; the popped ids")
        expect_queue(queue, [2, 3], blocks, "blocks 0..3, popleft ×2")
        queue.append(blocks[0])
    expect_queue(queue, [2, 3, 0], blocks, inputs)


@pytest.mark.exercise("FreeKVCacheBlockQueue")
@pytest.mark.parametrize("where", [0, 2, 4])
def test_free_queue_remove_unlinks_from_anywhere(impl, where):
    blocks = [KVCacheBlock(i) for i in range(5)]
    inputs = f"blocks 0..4, remove(block {where})"
    with exercising("FreeKVCacheBlockQueue", inputs):
        queue = impl.FreeKVCacheBlockQueue(blocks)
        queue.remove(blocks[where])
        expect_queue(queue, [i for i in range(5) if i != where], blocks, inputs)
        queue.append(blocks[where])  # a removed block can come back
    expect_queue(queue, [i for i in range(5) if i != where] + [where], blocks, f"{inputs}, then append it again")


@pytest.mark.exercise("FreeKVCacheBlockQueue")
def test_free_queue_can_be_emptied_and_refilled(impl):
    blocks = [KVCacheBlock(i) for i in range(3)]
    inputs = "blocks 0..2, popleft ×3"
    with exercising("FreeKVCacheBlockQueue", inputs):
        queue = impl.FreeKVCacheBlockQueue(blocks)
        for _ in range(3):
            queue.popleft()
        expect_queue(queue, [], blocks, inputs)
        expect_raises(RuntimeError, queue.popleft, inputs=f"{inputs}, popleft from the empty queue")
        queue.append(blocks[1])
    expect_queue(queue, [1], blocks, f"{inputs}, then append(block 1)")


@pytest.mark.exercise("FreeKVCacheBlockQueue")
def test_free_queue_refuses_a_block_twice(impl):
    blocks = [KVCacheBlock(i) for i in range(3)]
    with exercising("FreeKVCacheBlockQueue", "blocks 0..2"):
        queue = impl.FreeKVCacheBlockQueue(blocks)
        expect_raises(RuntimeError, lambda: queue.append(blocks[1]), inputs="blocks 0..2, append(block 1) again")
        queue.remove(blocks[1])
        expect_raises(RuntimeError, lambda: queue.remove(blocks[1]), inputs="blocks 0..2, remove(block 1) twice")
    expect_queue(queue, [0, 2], blocks, "blocks 0..2, remove(block 1)")


@pytest.mark.exercise("FreeKVCacheBlockQueue")
def test_free_queue_matches_a_python_list_over_random_operations(impl):
    rng = random.Random(3)
    blocks = [KVCacheBlock(i) for i in range(8)]
    model = list(range(8))  # the oracle: a plain list, head first
    history = []
    with exercising("FreeKVCacheBlockQueue", "blocks 0..7 and random operations"):
        queue = impl.FreeKVCacheBlockQueue(blocks)
        for _ in range(60):
            outside = [i for i in range(8) if i not in model]
            op = rng.choice(["popleft", "remove"] * bool(model) + ["append"] * bool(outside))
            if op == "popleft":
                history.append("popleft")
                expect_equal(queue.popleft().block_id, model.pop(0), inputs=f"blocks 0..7, {', '.join(history)}")
            elif op == "remove":
                block_id = rng.choice(model)
                history.append(f"remove({block_id})")
                queue.remove(blocks[block_id])
                model.remove(block_id)
            else:
                block_id = rng.choice(outside)
                history.append(f"append({block_id})")
                queue.append(blocks[block_id])
                model.append(block_id)
            expect_queue(queue, model, blocks, f"blocks 0..7, {', '.join(history[-6:])} (last 6 of {len(history)})")


# --- BlockManager -----------------------------------------------------------------------------------------------


def make_seq(seq_id: int, num_tokens: int) -> Sequence:
    return Sequence(seq_id, list(range(100, 100 + num_tokens)))


def expect_invariants(manager, held: list[Sequence], others: list[Sequence], inputs: str) -> None:
    """The independent count: each held sequence has cdiv(num_tokens, block_size) distinct blocks of its own."""
    size = manager.block_size
    for seq in held:
        expect_equal(
            len(seq.block_table),
            cdiv(seq.num_tokens, size),
            inputs=f"{inputs}; blocks of sequence {seq.seq_id} ({seq.num_tokens} tokens)",
        )
    for seq in others:
        expect_equal(
            seq.block_table, [], inputs=f"{inputs}; block table of sequence {seq.seq_id} (freed or never allocated)"
        )
    used = [block_id for seq in held for block_id in seq.block_table]
    expect_equal(len(set(used)), len(used), inputs=f"{inputs}; block ids held, each by one sequence: {used}")
    expect_equal(manager.num_free_blocks, manager.num_blocks - len(used), inputs=f"{inputs}; num_free_blocks")
    pool = manager.block_pool
    expect_equal(
        [pool.blocks[i].ref_cnt for i in used], [1] * len(used), inputs=f"{inputs}; ref_cnt of the held blocks"
    )
    free = sorted(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
    expect_equal(free, sorted(set(range(manager.num_blocks)) - set(used)), inputs=f"{inputs}; ids in the free queue")


@pytest.mark.exercise("BlockManager")
@pytest.mark.parametrize("num_tokens", [1, 4, 5, 8, 9])
def test_allocate_gives_a_prompt_just_enough_blocks(impl, num_tokens):
    inputs = f"BlockManager(num_blocks=6, block_size=4), allocate a {num_tokens}-token prompt"
    seq = make_seq(0, num_tokens)
    with exercising("BlockManager", inputs):
        manager = impl.BlockManager(6, 4)
        expect_equal(manager.can_allocate(seq), True, inputs=f"{inputs}; can_allocate")
        manager.allocate(seq)
    expect_invariants(manager, [seq], [], inputs)


@pytest.mark.exercise("BlockManager")
def test_can_allocate_counts_exactly_the_free_blocks(impl):
    inputs = "BlockManager(num_blocks=5, block_size=4) holding a 9-token prompt (3 blocks)"
    with exercising("BlockManager", inputs):
        manager = impl.BlockManager(5, 4)
        manager.allocate(make_seq(0, 9))
        answers = [manager.can_allocate(make_seq(1, n)) for n in (1, 8, 9)]
        expect_equal(answers, [True, True, False], inputs=f"{inputs}; can_allocate for prompts of 1, 8, 9 tokens")


@pytest.mark.exercise("BlockManager")
def test_allocate_refuses_when_blocks_are_short_and_changes_nothing(impl):
    inputs = "BlockManager(num_blocks=4, block_size=4) holding a 6-token prompt, allocate a 9-token prompt"
    first, second = make_seq(0, 6), make_seq(1, 9)
    with exercising("BlockManager", inputs):
        manager = impl.BlockManager(4, 4)
        manager.allocate(first)
        expect_raises(ValueError, lambda: manager.allocate(second), inputs=inputs)
    expect_invariants(manager, [first], [second], inputs)


@pytest.mark.exercise("BlockManager")
@pytest.mark.parametrize("block_size", [1, 4, 16])  # 16: one block holds the whole sequence
def test_append_slot_adds_a_block_exactly_when_a_token_starts_one(impl, block_size):
    inputs = f"BlockManager(num_blocks=8, block_size={block_size}), a 3-token prompt, then decode token by token"
    seq = make_seq(0, 3)
    counts = []
    with exercising("BlockManager", inputs):
        manager = impl.BlockManager(8, block_size)
        manager.allocate(seq)
        while seq.num_tokens < 8:
            seq.append_token(7)
            expect_equal(
                manager.can_append_slot(seq), True, inputs=f"{inputs}; can_append_slot at {seq.num_tokens} tokens"
            )
            manager.append_slot(seq)
            counts.append(len(seq.block_table))
    want = [cdiv(n, block_size) for n in range(4, 9)]
    expect_equal(counts, want, inputs=f"{inputs}; blocks held after append_slot at 4, 5, 6, 7, 8 tokens")
    expect_invariants(manager, [seq], [], inputs)


@pytest.mark.exercise("BlockManager")
def test_can_append_slot_needs_a_free_block_only_at_a_boundary(impl):
    inputs = "BlockManager(num_blocks=2, block_size=4), two 3-token prompts (every block in use), then one token each"
    a, b = make_seq(0, 3), make_seq(1, 4)
    with exercising("BlockManager", inputs):
        manager = impl.BlockManager(2, 4)
        manager.allocate(a)
        manager.allocate(b)
        a.append_token(7)  # token 4 fits in a's first block
        b.append_token(7)  # token 5 starts b's second block
        answers = [manager.can_append_slot(a), manager.can_append_slot(b)]
        expect_equal(answers, [True, False], inputs=f"{inputs} (one 4-token, one 5-token sequence); can_append_slot")
        manager.append_slot(a)
        expect_raises(ValueError, lambda: manager.append_slot(b), inputs=f"{inputs}; append_slot with no free block")
    tables = [len(a.block_table), len(b.block_table), manager.num_free_blocks]
    expect_equal(tables, [1, 1, 0], inputs=f"{inputs}; blocks of each sequence and blocks free afterwards")


@pytest.mark.exercise("BlockManager")
def test_free_returns_every_block_and_clears_the_table(impl):
    inputs = "BlockManager(num_blocks=6, block_size=4), prompts of 5 and 9 tokens, free the first"
    a, b = make_seq(0, 5), make_seq(1, 9)
    with exercising("BlockManager", inputs):
        manager = impl.BlockManager(6, 4)
        manager.allocate(a)
        manager.allocate(b)
        manager.free(a)
        expect_invariants(manager, [b], [a], inputs)
        manager.free(b)
    expect_invariants(manager, [], [a, b], inputs + ", then the second")


@pytest.mark.exercise("BlockManager")
def test_free_queues_a_sequences_blocks_last_block_first(impl):
    inputs = "BlockManager(num_blocks=5, block_size=2), a 5-token prompt (3 blocks), free it"
    seq = make_seq(0, 5)
    with exercising("BlockManager", inputs):
        manager = impl.BlockManager(5, 2)
        manager.allocate(seq)
        table = list(seq.block_table)
        manager.free(seq)
    tail = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()][-3:]
    expect_equal(tail, table[::-1], inputs=f"{inputs}; the last 3 ids of the free queue (block table was {table})")


@pytest.mark.exercise("BlockManager")
def test_block_manager_keeps_its_invariants_over_a_random_workload(impl):
    rng = random.Random(5)
    size, num_blocks = 4, 12
    history: list[str] = []
    running: list[Sequence] = []
    finished: list[Sequence] = []
    with exercising("BlockManager", f"BlockManager({num_blocks}, {size}) over a random workload"):
        manager = impl.BlockManager(num_blocks, size)
        for step in range(80):
            inputs = f"BlockManager(num_blocks={num_blocks}, block_size={size}), step {step}: {'; '.join(history[-4:])}"
            op = rng.choice(["arrive", "decode", "decode", "finish"])
            if op == "arrive":
                seq = make_seq(step, rng.randint(1, 14))
                free = num_blocks - sum(len(s.block_table) for s in running)
                fits = cdiv(seq.num_tokens, size) <= free
                history.append(f"a {seq.num_tokens}-token prompt arrives ({free} blocks free)")
                expect_equal(manager.can_allocate(seq), fits, inputs=f"{inputs}; can_allocate")
                if fits:
                    manager.allocate(seq)
                    running.append(seq)
                else:
                    finished.append(seq)
            elif op == "decode":
                history.append("every running sequence decodes a token")
                for seq in list(running):
                    seq.append_token(7)
                    free = num_blocks - sum(len(s.block_table) for s in running)
                    fits = cdiv(seq.num_tokens, size) - len(seq.block_table) <= free
                    expect_equal(
                        manager.can_append_slot(seq),
                        fits,
                        inputs=f"{inputs}; can_append_slot of sequence {seq.seq_id} at {seq.num_tokens} tokens",
                    )
                    if fits:
                        manager.append_slot(seq)
                    else:  # out of blocks: preempt it
                        manager.free(seq)
                        running.remove(seq)
                        finished.append(seq)
            elif running:
                seq = running.pop(rng.randrange(len(running)))
                history.append(f"sequence {seq.seq_id} finishes")
                manager.free(seq)
                finished.append(seq)
            expect_invariants(manager, running, finished, inputs)


# --- slot_mapping -----------------------------------------------------------------------------------------------


@pytest.mark.exercise("slot_mapping")
def test_slot_mapping_example_from_the_chapter(impl):
    expect_equal(
        impl.slot_mapping([7, 2], 3, 6, 4), [31, 8, 9], inputs="block_table [7, 2], positions 3..5, block_size 4"
    )


@pytest.mark.exercise("slot_mapping")
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("last_block", ["full", "partly filled"])
def test_slot_mapping_of_a_whole_sequence(impl, block_size, last_block):
    table = [5, 0, 9, 2, 7]
    num_tokens = len(table) * block_size - (last_block == "partly filled" and block_size > 1)
    want = []
    for position in range(num_tokens):
        logical_block, offset = divmod(position, block_size)
        want.append(table[logical_block] * block_size + offset)
    inputs = f"block_table {table}, positions 0..{num_tokens - 1}, block_size {block_size}"
    expect_equal(impl.slot_mapping(table, 0, num_tokens, block_size), want, inputs=inputs)


@pytest.mark.exercise("slot_mapping")
def test_slot_mapping_of_one_decode_token_and_of_nothing(impl):
    expect_equal(impl.slot_mapping([3, 6, 1], 8, 9, 4), [4], inputs="block_table [3, 6, 1], position 8, block_size 4")
    expect_equal(
        impl.slot_mapping([3, 6, 1], 5, 5, 4), [], inputs="block_table [3, 6, 1], positions [5, 5), block_size 4"
    )


@pytest.mark.exercise("slot_mapping")
def test_slot_mapping_of_a_chunk_starting_mid_block(impl):
    # a prompt chunk (or the tokens after a cached prefix): positions 6..12 of a sequence, block_size 4
    table = [4, 1, 6, 3]
    want = [1 * 4 + 2, 1 * 4 + 3, 6 * 4 + 0, 6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3, 3 * 4 + 0]
    expect_equal(impl.slot_mapping(table, 6, 13, 4), want, inputs=f"block_table {table}, positions 6..12, block_size 4")


@pytest.mark.exercise("slot_mapping")
def test_slot_mapping_rejects_positions_beyond_the_block_table(impl):
    expect_raises(
        ValueError,
        lambda: impl.slot_mapping([3, 6], 6, 9, 4),
        inputs="block_table [3, 6] (8 slots), positions 6..8, block_size 4",
    )


# --- write_to_kv_cache, gather_kv -------------------------------------------------------------------------------

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 10, 4, 2, 8


def empty_cache(fill: float = -7.0, num_kv_heads: int = NUM_KV_HEADS) -> torch.Tensor:
    return torch.full((NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM), fill)  # (num_blocks, block_size, Hkv, D)


def paged_copy(dense: torch.Tensor, block_table: list[int], cache: torch.Tensor) -> None:
    """Put a sequence's dense K (or V) into its blocks, token by token (the test's own, slow store)."""
    for position in range(dense.shape[0]):
        block, offset = divmod(position, BLOCK_SIZE)
        cache[block_table[block], offset] = dense[position]


@pytest.mark.exercise("write_to_kv_cache")
def test_write_to_kv_cache_puts_each_token_in_its_slot(impl):
    k, v = randn(6, NUM_KV_HEADS, HEAD_DIM, seed=1), randn(6, NUM_KV_HEADS, HEAD_DIM, seed=2)
    slots = torch.tensor([13, 14, 15, 36, 37, 0])  # block 3 offsets 1-3, block 9 offsets 0-1, block 0 offset 0
    key_cache, value_cache = empty_cache(), empty_cache()
    impl.write_to_kv_cache(k, v, key_cache, value_cache, slots)
    want_k, want_v = empty_cache(), empty_cache()
    for t, slot in enumerate(slots.tolist()):
        want_k[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = k[t]
        want_v[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = v[t]
    inputs = f"k, v randn(6, 2, 8), slot_mapping {slots.tolist()}, caches (10, 4, 2, 8) filled with -7"
    expect_close(key_cache, want_k, inputs=f"{inputs}; the key cache afterwards")
    expect_close(value_cache, want_v, inputs=f"{inputs}; the value cache afterwards")


@pytest.mark.exercise("write_to_kv_cache")
def test_write_to_kv_cache_then_gather_is_the_dense_sequence(impl):
    table = [7, 2, 5]
    k, v = randn(11, NUM_KV_HEADS, HEAD_DIM, seed=3), randn(11, NUM_KV_HEADS, HEAD_DIM, seed=4)
    slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(11)])
    key_cache, value_cache = empty_cache(), empty_cache()
    impl.write_to_kv_cache(k[:10], v[:10], key_cache, value_cache, slots[:10])  # prefill
    impl.write_to_kv_cache(k[10:], v[10:], key_cache, value_cache, slots[10:])  # one decode token
    flat_k = key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)  # (num_blocks * block_size, Hkv, D)
    flat_v = value_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    inputs = f"11 tokens through block_table {table}: a 10-token prefill, then 1 decode token"
    expect_close(flat_k[slots], k, inputs=f"{inputs}; keys read back from their slots")
    expect_close(flat_v[slots], v, inputs=f"{inputs}; values read back from their slots")


@pytest.mark.exercise("gather_kv")
@pytest.mark.parametrize("seq_len", [1, 4, 9, 12])
def test_gather_kv_returns_the_dense_sequence(impl, seq_len):
    table = [8, 3, 0]
    dense = randn(seq_len, NUM_KV_HEADS, HEAD_DIM, seed=seq_len)  # (seq_len, Hkv, D)
    cache = empty_cache()
    paged_copy(dense, table, cache)
    got = impl.gather_kv(cache, table[: cdiv(seq_len, BLOCK_SIZE)], seq_len)
    expect_close(
        got,
        dense,
        inputs=f"a {seq_len}-token sequence in blocks {table[: cdiv(seq_len, BLOCK_SIZE)]} of a (10, 4, 2, 8) cache",
    )


@pytest.mark.exercise("gather_kv")
def test_gather_kv_follows_the_block_table_order(impl):
    dense = randn(7, NUM_KV_HEADS, HEAD_DIM, seed=5)
    cache = empty_cache()
    paged_copy(dense, [6, 1], cache)  # logical block 0 in physical block 6, logical block 1 in physical block 1
    expect_close(impl.gather_kv(cache, [6, 1], 7), dense, inputs="a 7-token sequence in blocks [6, 1] (not sorted)")


# --- paged_attention --------------------------------------------------------------------------------------------


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The last Tq tokens of a Tk-token sequence attend causally: torch's fused attention with an explicit mask."""
    Tq, Tk = q.shape[0], k.shape[0]
    allowed = torch.arange(Tk)[None, :] <= torch.arange(Tk - Tq, Tk)[:, None]  # (Tq, Tk)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale, enable_gqa=True
    )  # (Hq, Tq, D)
    return out.transpose(0, 1)  # (Tq, Hq, D)


def paged_batch(
    seq_lens: list[int], num_new: list[int], tables: list[list[int]], num_heads: int, seed: int,
    num_kv_heads: int = NUM_KV_HEADS,
):
    """Dense K/V per sequence, the same K/V in a paged cache, the flat queries and the metadata of the step."""
    key_cache, value_cache = empty_cache(0.0, num_kv_heads), empty_cache(0.0, num_kv_heads)
    keys, values, queries, slots, starts = [], [], [], [], [0]
    for b, (seq_len, new, table) in enumerate(zip(seq_lens, num_new, tables)):
        k = randn(seq_len, num_kv_heads, HEAD_DIM, seed=seed + 3 * b)
        v = randn(seq_len, num_kv_heads, HEAD_DIM, seed=seed + 3 * b + 1)
        paged_copy(k, table, key_cache)
        paged_copy(v, table, value_cache)
        keys.append(k), values.append(v)
        queries.append(randn(new, num_heads, HEAD_DIM, seed=seed + 3 * b + 2))
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len - new, seq_len)]
        starts.append(starts[-1] + new)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens),
        block_tables=tables,
    )
    return torch.cat(queries), key_cache, value_cache, metadata, keys, values


@pytest.mark.exercise("paged_attention")
@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (4, 2), (9, 3)])  # MHA; GQA 2; SmolLM2's GQA 3
def test_paged_attention_matches_dense_attention_on_a_mixed_batch(impl, num_heads, num_kv_heads):
    # a whole prefill (10 tokens), a decode (1 new of 6), a chunk (3 new of 9: it starts mid-block, after a cached
    # prefix), a one-token prompt
    seq_lens, num_new, tables = [10, 6, 9, 1], [10, 1, 3, 1], [[4, 9, 0], [7, 2], [1, 8, 3], [6]]
    q, key_cache, value_cache, metadata, keys, values = paged_batch(
        seq_lens, num_new, tables, num_heads, seed=10, num_kv_heads=num_kv_heads
    )
    got = impl.paged_attention(q, key_cache, value_cache, metadata, 0.3)
    want = torch.cat([dense_attention(qb, k, v, 0.3) for qb, k, v in zip(q.split(num_new), keys, values)])
    inputs = (
        f"seq_lens {seq_lens}, new tokens {num_new}, block_tables {tables}, Hq {num_heads}, Hkv {num_kv_heads}, "
        "scale 0.3"
    )
    expect_close(got, want, inputs=inputs)


@pytest.mark.exercise("paged_attention")
def test_paged_attention_reads_only_the_sequences_own_blocks(impl):
    seq_lens, num_new, tables = [5, 7], [1, 1], [[3, 0], [8, 5]]
    q, key_cache, value_cache, metadata, _, _ = paged_batch(seq_lens, num_new, tables, 2, seed=20)
    before = impl.paged_attention(q, key_cache, value_cache, metadata, 0.35)
    for block in (1, 2, 4, 6, 7, 9):  # blocks nobody holds
        key_cache[block], value_cache[block] = 1e3, 1e3
    key_cache[0, 1:], value_cache[0, 1:] = 1e3, 1e3  # slots after sequence 0's last token
    key_cache[5, 3:], value_cache[5, 3:] = 1e3, 1e3  # slot after sequence 1's last token
    after = impl.paged_attention(q, key_cache, value_cache, metadata, 0.35)
    expect_close(after, before, inputs="two decodes (5 and 7 tokens), then every slot they do not hold set to 1000")


# --- generate_paged ---------------------------------------------------------------------------------------------

PROMPTS = [[5, 17, 42, 99, 3], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.mark.exercise("generate_paged")
def test_generate_paged_matches_hugging_face_generate(impl):
    folder = tiny_checkpoint("llama-gqa")
    want = []
    with torch.inference_mode():
        hf = hf_model(folder)
        for prompt in PROMPTS:
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)
            want.append(out[0, len(prompt) :].tolist())
        got = impl.generate_paged(model_named("llama-gqa"), [list(p) for p in PROMPTS], 10, 4)
    expect_equal(got, want, inputs=f"tiny llama-gqa, prompts {PROMPTS}, 10 new tokens each, block_size 4 (greedy)")


@pytest.mark.exercise("generate_paged")
@pytest.mark.parametrize("block_size", [1, 16])
def test_generate_paged_matches_naive_generation(impl, block_size):
    model = model_named("qwen2-bias-mqa")
    prompts = [list(p) for p in PROMPTS]
    with torch.inference_mode():
        want = [naive.generate_naive(model, p, 6) for p in PROMPTS]
        got = impl.generate_paged(model, prompts, 6, block_size)
    inputs = f"tiny qwen2-bias-mqa, prompts {PROMPTS}, 6 new tokens each, block_size {block_size} (greedy)"
    expect_equal(got, want, inputs=inputs)
    expect_equal(prompts, PROMPTS, inputs=f"{inputs}; the prompt lists afterwards (must not change)")


@pytest.mark.exercise("generate_paged")
def test_generate_paged_with_zero_new_tokens(impl):
    got = impl.generate_paged(model_named("llama-gqa"), [[1, 2, 3], [4]], 0)
    expect_equal(got, [[], []], inputs="prompts [[1, 2, 3], [4]], 0 new tokens")


# --- the exercises the scheduler's step runs, against the reference on generated workloads ---------------------------

SCHEDULED = ("FreeKVCacheBlockQueue",)


test_each_exercise_the_scheduler_runs_leaves_the_references_state_on_generated_workloads = differential_test(
    REFERENCE, SCHEDULED, lambda _: scheduler_workloads()
)


# --- capstone ---------------------------------------------------------------------------------------------------

# Three SmolLM2 prompts of 4, 12 and 37 tokens in one static batch, at block_size 4: the first two fill their last
# block exactly, so their first decode token already needs a new block, and every sequence takes 3 more blocks
# during decode.
CAPSTONE_BATCH = [1, 3, 0]  # indices into CAPSTONE_PROMPTS
CAPSTONE_NEW_TOKENS = 12
CAPSTONE_BLOCK_SIZE = 4


@pytest.mark.exercise("capstone")
@pytest.mark.timeout(300)  # a real model: a few seconds on an idle machine, far more on a crowded one
def test_capstone_smollm2_through_all_your_pieces_gives_hugging_faces_tokens(impl):
    """Your queue (inside the block pool), block manager, slot mapping (inside `prepare_inputs`), KV store,
    gather and paged attention (inside the `PagedAttention` backend of every layer), driven by your
    `generate_paged`: the greedy tokens must be those of Hugging Face `generate`."""
    model, _ = smollm2()
    prompts = [list(CAPSTONE_PROMPTS[i]) for i in CAPSTONE_BATCH]
    inputs = (
        f"SmolLM2-135M-Instruct, a static batch of prompts of {[len(p) for p in prompts]} tokens, "
        f"{CAPSTONE_NEW_TOKENS} new tokens each, block_size {CAPSTONE_BLOCK_SIZE}, greedy; "
        "every exercise of the chapter in place of the reference"
    )
    with swap_in(impl, REFERENCE) as mine:
        got = mine.generate_paged(model, prompts, CAPSTONE_NEW_TOKENS, CAPSTONE_BLOCK_SIZE)
    want = [smollm2_greedy(i, CAPSTONE_NEW_TOKENS) for i in CAPSTONE_BATCH]
    expect_equal(got, want, inputs=f"{inputs} (expected: Hugging Face generate's tokens)")

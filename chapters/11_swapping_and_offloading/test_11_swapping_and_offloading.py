"""Grading tests for chapter 11 — swapping and offloading.

Each test grades one exercise (`@pytest.mark.exercise`). The oracles owe nothing to the code under test: block
tables, reference counts and free blocks counted by hand for a group of three samples that share their prompt's
blocks (one of them also held by another request); the K/V contents of every position read back after a real copy
out and in (`swap_blocks` on small tensors); the scheduler's batch, budget and queues worked out by hand for one
decode step; the host tier's hits counted by hand. The capstone holds SmolLM2's greedy tokens, in a preemption
storm that swaps groups and with prefixes found on the host, to Hugging Face's.
"""

import functools

import pytest
import torch

from grading import exercising, expect_equal
from grading.capstone import CAPSTONE_PROMPTS, generate_batch, smollm2, smollm2_greedy, swap_in
from solutions.attention.paged import KVCache
from solutions.core.block_pool import BlockPool
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sched import scheduler as scheduler_module
from solutions.core.sched.output import SchedulerOutput
from solutions.core.sched.scheduler import Scheduler
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.engine.arg_utils import EngineArgs
from solutions.engine.llm_engine import LLMEngine
from solutions.kv_offload import manager as offload_manager
from solutions.kv_offload import swap
from solutions.kv_offload.manager import CPUOffloadingManager, update_state_after_alloc
from solutions.kv_offload.transfer import swap_blocks
from solutions.sampling_params import SamplingParams

REFERENCE = {
    "swap_out": swap.swap_out,
    "swap_in": swap.swap_in,
    "preempt_group": scheduler_module.preempt_group,
    "get_num_new_matched_tokens": offload_manager.get_num_new_matched_tokens,
}
reference_swap_out = swap.swap_out  # taken at load time: inside the capstone's `swap_in` the attribute is yours

pytestmark = pytest.mark.timeout(60)

BLOCK_SIZE = 4
PROMPT = list(range(100, 110))  # 10 tokens: blocks A (positions 0-3), B (4-7), C (8-9)


# --- a group of three samples: seqs 0, 1, 2 of request "r"; seq 9 (request "q") shares the prompt's blocks ---------


def sampled_group(num_device_blocks: int = 12) -> tuple[KVCacheManager, list[Sequence], Sequence]:
    """The prompt computed once, forked into samples 1 and 2 and into seq 9 of another request (a prefix hit, say);
    each sample then wrote its first token at position 10, copying block C on write. Tables: seq 0 [A, B, C0],
    seq 1 [A, B, C1], seq 2 [A, B, C2], seq 9 [A, B, C]: A and B have ref_cnt 4, C and each Ck ref_cnt 1."""
    manager = KVCacheManager(num_device_blocks, BLOCK_SIZE, enable_prefix_caching=False)
    parent = Sequence(0, PROMPT)
    assert manager.allocate_slots(parent, len(PROMPT)) is not None
    parent.num_computed_tokens = len(PROMPT)
    group = [parent, Sequence(1, PROMPT), Sequence(2, PROMPT)]
    other = Sequence(9, PROMPT)
    for seq in (*group[1:], other):
        manager.fork(parent, seq)
        seq.num_computed_tokens = len(PROMPT)
    for seq in group[1:] + group[:1]:
        seq.request_id = "r"
        seq.append_token(200 + seq.seq_id)
        assert manager.allocate_slots(seq, 1) is not None  # copy-on-write of C
        seq.num_computed_tokens += 1
    other.request_id = "q"
    return manager, group, other


def group_text(group: list[Sequence], other: Sequence) -> str:
    tables = ", ".join(f"seq {s.seq_id} {s.block_table}" for s in (*group, other))
    return f"block_size {BLOCK_SIZE}, group = seqs 0, 1, 2 of one request (11 tokens each), tables {tables}"


def run_swap_out(impl, device: KVCacheManager, host: BlockPool, group: list[Sequence], inputs: str):
    with exercising("swap_out", inputs):
        return impl.swap_out(device.block_pool, host, group)


def run_swap_in(impl, host: BlockPool, device: KVCacheManager, group: list[Sequence], inputs: str):
    with exercising("swap_in", inputs):
        return impl.swap_in(host, device.block_pool, group)


def random_cache(num_blocks: int, seed: int) -> KVCache:
    """One layer, one K/V head of dimension 2: every slot holds its own random numbers."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, 1, 2)
    return KVCache([torch.randn(shape, generator=g)], [torch.randn(shape, generator=g)])


def contents(cache: KVCache, seq: Sequence) -> torch.Tensor:
    """The keys and values of `seq`'s computed positions, read through its block table. (positions, 2, 2)"""
    rows = []
    for position in range(seq.num_computed_tokens):
        block, offset = seq.block_table[position // BLOCK_SIZE], position % BLOCK_SIZE
        rows.append(torch.stack([cache.key_caches[0][block, offset, 0], cache.value_caches[0][block, offset, 0]]))
    return torch.stack(rows)


# --- swap_out ---------------------------------------------------------------------------------------------------------


@pytest.mark.exercise("swap_out")
def test_swap_out_copies_each_shared_block_once(impl):
    device, group, other = sampled_group()
    inputs = group_text(group, other)
    before = {s.seq_id: list(s.block_table) for s in group}
    host = BlockPool(8)
    pairs = run_swap_out(impl, device, host, group, inputs)
    a, b = before[0][:2]
    expect_equal(sorted(src for src, _ in pairs), sorted([a, b, before[0][2], before[1][2], before[2][2]]),
                 inputs=f"{inputs}; the device blocks copied out (A and B once each, though three samples hold them)")
    expect_equal(len({dst for _, dst in pairs}), 5, inputs=f"{inputs}; distinct host blocks written")
    expect_equal(host.num_free_blocks, 3, inputs=f"{inputs}; free blocks of an 8-block host pool afterwards")
    host_of = dict(pairs)
    for seq in group:
        expect_equal(seq.block_table, [host_of.get(b) for b in before[seq.seq_id]],
                     inputs=f"{inputs}; seq {seq.seq_id}'s block table afterwards (host ids, as the pairs map them)")


@pytest.mark.exercise("swap_out")
def test_swap_out_gives_a_host_block_one_reference_per_sample(impl):
    device, group, other = sampled_group()
    inputs = group_text(group, other)
    host = BlockPool(8)
    run_swap_out(impl, device, host, group, inputs)
    ref_cnts = [[host.blocks[b].ref_cnt for b in seq.block_table] for seq in group]
    expect_equal(ref_cnts, [[3, 3, 1]] * 3,
                 inputs=f"{inputs}; host ref_cnt of each sample's blocks (A and B held by all three samples)")


@pytest.mark.exercise("swap_out")
def test_swap_out_drops_the_groups_device_references(impl):
    device, group, other = sampled_group()
    inputs = group_text(group, other)
    run_swap_out(impl, device, BlockPool(8), group, inputs)
    expect_equal(device.num_free_blocks, 12 - 3,
                 inputs=f"{inputs}; free device blocks afterwards (only seq 9's A, B and C stay held)")
    expect_equal([device.block_pool.blocks[b].ref_cnt for b in other.block_table], [1, 1, 1],
                 inputs=f"{inputs}; device ref_cnt of seq 9's blocks (the other request keeps its references)")


@pytest.mark.exercise("swap_out")
def test_swap_out_then_in_gives_every_position_its_keys_and_values(impl):
    device, group, other = sampled_group()
    inputs = group_text(group, other) + "; swap out, device blocks reused (zeroed), swap in, contents compared"
    device_cache, host_cache = random_cache(12, 0), random_cache(8, 1)
    want = {seq.seq_id: contents(device_cache, seq) for seq in group}
    host = BlockPool(8)
    swap_blocks(device_cache, host_cache, run_swap_out(impl, device, host, group, inputs))
    for cache in device_cache.key_caches + device_cache.value_caches:
        held = torch.tensor(other.block_table)
        kept = cache[held].clone()
        cache.zero_()
        cache[held] = kept
    swap_blocks(host_cache, device_cache, swap.swap_in(host, device.block_pool, group))  # the reference's swap-in
    for seq in group:
        got = contents(device_cache, seq)
        expect_equal(torch.equal(got, want[seq.seq_id]), True,
                     inputs=f"{inputs}; seq {seq.seq_id}'s K/V at positions 0-10 equal to before the swap")


# --- swap_in ----------------------------------------------------------------------------------------------------------


def swapped_group(num_device_blocks: int = 12) -> tuple[KVCacheManager, BlockPool, list[Sequence], Sequence, str]:
    device, group, other = sampled_group(num_device_blocks)
    inputs = group_text(group, other)
    host = BlockPool(8)
    reference_swap_out(device.block_pool, host, group)
    inputs += f"; swapped out (the reference): host tables {[s.block_table for s in group]}"
    return device, host, group, other, inputs


@pytest.mark.exercise("swap_in")
def test_swap_in_keeps_the_sharing(impl):
    device, host, group, other, inputs = swapped_group()
    pairs = run_swap_in(impl, host, device, group, inputs)
    expect_equal(len(pairs), 5, inputs=f"{inputs}; blocks copied in (A and B once each)")
    expect_equal(len({dst for _, dst in pairs}), 5, inputs=f"{inputs}; distinct device blocks written")
    expect_equal(device.num_free_blocks, 12 - 3 - 5, inputs=f"{inputs}; free device blocks afterwards")
    tables = [s.block_table for s in group]
    expect_equal([t[:2] for t in tables[1:]], [tables[0][:2]] * 2,
                 inputs=f"{inputs}; blocks 0-1 of samples 1 and 2 (the same device blocks as sample 0's)")
    expect_equal(len({t[2] for t in tables}), 3, inputs=f"{inputs}; distinct last blocks of the three samples")
    expect_equal([[device.block_pool.blocks[b].ref_cnt for b in t] for t in tables], [[3, 3, 1]] * 3,
                 inputs=f"{inputs}; device ref_cnt of each sample's blocks")
    expect_equal(set(sum(tables, [])) & set(other.block_table), set(),
                 inputs=f"{inputs}; blocks shared with seq 9's (fresh device blocks only)")


@pytest.mark.exercise("swap_in")
def test_swap_in_maps_each_host_block_to_the_table_entries_that_held_it(impl):
    device, host, group, other, inputs = swapped_group()
    host_tables = {s.seq_id: list(s.block_table) for s in group}
    device_of = dict(run_swap_in(impl, host, device, group, inputs))
    for seq in group:
        expect_equal(seq.block_table, [device_of.get(b) for b in host_tables[seq.seq_id]],
                     inputs=f"{inputs}; seq {seq.seq_id}'s block table afterwards (device ids, as the pairs map them)")


@pytest.mark.exercise("swap_in")
def test_swap_in_frees_the_host_blocks(impl):
    device, host, group, other, inputs = swapped_group()
    run_swap_in(impl, host, device, group, inputs)
    expect_equal(host.num_free_blocks, 8, inputs=f"{inputs}; free blocks of the 8-block host pool afterwards")
    expect_equal([b.ref_cnt for b in host.blocks], [0] * 8, inputs=f"{inputs}; host ref_cnts afterwards")


@pytest.mark.exercise("swap_in")
def test_swap_in_brings_back_every_position_its_keys_and_values(impl):
    device, group, other = sampled_group()
    inputs = group_text(group, other) + "; swap out (the reference), device zeroed but for seq 9, swap in"
    device_cache, host_cache = random_cache(12, 2), random_cache(8, 3)
    want = {seq.seq_id: contents(device_cache, seq) for seq in group}
    host = BlockPool(8)
    swap_blocks(device_cache, host_cache, reference_swap_out(device.block_pool, host, group))
    for cache in device_cache.key_caches + device_cache.value_caches:
        held = torch.tensor(other.block_table)
        kept = cache[held].clone()
        cache.zero_()
        cache[held] = kept
    swap_blocks(host_cache, device_cache, run_swap_in(impl, host, device, group, inputs))
    for seq in group:
        expect_equal(torch.equal(contents(device_cache, seq), want[seq.seq_id]), True,
                     inputs=f"{inputs}; seq {seq.seq_id}'s K/V at positions 0-10 equal to before the swap")


# --- preempt_group ----------------------------------------------------------------------------------------------------


def decode_step(num_device_blocks: int = 16, num_host_blocks: int = 8, prompt_len: int = 10, scheduled: int = 2):
    """One decode step being scheduled: seq 5 (request "q", 5 tokens) is in the batch, then the first `scheduled`
    samples of request "r" (`sampled_group` with a prompt of `prompt_len`); running order 5, 0, 1, 2.
    Returns (scheduler, out, copies, group, seq 5, inputs)."""
    manager = KVCacheManager(num_device_blocks, BLOCK_SIZE, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=64,
                          swap_pool=BlockPool(num_host_blocks))
    first = Sequence(5, [1, 2, 3, 4])
    first.request_id = "q"
    assert manager.allocate_slots(first, 4) is not None
    first.num_computed_tokens = 4
    first.append_token(7)
    parent = Sequence(0, PROMPT[:prompt_len])
    assert manager.allocate_slots(parent, prompt_len) is not None
    parent.num_computed_tokens = prompt_len
    group = [parent, Sequence(1, PROMPT[:prompt_len]), Sequence(2, PROMPT[:prompt_len])]
    for seq in group[1:]:
        manager.fork(parent, seq)
        seq.num_computed_tokens = prompt_len
    for seq in group:
        seq.request_id = "r"
        seq.append_token(200 + seq.seq_id)
    for seq in (first, *group):
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)
    out, copies = SchedulerOutput(num_computed_tokens=[]), {}
    for seq in (first, *group[:scheduled]):
        seq_copies = manager.allocate_slots(seq, 1)
        assert seq_copies is not None
        scheduler._add_to_batch(out, seq, 1, seq_copies, copies)
    inputs = (f"block_size {BLOCK_SIZE}, {num_device_blocks} device blocks, {num_host_blocks} host blocks; a decode "
              f"step: seq 5 (another request) then samples {list(range(scheduled))} of request r (prompt of "
              f"{prompt_len} tokens, samples 0, 1, 2 of {prompt_len + 1} tokens) in the batch; tables "
              f"{[s.block_table for s in group]}, copies {copies}; preempt_group(victim = seq 2)")
    return scheduler, out, copies, group, first, inputs


def run_preempt(impl, scheduler, victim, out, copies, inputs) -> int:
    with exercising("preempt_group", inputs):
        return impl.preempt_group(scheduler, victim, out, copies)


@pytest.mark.exercise("preempt_group")
def test_preempt_group_swaps_the_whole_group_out_of_the_batch(impl):
    scheduler, out, copies, group, first, inputs = decode_step()
    returned = run_preempt(impl, scheduler, group[2], out, copies, inputs)
    expect_equal(returned, 2, inputs=f"{inputs}; the budget handed back (samples 0 and 1 had 1 token each)")
    expect_equal([s.seq_id for s in out.scheduled_seqs], [5], inputs=f"{inputs}; the batch afterwards")
    expect_equal(out.num_scheduled_tokens, [1], inputs=f"{inputs}; num_scheduled_tokens afterwards")
    expect_equal(sorted(copies), [5], inputs=f"{inputs}; copies: the sequences whose copy-on-write is kept")
    expect_equal([s.seq_id for s in scheduler.running], [5], inputs=f"{inputs}; running afterwards")
    expect_equal([[s.seq_id for s in g] for g in scheduler.swapped], [[0, 1, 2]], inputs=f"{inputs}; swapped")
    expect_equal([s.status for s in group], [SequenceStatus.SWAPPED] * 3, inputs=f"{inputs}; the samples' status")
    expect_equal(sorted(out.swapped_out_seq_ids), [0, 1, 2], inputs=f"{inputs}; out.swapped_out_seq_ids")
    expect_equal(len(scheduler.waiting), 0, inputs=f"{inputs}; waiting afterwards (nobody recomputes)")


@pytest.mark.exercise("preempt_group")
def test_preempt_group_swaps_out_what_a_dropped_copy_would_have_copied(impl):
    scheduler, out, copies, group, first, inputs = decode_step()
    shared = {src for seq_copies in copies.values() for src, _ in seq_copies}  # block C, which 0 and 1 copied
    run_preempt(impl, scheduler, group[2], out, copies, inputs)
    host_last = {seq.block_table[2] for seq in group}  # each sample's own last block, on the host
    reads = sorted(src for src, dst in out.blocks_to_swap_out if dst in host_last)
    expect_equal(reads, sorted(shared) * 3,
                 inputs=f"{inputs}; the device blocks the swap-out reads for the samples' last blocks (the copies "
                 "into samples 0 and 1's fresh blocks never run: their contents are still in the shared block)")
    expect_equal(scheduler.kv_cache_manager.num_free_blocks, 16 - 2,
                 inputs=f"{inputs}; free device blocks afterwards (seq 5 holds 2)")


@pytest.mark.exercise("preempt_group")
def test_preempt_group_frees_blocks_allocated_for_tokens_that_will_not_run(impl):
    # A prompt of 8 tokens: each scheduled sample's token at position 8 took a fresh block, never computed.
    scheduler, out, copies, group, first, inputs = decode_step(prompt_len=8)
    run_preempt(impl, scheduler, group[2], out, copies, inputs)
    expect_equal(len(out.blocks_to_swap_out), 2, inputs=f"{inputs}; blocks swapped out (the prompt's two)")
    expect_equal([len(s.block_table) for s in group], [2, 2, 2], inputs=f"{inputs}; the samples' table lengths")
    expect_equal(scheduler.kv_cache_manager.num_free_blocks, 16 - 2,
                 inputs=f"{inputs}; free device blocks afterwards (seq 5 holds 2)")


@pytest.mark.exercise("preempt_group")
def test_preempt_group_recomputes_the_victim_alone_when_the_host_is_full(impl):
    # The group holds 5 distinct blocks: A, B, C (sample 2's) and the copies C0, C1 of samples 0 and 1.
    scheduler, out, copies, group, first, inputs = decode_step(num_host_blocks=4)
    returned = run_preempt(impl, scheduler, group[2], out, copies, inputs)
    expect_equal(returned, 0, inputs=f"{inputs}; the budget handed back (the victim was not in the batch)")
    expect_equal(group[2].status, SequenceStatus.PREEMPTED, inputs=f"{inputs}; the victim's status")
    expect_equal([s.seq_id for s in scheduler.waiting], [2], inputs=f"{inputs}; waiting afterwards")
    expect_equal([s.seq_id for s in scheduler.running], [5, 0, 1], inputs=f"{inputs}; running afterwards")
    expect_equal([s.seq_id for s in out.scheduled_seqs], [5, 0, 1], inputs=f"{inputs}; the batch afterwards")
    expect_equal(scheduler.swapped, [], inputs=f"{inputs}; swapped afterwards")
    expect_equal(scheduler.swap_pool.num_free_blocks, 4, inputs=f"{inputs}; free host blocks afterwards")


@pytest.mark.exercise("preempt_group")
def test_preempt_group_recomputes_a_victim_in_the_batch_and_hands_its_budget_back(impl):
    scheduler, out, copies, group, first, inputs = decode_step(num_host_blocks=2, scheduled=3)
    inputs += "; samples 0, 1, 2 all in the batch"
    returned = run_preempt(impl, scheduler, group[2], out, copies, inputs)
    expect_equal(returned, 1, inputs=f"{inputs}; the budget handed back (the victim's 1 token)")
    expect_equal([s.seq_id for s in out.scheduled_seqs], [5, 0, 1], inputs=f"{inputs}; the batch afterwards")
    expect_equal([s.seq_id for s in scheduler.waiting], [2], inputs=f"{inputs}; waiting afterwards")


@pytest.mark.exercise("preempt_group")
def test_preempt_group_recomputes_a_group_that_could_never_come_back(impl):
    # 7 device blocks, all in use: seq 5 holds 2, the group 5 (A, B, C and the copies C0, C1). Coming back needs the
    # group's 5 blocks and one more per sample: 8 > 7.
    scheduler, out, copies, group, first, inputs = decode_step(num_device_blocks=7)
    returned = run_preempt(impl, scheduler, group[2], out, copies, inputs)
    expect_equal((returned, group[2].status), (0, SequenceStatus.PREEMPTED),
                 inputs=f"{inputs}; (budget handed back, the victim's status): the group's 5 blocks and one per "
                 "sample exceed the 7-block device pool, so swapping it out could never end")
    expect_equal(scheduler.swapped, [], inputs=f"{inputs}; swapped afterwards")


# --- get_num_new_matched_tokens ---------------------------------------------------------------------------------------

HASHES = [bytes([i]) * 8 for i in range(6)]  # stand-ins for the chained hashes of a prompt's blocks 0-5


def host_holding(blocks: list[int], num_host_blocks: int = 4) -> CPUOffloadingManager:
    """A host tier that stored the prompt's `blocks` (evicted from the device in an earlier step)."""
    offloading = CPUOffloadingManager(num_host_blocks)
    for i in blocks:
        offloading.prepare_store(device_block_id=i, block_hash=HASHES[i])
    offloading.take_transfers()
    offloading.complete_transfers()
    offloading.stats.queries = offloading.stats.hits = 0
    return offloading


def matched(impl, offloading, num_tokens: int, num_computed: int, host_blocks: list[int]) -> tuple[int, str]:
    inputs = (f"block_size {BLOCK_SIZE}, a prompt of {num_tokens} tokens, the device's prefix hits cover "
              f"{num_computed} tokens, the host holds blocks {host_blocks}")
    with exercising("get_num_new_matched_tokens", inputs):
        got = impl.get_num_new_matched_tokens(offloading, HASHES[: num_tokens // BLOCK_SIZE], num_tokens,
                                              num_computed, BLOCK_SIZE)
    return got, inputs


@pytest.mark.exercise("get_num_new_matched_tokens")
def test_lookup_counts_the_host_run_after_the_devices_hits(impl):
    offloading = host_holding([1, 2])
    got, inputs = matched(impl, offloading, 17, 4, [1, 2])
    expect_equal(got, 8, inputs=f"{inputs}; tokens found on the host (blocks 1 and 2)")
    offloading = host_holding([0, 1, 2])
    got, inputs = matched(impl, offloading, 17, 8, [0, 1, 2])
    expect_equal(got, 4, inputs=f"{inputs}; tokens found on the host (block 2; blocks 0-1 are the device's)")


@pytest.mark.exercise("get_num_new_matched_tokens")
def test_lookup_stops_at_the_first_host_miss(impl):
    offloading = host_holding([0, 2, 3])
    got, inputs = matched(impl, offloading, 17, 0, [0, 2, 3])
    expect_equal(got, 4, inputs=f"{inputs}; tokens found on the host (block 0; block 1 is missing, so 2-3 follow "
                 "a hole and cannot be used)")
    got, inputs = matched(impl, host_holding([1, 2]), 17, 0, [1, 2])
    expect_equal(got, 0, inputs=f"{inputs}; tokens found on the host (block 0 is missing)")


@pytest.mark.exercise("get_num_new_matched_tokens")
def test_lookup_never_covers_the_last_token(impl):
    offloading = host_holding([0, 1, 2, 3])
    got, inputs = matched(impl, offloading, 16, 0, [0, 1, 2, 3])
    expect_equal(got, 12, inputs=f"{inputs}; tokens found on the host (block 3 holds the last token, which the "
                 "forward pass must compute to sample from)")
    got, inputs = matched(impl, host_holding([0, 1, 2, 3]), 17, 0, [0, 1, 2, 3])
    expect_equal(got, 16, inputs=f"{inputs}; tokens found on the host (the last token, 16, starts block 4)")


@pytest.mark.exercise("get_num_new_matched_tokens")
def test_lookup_holds_its_hits_until_they_are_loaded(impl):
    offloading = host_holding([0, 1, 2, 3])  # full: a store evicts the least recently used unheld block
    got, inputs = matched(impl, offloading, 13, 0, [0, 1, 2, 3])
    expect_equal(got, 12, inputs=f"{inputs}; tokens found on the host")
    for i in range(3):
        expect_equal(offloading.host_pool.get_cached_block(HASHES[i]).ref_cnt, 1,
                     inputs=f"{inputs}; ref_cnt of the host block of prompt block {i} (held until loaded)")
    offloading.prepare_store(device_block_id=9, block_hash=b"new block")  # an eviction later in the same step
    offloading.prepare_store(device_block_id=8, block_hash=b"another")
    update_state_after_alloc(offloading, HASHES, [4, 5, 6, 7], 0, 12, BLOCK_SIZE)  # the scheduler's load
    _, loads = offloading.take_transfers()
    hosts = [offloading.host_pool.get_cached_block(HASHES[i]) for i in range(3)]
    expect_equal(loads, [(h.block_id, d) for h, d in zip(hosts, [4, 5, 6], strict=True)],
                 inputs=f"{inputs}; then two device evictions stored in the same step; the loads (host, device)")


@pytest.mark.exercise("get_num_new_matched_tokens")
def test_lookup_counts_queries_and_hits_in_tokens(impl):
    offloading = host_holding([1])
    got, inputs = matched(impl, offloading, 14, 4, [1])
    expect_equal((offloading.stats.queries, offloading.stats.hits), (10, 4),
                 inputs=f"{inputs}; (stats.queries, stats.hits): the 10 tokens past the device's hits, 4 found")


# --- capstone: your swaps, your scheduler's choice and your lookup in the engine, on SmolLM2 --------------------------

CAPSTONE_BLOCK_SIZE = 8
CAPSTONE_IDS = [0, 3, 4, 6]  # chat prompts 0, 4, 6 share the template's system prompt
CAPSTONE_N = {0: 2, 4: 2}  # requests with two samples each (greedy: both give Hugging Face's tokens)
CAPSTONE_TOKENS = 16
CAPSTONE_KV_BLOCKS = 16  # too few for the batch: a preemption storm
OFFLOAD_FIRST, OFFLOAD_BETWEEN = [0, 2], [3, 4]  # run, evicted by other prompts, run again: prefixes on the host
OFFLOAD_KV_BLOCKS, OFFLOAD_TOKENS = 12, 8  # OFFLOAD_FIRST fills the device pool


def host_gib(num_blocks: int) -> float:
    """GiB of host memory for `num_blocks` of SmolLM2's blocks (what `swap_space` and `kv_offloading_size` take)."""
    return num_blocks * KVCache.bytes_per_block(smollm2()[0].config, CAPSTONE_BLOCK_SIZE) / 2**30


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


def capstone_swap_run() -> tuple[list[list[list[int]]], int, int, int]:
    """The CAPSTONE_IDS prompts in one batch on a fresh engine that swaps: (tokens per request per sample, groups
    swapped out, device blocks in use at the end, host blocks in use at the end)."""
    engine = LLMEngine.from_engine_args(EngineArgs(
        model="smollm2-135m", block_size=CAPSTONE_BLOCK_SIZE, max_num_seqs=8, max_model_len=256,
        num_kv_blocks=CAPSTONE_KV_BLOCKS, preemption_mode="swap", swap_space=host_gib(64),
    ))
    requests = [(CAPSTONE_PROMPTS[i], greedy(CAPSTONE_TOKENS, CAPSTONE_N.get(i, 1))) for i in CAPSTONE_IDS]
    outputs = generate_batch(engine, requests)
    scheduler = engine.engine_core.engine_core.scheduler
    tokens = [[sample.token_ids for sample in output.outputs] for output in outputs]
    host = scheduler.swap_pool
    return tokens, engine.stats.num_swapped_out, scheduler.kv_cache_manager.num_used_blocks, \
        len(host.blocks) - host.num_free_blocks


def capstone_offload_run() -> tuple[list[list[int]], int]:
    """OFFLOAD_FIRST, then OFFLOAD_BETWEEN, then OFFLOAD_FIRST again on an engine whose small device pool evicts
    the first prompts' blocks to a host tier: (the tokens of the last batch, tokens the host tier supplied)."""
    engine = LLMEngine.from_engine_args(EngineArgs(
        model="smollm2-135m", block_size=CAPSTONE_BLOCK_SIZE, max_num_seqs=8, max_model_len=256,
        num_kv_blocks=OFFLOAD_KV_BLOCKS, kv_offloading_size=host_gib(64),
    ))
    for ids in (OFFLOAD_FIRST, OFFLOAD_BETWEEN):
        generate_batch(engine, [(CAPSTONE_PROMPTS[i], greedy(OFFLOAD_TOKENS)) for i in ids])
    outputs = generate_batch(engine, [(CAPSTONE_PROMPTS[i], greedy(OFFLOAD_TOKENS)) for i in OFFLOAD_FIRST])
    return [output.outputs[0].token_ids for output in outputs], engine.stats.external_prefix_cache_hits


@functools.cache
def reference_offload_hits() -> int:
    """The host tier's hits in `capstone_offload_run` on the reference pieces, once per process."""
    return capstone_offload_run()[1]


@pytest.mark.exercise("capstone")
@pytest.mark.timeout(300)  # a real model, three engines: seconds on an idle 2-core machine
def test_capstone_swapping_and_the_host_tier_on_smollm2_give_hugging_faces_tokens(impl):
    want_hits = reference_offload_hits()  # nothing is swapped in yet
    inputs = (f"SmolLM2-135M, block_size {CAPSTONE_BLOCK_SIZE}, {CAPSTONE_KV_BLOCKS} device blocks, "
              f"preemption_mode='swap' with 64 host blocks; CAPSTONE_PROMPTS{CAPSTONE_IDS} in one batch "
              f"(n = 2 for prompts {sorted(CAPSTONE_N)}), greedy, {CAPSTONE_TOKENS} tokens each")
    with swap_in(impl, REFERENCE):  # your swaps and choice in the scheduler, your lookup at admission
        tokens, swapped_out, device_used, host_used = capstone_swap_run()
        offload_tokens, hits = capstone_offload_run()
    for request, i in zip(tokens, CAPSTONE_IDS, strict=True):
        expect_equal(request, [smollm2_greedy(i, CAPSTONE_TOKENS)] * CAPSTONE_N.get(i, 1),
                     inputs=f"{inputs}; the greedy tokens of prompt {i}'s samples (oracle: Hugging Face greedy)")
    assert swapped_out > 0, f"{inputs}: no sequence was swapped out; the storm should swap groups"
    expect_equal((device_used, host_used), (0, 0),
                 inputs=f"{inputs}; (device, host) blocks in use after every request finished")
    inputs = (f"SmolLM2-135M, {OFFLOAD_KV_BLOCKS} device blocks and a 64-block host tier; prompts {OFFLOAD_FIRST}, "
              f"then {OFFLOAD_BETWEEN}, then {OFFLOAD_FIRST} again (their prefixes evicted to the host), "
              f"{OFFLOAD_TOKENS} greedy tokens each")
    for output, i in zip(offload_tokens, OFFLOAD_FIRST, strict=True):
        expect_equal(output, smollm2_greedy(i, OFFLOAD_TOKENS),
                     inputs=f"{inputs}; the last run's greedy tokens of prompt {i} (oracle: Hugging Face greedy)")
    expect_equal(hits, want_hits, inputs=f"{inputs}; tokens the host tier supplied (oracle: the reference engine)")
    assert hits > 0, f"{inputs}: the host tier supplied nothing"

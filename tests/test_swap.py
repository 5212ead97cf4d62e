"""Chapter 11: preemption by swapping gives the tokens of recomputation, of no memory pressure and of Hugging Face.

Oracles: the same engine with `preemption_mode="recompute"` and with a pool large enough never to preempt, and
Hugging Face `generate` (greedy, EOS disabled) on the same tiny checkpoint. Below the engine: `swap_out` / `swap_in`
on two real `BlockPool`s (one pair per distinct block, the sharing structure kept), `swap_blocks` on two real
`KVCache`s, and the scheduler's rules, read from the `SchedulerOutput` of every step of a real engine: nothing new
is admitted while a group is out, no swap-in in a step that preempted, a full host pool falls back to
recomputation, and a group too large to come back is recomputed rather than left out for ever. A storm of random
requests and aborts (some while swapped out) leaves no block held on the device, in the swap pool or in the host
tier. Every engine loop here is bounded: a livelock fails the test, it never hangs.
"""

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from grading.parity import assert_greedy_close, hf_greedy, hf_oracle
from grading.tiny_models import tiny_checkpoint
from solutions import LLM, SamplingParams
from solutions.attention.paged import KVCache
from solutions.core.block_pool import BlockPool
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sched.output import SchedulerOutput
from solutions.core.sched.swapping_scheduler import SwappingScheduler
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.kv_offload.swap import num_group_blocks, swap_in, swap_out
from solutions.kv_offload.transfer import KVTransfer, swap_blocks
from solutions.model.config import ModelConfig as HFConfig
from solutions.sampling_params import RequestOutputKind

BLOCK_SIZE = 4
NEW_TOKENS = 40
# 40 blocks of 4 tokens for 8 sequences of up to ~70 tokens: preemption after a few decode steps
PRESSURE = dict(block_size=BLOCK_SIZE, num_kv_blocks=40, max_num_seqs=8, max_model_len=128)
NO_PRESSURE = dict(PRESSURE, num_kv_blocks=400)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def host_gib(model: str, num_blocks: int, block_size: int = BLOCK_SIZE) -> float:
    """GiB of host memory that hold exactly `num_blocks` KV blocks of tiny model `model` (float32)."""
    hf_config = HFConfig.from_folder(tiny_checkpoint(model))
    return num_blocks * KVCache.bytes_per_block(hf_config, block_size) / 2**30


def random_prompts(count: int, low: int, high: int, seed: int, head: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(head or []) + [rng.randrange(3, 256) for _ in range(rng.randint(low, high))] for _ in range(count)]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, limit: int = 3000) -> list[list[list[int]]]:
    """Each prompt's samples' tokens, stepping the engine at most `limit` times (a livelock fails, never hangs)."""
    engine = llm.llm_engine
    params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    final: dict[str, list[list[int]]] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                final[output.request_id] = [c.token_ids for c in sorted(output.outputs, key=lambda c: c.index)]
    else:
        raise AssertionError(f"the engine did not finish {len(prompts)} requests in {limit} steps")
    return [final[f"p{i}"] for i in range(len(prompts))]


def core(llm: LLM):
    return llm.llm_engine.engine_core


def record_outputs(llm: LLM) -> list:
    """Every `SchedulerOutput` the engine's scheduler makes from now on, with the host block tables of the
    sequences it swapped out (read right after scheduling, before anything changes them)."""
    scheduler, recorded = core(llm).scheduler, []
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        seqs = {s.seq_id: s for samples in scheduler.requests.values() for s in samples}
        tables = [list(seqs[seq_id].block_table) for seq_id in out.swapped_out_seq_ids]
        recorded.append((out, tables))
        return out

    scheduler.schedule = recording_schedule
    return recorded


def assert_no_block_held(llm: LLM) -> None:
    scheduler = core(llm).scheduler
    manager = scheduler.kv_cache_manager
    assert manager.num_used_blocks == 0, "device blocks leaked"
    assert not scheduler.swapped and not scheduler.running and not scheduler.waiting
    if (swap_pool := scheduler.kv_cache_manager.swap_pool) is not None:
        assert swap_pool.num_free_blocks == swap_pool.num_blocks, "swap-pool blocks leaked"
    if manager.offloading is not None:
        assert all(block.ref_cnt == 0 for block in manager.offloading.host_pool.blocks), "host-tier blocks held"


# --- 1. the same tokens, swapped or not ----------------------------------------------------------------------------


def workload(name: str) -> tuple[list[list[int]], SamplingParams, dict]:
    """(prompts, params, engine options) of one kind of traffic under memory pressure."""
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    if name == "plain":
        return random_prompts(8, 4, 20, seed=1), greedy, dict(enable_prefix_caching=False)
    if name == "n3-greedy":
        return random_prompts(3, 8, 20, seed=2), SamplingParams(n=3, temperature=0.0, max_tokens=NEW_TOKENS,
                                                                ignore_eos=True), {}
    if name == "n3-seeded":
        return random_prompts(3, 8, 20, seed=3), SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=NEW_TOKENS,
                                                                ignore_eos=True), {}
    if name == "prefix":
        head = random_prompts(1, 16, 16, seed=4)[0]
        return random_prompts(8, 2, 10, seed=5, head=head), greedy, dict(enable_prefix_caching=True)
    if name == "chunked":
        return random_prompts(8, 10, 30, seed=6), greedy, dict(max_num_batched_tokens=8)
    if name == "ngram":  # repetitive prompts: the n-gram proposer finds drafts
        return [p * 3 for p in random_prompts(8, 2, 6, seed=8)], greedy, dict(speculative_config=NGRAM)
    raise ValueError(name)


@pytest.mark.parametrize("name", ["plain", "n3-greedy", "n3-seeded", "prefix", "chunked", "ngram"])
@pytest.mark.parametrize("model", ["llama-gqa", "qwen2-bias-mqa"])
def test_swapping_gives_the_tokens_of_recomputation_of_no_pressure_and_of_hugging_face(model, name):
    prompts, params, options = workload(name)
    folder = str(tiny_checkpoint(model))
    swapping = LLM(folder, **PRESSURE, **options, preemption_mode="swap", swap_space=host_gib(model, 200))
    recorded = record_outputs(swapping)
    swapped = run(swapping, prompts, params)
    recomputing = LLM(folder, **PRESSURE, **options)
    recomputed = run(recomputing, prompts, params)
    free = LLM(folder, **NO_PRESSURE, **options)
    unpressed = run(free, prompts, params)

    stats = swapping.llm_engine.stats
    assert stats.num_swapped_out > 0, "the tight pool should have swapped groups out"
    assert stats.num_blocks_swapped_in == stats.num_blocks_swapped_out > 0, "every block swapped out came back"
    assert recomputing.llm_engine.stats.num_preemptions > 0 and free.llm_engine.stats.num_preemptions == 0
    for out, tables in recorded:  # each block the step swapped out was copied once, however many samples held it
        assert len(out.blocks_to_swap_out) == len({host for table in tables for host in table})
    if "speculative_config" in options:
        assert stats.num_accepted_tokens > 0, "the n-gram proposer's drafts should be verified and some accepted"
    if params.n > 1:  # a group of samples sharing their prompt's blocks went out together
        assert any(len(out.blocks_to_swap_out) < sum(map(len, tables)) for out, tables in recorded)
    assert_no_block_held(swapping)

    if params.temperature != 0.0:  # seeded samples: one generator per sample, whatever the batch
        assert swapped == recomputed == unpressed
        return
    # greedy: equal, or a first divergence at a float near-tie (batches differ between the three runs)
    for prompt, *runs in zip(prompts, swapped, recomputed, unpressed, strict=True):
        theirs = hf_greedy(folder, tuple(prompt), NEW_TOKENS)
        for samples in runs:
            for ours in samples:
                assert_greedy_close(ours, theirs, prompt, hf_oracle(folder))


# --- 2. swap_out / swap_in on block pools, swap_blocks on caches -------------------------------------------------


def forked_group(manager: KVCacheManager) -> list[Sequence]:
    """A parent of 10 computed tokens (blocks: 2 full and 1 partial) and two forks; the first fork has decoded one
    token, so copy-on-write gave it its own last block. Distinct blocks: 3 shared or half shared, and 1 own."""
    parent = Sequence(0, list(range(10)))
    assert manager.allocate_slots(parent, 10) is not None
    parent.num_computed_tokens = 10
    children = [parent.fork(1), parent.fork(2)]
    for child in children:
        manager.fork(parent, child)
    children[0].append_token(99)
    assert len(manager.allocate_slots(children[0], 1)) == 1, "copy-on-write of the shared last block"
    children[0].num_computed_tokens += 1
    return [parent, *children]


def sharing(tables: list[list[int]]) -> list[list[int]]:
    """The structure of block tables, without the ids: each block named by its first appearance."""
    names: dict[int, int] = {}
    return [[names.setdefault(block_id, len(names)) for block_id in table] for table in tables]


def test_swap_out_copies_each_distinct_block_once_and_swap_in_restores_the_sharing():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    device, host = manager.block_pool, BlockPool(8)
    group = forked_group(manager)
    device_tables = [list(seq.block_table) for seq in group]
    assert num_group_blocks(group) == 4 and device.num_free_blocks == 12

    pairs = swap_out(device, host, group)
    assert sorted(src for src, _ in pairs) == sorted({b for table in device_tables for b in table}), "one per block"
    assert len({dst for _, dst in pairs}) == 4 and host.num_free_blocks == 4 and device.num_free_blocks == 16
    host_of = dict(pairs)
    assert [seq.block_table for seq in group] == [[host_of[b] for b in table] for table in device_tables]
    assert [host.blocks[host_of[b]].ref_cnt for b in device_tables[0]] == [3, 3, 2]  # the first fork copied block 2
    assert host.blocks[host_of[device_tables[1][2]]].ref_cnt == 1
    assert all(block.ref_cnt == 0 for block in device.blocks), "the group's device references are dropped"

    back = swap_in(host, device, group)
    assert sorted(src for src, _ in back) == sorted(host_of.values()) and len({dst for _, dst in back}) == 4
    assert host.num_free_blocks == 8 and device.num_free_blocks == 12
    assert sharing([seq.block_table for seq in group]) == sharing(device_tables)
    ref_cnts = [device.blocks[b].ref_cnt for b in group[0].block_table]
    assert ref_cnts == [3, 3, 2] and device.blocks[group[1].block_table[2]].ref_cnt == 1


def test_a_swapped_out_sequences_blocks_join_the_free_queue_last_block_first_and_stay_prefix_hits():
    """Seen through the prefix cache: the freed blocks keep their hashes (a same-prefix prompt finds them all on the
    device), and the last block is the first to be evicted, so the prefix's first blocks survive longest."""
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    seq = Sequence(0, list(range(12)))  # three full blocks, registered as they are computed
    assert manager.allocate_slots(seq, 12) is not None
    seq.num_computed_tokens = 12
    table = list(seq.block_table)
    swap_out(manager.block_pool, BlockPool(4), [seq])
    assert [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()[-3:]] == table[::-1]
    newcomer = Sequence(1, list(range(12)) + [50])
    assert manager.get_computed_blocks(newcomer)[1] == 12, "all three blocks are prefix hits on the device"
    manager.block_pool.get_new_blocks(5 + 1)  # the 5 never-used blocks, then the first freed: the old last block
    assert manager.get_computed_blocks(newcomer)[1] == 8, "the first two blocks are still cached"


def test_preempting_a_group_by_recompute_queues_all_of_it_first_in_running_order():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    manager.enable_swapping(2)
    scheduler = SwappingScheduler(manager, max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=64)
    group = forked_group(manager)
    waiting = Sequence(9, [1, 2, 3])
    scheduler.add_seq(waiting)
    for seq in group:
        scheduler.add_running(seq)
    out = SchedulerOutput(num_computed_tokens=[])
    assert scheduler._preempt_by_recompute(group, out, {}) == 0
    assert [s.seq_id for s in scheduler.waiting] == [0, 1, 2, 9] and scheduler.running == []
    assert all(s.status is SequenceStatus.PREEMPTED and s.num_computed_tokens == 0 for s in group)
    assert manager.num_free_blocks == 16 and sorted(out.preempted_seq_ids) == [0, 1, 2]


def test_swap_blocks_copies_the_pairs_in_every_layer_and_nothing_else():
    shape = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=4)
    src, dst = KVCache.allocate(shape, 6, BLOCK_SIZE), KVCache.allocate(shape, 5, BLOCK_SIZE)
    torch.manual_seed(0)
    for cache in src.key_caches + src.value_caches + dst.key_caches + dst.value_caches:
        cache.copy_(torch.randn_like(cache))
    before = [cache.clone() for cache in dst.key_caches + dst.value_caches]
    pairs = [(0, 3), (5, 1), (2, 0)]
    swap_blocks(src, dst, pairs)
    for source, target, old in zip(src.key_caches + src.value_caches, dst.key_caches + dst.value_caches, before,
                                   strict=True):
        for s, d in pairs:
            assert torch.equal(target[d], source[s])
        for untouched in (2, 4):
            assert torch.equal(target[untouched], old[untouched])


def random_caches(num_src_blocks: int, num_dst_blocks: int, seed: int = 0) -> tuple[KVCache, KVCache]:
    shape = SimpleNamespace(num_hidden_layers=3, num_key_value_heads=2, head_dim=4)
    src, dst = KVCache.allocate(shape, num_src_blocks, BLOCK_SIZE), KVCache.allocate(shape, num_dst_blocks, BLOCK_SIZE)
    generator = torch.Generator().manual_seed(seed)
    for cache in src.key_caches + src.value_caches + dst.key_caches + dst.value_caches:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    return src, dst


def copy_per_block(src: KVCache, dst: KVCache, pairs: list[tuple[int, int]]) -> None:
    """The oracle: one block at a time, every cache tensor."""
    for source, target in zip(src.key_caches + src.value_caches, dst.key_caches + dst.value_caches, strict=True):
        for s, d in pairs:
            target[d] = source[s]


def copies_like_the_oracle(copy, pairs: list[tuple[int, int]], num_dst_blocks: int = 5) -> bool:
    src, dst = random_caches(6, num_dst_blocks)
    expected = KVCache([c.clone() for c in dst.key_caches], [c.clone() for c in dst.value_caches])
    copy_per_block(src, expected, pairs)
    copy(src, dst, pairs)
    return all(torch.equal(got, want) for got, want in zip(dst.key_caches + dst.value_caches,
                                                          expected.key_caches + expected.value_caches, strict=True))


@pytest.mark.parametrize("pairs", [
    [],
    [(3, 0)],
    [(0, 3), (5, 1), (2, 0)],
    [(4, 0), (4, 2), (1, 1), (4, 4)],  # one source block read three times (a block shared by a group's samples)
    [(5, 4), (4, 3), (3, 2), (2, 1), (1, 0)],  # every destination, sources in reverse
])
def test_swap_blocks_makes_the_copies_one_block_at_a_time_would(pairs):
    assert copies_like_the_oracle(swap_blocks, pairs)


def test_a_batched_copy_that_pairs_the_wrong_blocks_is_caught():
    """Mutants of the batched copy: its gather in sorted order (the scatter not), or the ids of source and
    destination crossed. The oracle comparison above must fail them."""
    pairs = [(5, 1), (0, 3), (2, 0)]

    def sorted_sources(src, dst, pairs):
        swap_blocks(src, dst, list(zip(sorted(s for s, _ in pairs), (d for _, d in pairs), strict=True)))

    def crossed_ids(src, dst, pairs):
        swap_blocks(src, dst, [(d, s) for s, d in pairs])

    assert copies_like_the_oracle(swap_blocks, pairs, num_dst_blocks=6)
    assert not copies_like_the_oracle(sorted_sources, pairs, num_dst_blocks=6)
    assert not copies_like_the_oracle(crossed_ids, pairs, num_dst_blocks=6)


def test_a_steps_transfers_run_in_order_and_are_done_once_waited_for():
    """The runner's stores and swap-outs read device blocks that its swap-ins then overwrite: in the order given.
    On the CPU `start` copies at once and `wait` has nothing to wait for."""
    device, host = random_caches(4, 4, seed=1)
    before = KVCache([c.clone() for c in device.key_caches], [c.clone() for c in device.value_caches])
    transfer = KVTransfer(torch.device("cpu"))
    transfer.start([(device, host, [(0, 2), (1, 3)]), (host, device, [(2, 1)]), (host, device, [])])
    transfer.wait()
    for d, h, old in zip(device.key_caches + device.value_caches, host.key_caches + host.value_caches,
                         before.key_caches + before.value_caches, strict=True):
        assert torch.equal(h[2], old[0]) and torch.equal(h[3], old[1]), "swapped out before the swap-in wrote"
        assert torch.equal(d[1], old[0]), "block 1 came back holding what block 0 held"
        assert torch.equal(d[0], old[0]) and torch.equal(d[2], old[2])


# --- 3. the scheduler's rules ------------------------------------------------------------------------------------


def test_swapped_groups_come_back_before_any_admission_and_never_in_a_step_that_preempted():
    model = "llama-gqa"
    folder = str(tiny_checkpoint(model))
    llm = LLM(folder, **dict(PRESSURE, num_kv_blocks=24), preemption_mode="swap", swap_space=host_gib(model, 100))
    recorded = record_outputs(llm)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = random_prompts(6, 6, 14, seed=11)
    outputs = run(llm, prompts, params)
    scheduler = core(llm).scheduler

    swapped_out: set[int] = set()
    for out, _ in recorded:
        assert not (out.preempted_seq_ids and out.swapped_in_seq_ids), "swap-in in a step that preempted"
        assert not (out.preempted_seq_ids and (out.new_seq_ids or out.resumed_seq_ids)), "admission after preempting"
        still_out = swapped_out - set(out.swapped_in_seq_ids)
        assert not (still_out and (out.new_seq_ids or out.resumed_seq_ids)), "admitted while a group is swapped out"
        swapped_out = still_out | set(out.swapped_out_seq_ids)
    assert not swapped_out and any(out.swapped_in_seq_ids for out, _ in recorded)
    assert scheduler.num_preemptions > 0
    for prompt, samples in zip(prompts, outputs, strict=True):
        for ours in samples:
            assert_greedy_close(ours, hf_greedy(folder, tuple(prompt), NEW_TOKENS), prompt, hf_oracle(folder))


@pytest.mark.parametrize("num_host_blocks", [1, 2])
def test_a_full_host_pool_falls_back_to_recomputation_with_the_same_tokens(num_host_blocks):
    model = "llama-gqa"
    folder = str(tiny_checkpoint(model))
    llm = LLM(folder, **PRESSURE, preemption_mode="swap", swap_space=host_gib(model, num_host_blocks))
    assert core(llm).scheduler.kv_cache_manager.swap_pool.num_blocks == num_host_blocks
    prompts = random_prompts(8, 4, 20, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = run(llm, prompts, params)
    stats = llm.llm_engine.stats
    assert stats.num_preemptions > stats.num_swapped_out, "some victims were too large for the host pool"
    assert stats.num_blocks_swapped_out <= num_host_blocks * max(stats.num_swapped_out, 1)
    assert_no_block_held(llm)
    for prompt, (ours,) in zip(prompts, outputs, strict=True):
        assert_greedy_close(ours, hf_greedy(folder, tuple(prompt), NEW_TOKENS), prompt, hf_oracle(folder))


def test_a_group_too_large_to_come_back_is_recomputed_not_left_out():
    """Three samples that together outgrow the device pool: swapping their group out would leave it out for ever
    (it could never come back whole), so the group is recomputed, and the request finishes."""
    model = "llama-gqa"
    folder = str(tiny_checkpoint(model))
    llm = LLM(folder, block_size=BLOCK_SIZE, num_kv_blocks=12, max_num_seqs=4, max_model_len=64,
              preemption_mode="swap", swap_space=host_gib(model, 100))
    prompt = random_prompts(1, 8, 8, seed=12)[0]
    params = SamplingParams(n=3, temperature=0.0, max_tokens=24, ignore_eos=True)
    (samples,) = run(llm, [prompt], params, limit=500)
    stats = llm.llm_engine.stats
    assert stats.num_preemptions > 0 and stats.num_swapped_out == 0
    assert_no_block_held(llm)
    theirs = hf_greedy(folder, tuple(prompt), 24)
    for ours in samples:
        assert_greedy_close(ours, theirs, prompt, hf_oracle(folder))


# --- 4. a storm of requests and aborts ----------------------------------------------------------------------------


@pytest.mark.parametrize("host_tier", [False, True])
def test_a_storm_of_requests_and_aborts_leaves_no_block_held(host_tier):
    model = "llama-gqa"
    folder = str(tiny_checkpoint(model))
    tier = dict(kv_offloading_size=host_gib(model, 16)) if host_tier else {}
    llm = LLM(folder, **dict(PRESSURE, num_kv_blocks=32), max_num_batched_tokens=24, preemption_mode="swap",
              swap_space=host_gib(model, 40), **tier)
    engine, scheduler, rng = llm.llm_engine, core(llm).scheduler, random.Random(13)
    head = random_prompts(1, 12, 12, seed=14)[0]
    for i in range(30):
        prompt = random_prompts(1, 1, 20, seed=100 + i, head=head if i % 3 == 0 else None)[0]
        params = SamplingParams(n=rng.choice([1, 1, 2, 3]), temperature=rng.choice([0.0, 1.0]), seed=i,
                                max_tokens=rng.randint(5, 40), ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
    aborted_swapped = 0
    for _ in range(3000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        unfinished = sorted(engine.output_processor.request_states)
        if scheduler.swapped and rng.random() < 0.5:  # abort a request while (some of) its samples are out
            engine.abort_request(scheduler.swapped[-1][0].request_id)
            aborted_swapped += 1
        elif unfinished and rng.random() < 0.05:
            engine.abort_request(rng.choice(unfinished))
    else:
        raise AssertionError("the storm did not drain in 3000 steps")
    assert aborted_swapped > 0, "no request was aborted while swapped out"
    assert engine.stats.num_swapped_out > 0
    assert_no_block_held(llm)
    if host_tier:
        assert core(llm).scheduler.kv_cache_manager.offloading.stats.num_blocks_stored > 0


def test_finishing_a_swapped_sequence_frees_its_host_blocks():
    """The scheduler's `finish` of a SWAPPED sequence: host references dropped, the group shrinks, then goes."""
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    manager.enable_swapping(8)
    scheduler = SwappingScheduler(manager, max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=64,
                                   max_model_len=128)
    group = forked_group(manager)
    manager.swap_out(group)
    for seq in group:
        seq.status = SequenceStatus.SWAPPED
    scheduler.swapped.append(group)
    first, second, third = list(group)
    scheduler.finish(second, SequenceStatus.FINISHED_ABORTED)
    assert scheduler.swapped == [[first, third]] and manager.swap_pool.num_free_blocks == 8 - 4 + 1
    scheduler.finish(first, SequenceStatus.FINISHED_ABORTED)
    scheduler.finish(third, SequenceStatus.FINISHED_ABORTED)
    assert scheduler.swapped == [] and manager.swap_pool.num_free_blocks == 8
    assert manager.num_used_blocks == 0


# --- 6. refusals --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, field",
    [
        (dict(preemption_mode="swap", swap_space=0), "swap_space"),
        (dict(preemption_mode="swap", swap_space=1e-9), "swap_space"),  # less than one block
        (dict(preemption_mode="bogus"), "preemption_mode"),
        (dict(kv_offloading_size=1.0, kv_offloading_backend="lmcache"), "kv_offloading_backend"),
        (dict(kv_offloading_size=1e-9), "kv_offloading_size"),  # less than one block
        (dict(kv_offloading_size=1.0, enable_prefix_caching=False), "kv_offloading_size"),
        (dict(kv_offloading_size=1.0, kv_reservation="max"), "kv_reservation"),
        (dict(preemption_mode="swap", kv_reservation="max"), "kv_reservation"),
        (dict(swap_space=-1.0), "swap_space"),
    ],
)
def test_bad_host_memory_options_are_refused_by_name(options, field):
    with pytest.raises(ValueError, match=field):
        LLM(str(tiny_checkpoint("llama-gqa")), block_size=BLOCK_SIZE, num_kv_blocks=16, **options)


# --- 7. tensor parallelism ------------------------------------------------------------------------------------------


def run_waves(llm: LLM, waves: list[list[list[int]]], params: SamplingParams) -> list[list[int]]:
    """One wave after the other (the later ones evict the earlier ones' blocks): every prompt's only sample."""
    return [samples[0] for wave in waves for samples in run(llm, wave, params, limit=1000)]


def test_two_ranks_swap_and_load_from_the_host_tier_with_one_ranks_tokens():
    """A shared head, a flood that evicts it from the device, the head again: swapped out, then loaded back."""
    model = "qwen2-bias-mqa"  # its one K/V head is replicated on both ranks
    folder = str(tiny_checkpoint(model))
    options = dict(PRESSURE, preemption_mode="swap", swap_space=host_gib(model, 100),
                   kv_offloading_size=host_gib(model, 200))
    head = random_prompts(1, 12, 12, seed=21)[0]
    prompts = [head + p for p in random_prompts(6, 2, 12, seed=22)]
    waves = [prompts, random_prompts(6, 20, 30, seed=23), prompts]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    one = run_waves(LLM(folder, **options), waves, params)
    two = LLM(folder, tensor_parallel_size=2, **options)
    try:
        ours = run_waves(two, waves, params)
        stats = two.llm_engine.stats
        assert stats.num_swapped_out > 0 and stats.external_prefix_cache_hits > 0
    finally:
        two.llm_engine.shutdown()
    for prompt, a, b in zip(sum(waves, []), ours, one, strict=True):
        assert_greedy_close(a, b, prompt, hf_oracle(folder))
        assert_greedy_close(a, hf_greedy(folder, tuple(prompt), 24), prompt, hf_oracle(folder))


def test_a_group_member_already_in_the_batch_is_swapped_out_from_the_block_its_copy_on_write_would_copy():
    """Sample P of a group was scheduled this step and got a copy-on-write copy (S -> D) of the partial block it
    shares with its sibling C; then a later sequence runs out of blocks and C's group is the victim. P leaves the
    batch, its copy is dropped, so D was never written: P's swap-out must read S."""
    manager = KVCacheManager(num_blocks=6, block_size=4)
    manager.enable_swapping(16)
    scheduler = SwappingScheduler(manager, max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=64)

    def running(seq_id: int, num_tokens: int, request_id: str) -> Sequence:
        seq = Sequence(seq_id, list(range(1, num_tokens + 1)))
        seq.request_id = request_id
        manager.allocate_slots(seq, num_tokens)
        seq.num_computed_tokens = num_tokens
        seq.append_token(99)  # one output token behind: a decode step
        return seq

    filler = running(0, 6, "w")  # 2 blocks, its next token fits its partial block
    parent = running(1, 6, "r")  # 2 blocks: a full one and a partial one (2 of 4 slots)
    child = parent.fork(2)
    manager.fork(parent, child)  # shares both; the partial one is copied on the first write
    needy = running(3, 4, "z")  # 1 full block: its next token needs a new one
    for seq in (filler, parent, needy, child):  # running order: the child is the last, the victim
        scheduler.add_running(seq)
    shared_partial = parent.block_table[1]
    assert manager.num_free_blocks == 1

    out = scheduler.schedule()

    assert out.swapped_out_seq_ids == [parent.seq_id, child.seq_id] and needy in out.scheduled_seqs
    sources = [src for src, _ in out.blocks_to_swap_out]
    assert sources.count(shared_partial) == 2, "both samples' copies of the partial block are read from S"
    assert len(sources) == 3 and out.blocks_to_copy == [], "P's dropped copy is not made"

"""Chapter 11: the prefix cache's host tier keeps what the device evicts, and a later hit loads it back.

Below the engine: `CPUOffloadingManager` and `prepare_store` on a real host `BlockPool` (LRU order, a known hash only
refreshed, stores prepared after the step's loads are held, blocks a step uses never evicted in that step, `touch`
only marking recency) and `get_num_new_matched_tokens` (the leading run past the device's hits, never the last token,
counted, nothing held). In the engine: a prefix the device evicted is loaded
from the host — fewer prefill tokens than without the tier, Hugging Face's tokens — and a prompt differing in one
early token gets none of it. Then the Prometheus names of the tier's counters and of the swapped gauge.
"""

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from grading.parity import assert_greedy_close, hf_greedy, hf_oracle
from grading.tiny_models import tiny_checkpoint
from solutions import LLM, SamplingParams
from solutions.attention.paged import KVCache
from solutions.core.block_hash import extend_block_hashes
from solutions.kv_offload.manager import CPUOffloadingManager, get_num_new_matched_tokens, prepare_store
from solutions.metrics.prometheus import PrometheusStatLogger
from solutions.metrics.stats import SchedulerStats
from solutions.model.config import ModelConfig as HFConfig

BLOCK_SIZE = 4
MODEL = "llama-gqa"
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def host_of(offloading: CPUOffloadingManager, block_hash: bytes) -> int | None:
    block = offloading.host_pool.get_cached_block(block_hash)
    return None if block is None else block.block_id


def stored(offloading: CPUOffloadingManager, *block_hashes: bytes) -> None:
    """One step that stores these evicted blocks (device ids 100, 101, ...), then has run."""
    prepare_store(offloading, [(100 + i, block_hash) for i, block_hash in enumerate(block_hashes)])
    offloading.take_transfers()
    offloading.complete_transfers()


# --- CPUOffloadingManager --------------------------------------------------------------------------------------


def test_the_host_evicts_its_least_recently_stored_block():
    offloading = CPUOffloadingManager(3)
    stored(offloading, b"a", b"b", b"c")
    assert offloading.lookup([b"a", b"b", b"c"]) == 3
    stored(offloading, b"d")
    assert host_of(offloading, b"a") is None and offloading.lookup([b"b", b"c", b"d"]) == 3
    assert offloading.stats.num_blocks_stored == 4


def test_storing_a_hash_the_host_holds_only_refreshes_it():
    offloading = CPUOffloadingManager(3)
    stored(offloading, b"a", b"b", b"c")
    block_a = host_of(offloading, b"a")
    prepare_store(offloading, [(7, b"a")])
    assert offloading.take_transfers() == ([], []), "no copy: the host has it"
    assert host_of(offloading, b"a") == block_a and offloading.stats.num_blocks_stored == 3
    stored(offloading, b"d")  # evicts b, now the least recently used
    assert host_of(offloading, b"b") is None and host_of(offloading, b"a") == block_a


def test_evictions_are_stored_when_the_step_is_decided_after_its_loads_are_held():
    offloading = CPUOffloadingManager(2)
    stored(offloading, b"a", b"b")
    offloading.on_evict(10, b"c")  # the device evicts a block while the step is being scheduled
    assert host_of(offloading, b"c") is None, "nothing is stored before the step's loads are known"
    offloading.prepare_load([b"a"], [5])  # a hit loaded this step: held
    stores, loads = offloading.take_transfers()
    assert stores == [(10, host_of(offloading, b"c"))] and host_of(offloading, b"b") is None, "b's block, not a's"
    assert loads == [(host_of(offloading, b"a"), 5)]
    offloading.complete_transfers()
    assert all(block.ref_cnt == 0 for block in offloading.host_pool.blocks)


def test_blocks_a_step_uses_are_not_evicted_in_that_step_and_stores_are_dropped_when_all_are_held():
    offloading = CPUOffloadingManager(2)
    prepare_store(offloading, [(10, b"a"), (11, b"b"), (12, b"c")])  # both host blocks are being written this step
    stores, loads = offloading.take_transfers()
    assert [device for device, _ in stores] == [10, 11] and loads == []
    assert host_of(offloading, b"c") is None and host_of(offloading, b"a") is not None
    offloading.complete_transfers()
    assert all(block.ref_cnt == 0 for block in offloading.host_pool.blocks)


def test_touch_only_marks_recency_and_prepare_load_holds_until_the_step_has_run():
    offloading = CPUOffloadingManager(3)
    stored(offloading, b"a", b"b", b"c")
    with pytest.raises(RuntimeError, match="not on the host"):
        offloading.touch([b"z"])
    offloading.touch([b"a", b"b"])  # a prefix's run: a is the most recently used, then b
    assert all(block.ref_cnt == 0 for block in offloading.host_pool.blocks), "touch holds nothing"
    assert [b.block_hash for b in offloading.host_pool.free_block_queue.get_all_free_blocks()] == [b"c", b"b", b"a"]
    with pytest.raises(RuntimeError, match="not on the host"):
        offloading.prepare_load([b"z"], [5])
    offloading.prepare_load([b"a", b"b"], [5, 6])
    assert [host_of(offloading, h) for h in (b"a", b"b")] == [0, 1]
    assert [offloading.host_pool.blocks[i].ref_cnt for i in (0, 1)] == [1, 1]
    assert offloading.take_transfers() == ([], [(0, 5), (1, 6)])
    assert offloading.stats.num_blocks_loaded == 2
    offloading.complete_transfers()
    assert all(block.ref_cnt == 0 for block in offloading.host_pool.blocks)


def block_hashes(num_tokens: int) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(num_tokens)), num_tokens, BLOCK_SIZE)
    return hashes


@pytest.mark.parametrize(
    "num_tokens, on_host, device_hits, expected",
    [
        (18, [0, 1, 3], 0, 8),  # the leading run only: block 2 misses, block 3 is not counted
        (18, [1, 2], 4, 8),  # starts after the device's hit (block 0)
        (18, [0, 1], 4, 4),  # block 0 is the device's hit, not counted again
        (16, [0, 1, 2, 3], 0, 12),  # never the block holding the last token
        (16, [1, 2, 3], 8, 4),
    ],
)
def test_host_hits_are_the_leading_run_past_the_device_never_the_last_token(num_tokens, on_host, device_hits,
                                                                            expected):
    offloading = CPUOffloadingManager(8)
    hashes = block_hashes(num_tokens)
    stored(offloading, *[hashes[i] for i in on_host])
    got = get_num_new_matched_tokens(offloading, hashes, num_tokens, device_hits, BLOCK_SIZE)
    assert got == expected
    assert offloading.stats.queries == num_tokens - device_hits and offloading.stats.hits == expected
    assert all(block.ref_cnt == 0 for block in offloading.host_pool.blocks), "a lookup holds nothing"


# --- in the engine ----------------------------------------------------------------------------------------------


def host_gib(num_blocks: int) -> float:
    hf_config = HFConfig.from_folder(tiny_checkpoint(MODEL))
    return num_blocks * KVCache.bytes_per_block(hf_config, BLOCK_SIZE) / 2**30


def make_llm(tier: bool) -> LLM:
    """A device pool that one long prompt and a flood of others overrun, with or without a 64-block host tier."""
    return LLM(str(tiny_checkpoint(MODEL)), block_size=BLOCK_SIZE, num_kv_blocks=24, max_num_seqs=4, max_model_len=128,
               kv_offloading_size=host_gib(64) if tier else None)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


def evict_then_ask_again(llm: LLM, prompt: list[int], again: list[int]) -> tuple[list[int], int, int]:
    """Run `prompt`, then enough other prompts to evict its blocks from the device, then `again`: (its tokens,
    its prefill tokens, its host-tier hits)."""
    generate(llm, [prompt])
    generate(llm, [random_prompt(40, seed) for seed in range(1, 5)])
    stats = llm.llm_engine.stats
    prefill, hits = stats.num_prefill_tokens, stats.external_prefix_cache_hits
    (tokens,) = generate(llm, [again])
    return tokens, stats.num_prefill_tokens - prefill, stats.external_prefix_cache_hits - hits


def test_a_prefix_the_device_evicted_is_loaded_from_the_host_with_hugging_faces_tokens():
    folder = str(tiny_checkpoint(MODEL))
    prompt = random_prompt(41, seed=0)
    with_tier = make_llm(True)
    tokens, prefill, hits = evict_then_ask_again(with_tier, prompt, prompt)
    without, prefill_without, _ = evict_then_ask_again(make_llm(False), prompt, prompt)
    assert hits == 40, "every full block before the last token came from the host"
    assert prefill == prefill_without - 40 == 1
    manager = with_tier.llm_engine.engine_core.scheduler.kv_cache_manager
    assert manager.offloading.stats.num_blocks_stored >= 10
    assert all(block.ref_cnt == 0 for block in manager.offloading.host_pool.blocks)
    assert tokens == without
    assert_greedy_close(tokens, hf_greedy(folder, tuple(prompt), NEW_TOKENS), prompt, hf_oracle(folder))


def test_the_host_never_returns_a_block_of_another_prefix():
    folder = str(tiny_checkpoint(MODEL))
    prompt = random_prompt(41, seed=0)
    other = [prompt[0], (prompt[1] + 1) % 256, *prompt[2:]]  # one early token differs: no block in common
    tokens, prefill, hits = evict_then_ask_again(make_llm(True), prompt, other)
    assert hits == 0 and prefill == len(other)
    assert_greedy_close(tokens, hf_greedy(folder, tuple(other), NEW_TOKENS), other, hf_oracle(folder))


# --- /metrics ---------------------------------------------------------------------------------------------------


def test_prometheus_renders_the_host_tier_counters_and_the_swapped_gauge():
    logger = PrometheusStatLogger("tiny")
    for swapped, queries, hits in [(3, 40, 32), (2, 10, 0)]:
        stats = SchedulerStats(4, 1, 10, 0.5, 0, 0, num_swapped=swapped, external_prefix_cache_queries=queries,
                               external_prefix_cache_hits=hits)
        logger.record(stats, None)
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(logger.render().decode()) for sample in family.samples
    }
    assert samples["vllm:num_requests_swapped"] == 2, "a gauge: the last step's count"
    assert samples["vllm:external_prefix_cache_queries_total"] == 50
    assert samples["vllm:external_prefix_cache_hits_total"] == 32

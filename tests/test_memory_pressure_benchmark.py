"""The memory-pressure benchmark's three parts, smoke-run on a tiny model at tiny sizes: the structure of what they
return and the counters that must move (swaps in the swap mode, host hits with the tier on), never timings."""

import pytest
import torch

from benchmarks.memory_pressure import (
    MODES,
    chat_wrappers,
    offload_rows,
    parse_args,
    poisson_requests,
    preemption_rows,
    swap_blocks_per_block,
    swap_rows,
)
from grading.tiny_models import tiny_checkpoint, tiny_model
from solutions.kv_offload.transfer import allocate_host_cache, swap_blocks
from solutions.model.loader import load_tokenizer

TINY = "llama-gqa"


def test_per_block_copies_move_the_same_bytes_as_the_batched_swap():
    model = tiny_model(TINY)
    cpu = torch.device("cpu")
    src = allocate_host_cache(model.config, 6, 4, torch.float32, cpu)
    for cache in src.key_caches + src.value_caches:
        cache.normal_()
    pairs = [(0, 3), (2, 1), (5, 4)]
    batched, looped = (allocate_host_cache(model.config, 6, 4, torch.float32, cpu) for _ in "ab")
    for cache in batched.key_caches + batched.value_caches + looped.key_caches + looped.value_caches:
        cache.zero_()
    swap_blocks(src, batched, pairs)
    swap_blocks_per_block(src, looped, pairs)
    for b, lo, s in zip(batched.key_caches + batched.value_caches, looped.key_caches + looped.value_caches,
                        src.key_caches + src.value_caches, strict=True):
        assert b.equal(lo)
        assert b[3].equal(s[0]) and b[1].equal(s[2]) and b[4].equal(s[5]) and not b[0].any()


def test_part_a_times_every_block_size_both_ways():
    rows = swap_rows(tiny_model(TINY), seq_len=40, block_sizes=[1, 16], repeats=2)
    assert [(r["block_size"], r["num_blocks"]) for r in rows] == [(1, 40), (16, 3)]
    for row in rows:
        for key in ("recompute_s", "batched_out_s", "batched_in_s", "batched_in_out_s", "per_block_out_s",
                    "per_block_in_s", "per_block_in_out_s", "copy_out_s", "copy_in_s"):
            assert len(row[key]) == 2 and all(t > 0 for t in row[key]), key


def test_poisson_requests_are_seeded_and_scaled():
    requests = poisson_requests(20, rate=4.0, seed=0, vocab_size=256, length_scale=0.125)
    assert requests == poisson_requests(20, rate=4.0, seed=0, vocab_size=256, length_scale=0.125)
    arrivals = [t for t, _, _ in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert all(1 <= len(p) <= 128 and 1 <= n <= 256 and all(100 <= t < 256 for t in p) for _, p, n in requests)


def test_part_b_swaps_in_swap_mode_only():
    rows = preemption_rows(str(tiny_checkpoint(TINY)), block_sizes=[8], repeats=2, num_requests=8, rate=1000.0,
                           length_scale=0.125, pool_tokens=128)
    assert [(r["block_size"], r["mode"]) for r in rows] == [(8, mode) for mode in MODES]
    runs = {r["mode"]: r["runs"] for r in rows}
    for run in runs["recompute"] + runs["swap"]:
        assert run["normalized_latency_s"] > 0 and run["num_preemptions"] > 0
    assert all(run["num_swapped_out"] == 0 and run["num_blocks_swapped_out"] == 0 for run in runs["recompute"])
    swapped = [run["num_swapped_out"] for run in runs["swap"]]
    assert all(n > 0 for n in swapped), swapped
    for run in runs["swap"]:  # every request finished, so every group swapped out came back
        assert run["num_blocks_swapped_in"] == run["num_blocks_swapped_out"] > 0
    with pytest.raises(ValueError, match="--pool-tokens"):
        preemption_rows(str(tiny_checkpoint(TINY)), [8], 1, 8, 50.0, 0.125, pool_tokens=16)


def test_chat_wrappers_come_from_the_chat_template():
    tokenizer = load_tokenizer("smollm2-135m")
    first_head, later_head, tail = chat_wrappers(tokenizer)
    assert tokenizer.decode(first_head).startswith("<|im_start|>system")
    assert tokenizer.decode(later_head) == "<|im_end|>\n<|im_start|>user\n"
    assert tokenizer.decode(tail) == "<|im_end|>\n<|im_start|>assistant\n"
    assert chat_wrappers(None) == ([], [], [])


def test_part_c_host_tier_hits_and_saves_prefill():
    rows = offload_rows(str(tiny_checkpoint(TINY)), repeats=2, num_conversations=4, turns=3, message_tokens=16,
                        answer_tokens=8, pool_tokens=80, block_size=4)
    runs = {r["tier"]: r["runs"] for r in rows}
    assert set(runs) == {"off", "on"}
    for off, on in zip(runs["off"], runs["on"], strict=True):
        assert len(off["ttft_s"]) == len(on["ttft_s"]) == 4 * 3  # one first token per request
        assert off["final_prompt_tokens"] == on["final_prompt_tokens"] > 80  # the working set > the pool
        assert off["external_prefix_cache_hits"] == 0 < on["external_prefix_cache_hits"]
        assert on["num_prefill_tokens"] < off["num_prefill_tokens"]
        assert on["num_cached_tokens"] > off["num_cached_tokens"]
    with pytest.raises(ValueError, match="--chat-pool-tokens"):
        offload_rows(str(tiny_checkpoint(TINY)), 1, 4, 3, 16, 8, pool_tokens=40, block_size=4)


def test_bad_options_are_refused_by_name(capsys):
    for argv, name in ((["--repeats", "0"], "--repeats"), (["--request-rate", "0"], "--request-rate"),
                       (["--block-sizes", "0"], "--block-sizes"), (["--parts", "d"], "--parts")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert name in capsys.readouterr().err
    args = parse_args(["--parts", "b", "--block-sizes", "16", "32"])
    assert args.parts == ["b"] and args.block_sizes == [16, 32] and args.repeats == 3

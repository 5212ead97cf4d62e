"""Data parallelism: N replicas, one scheduler and one KV cache manager over N block pools.

Greedy tokens at data_parallel_size=2 equal those at 1 and Hugging Face's (tiny models and SmolLM2), under
preemption, chunked prefill, prefix hits and n > 1 forks, every placement policy; seeded samples are the same at both
sizes (a sequence's generator travels with it); no block leaks on any pool after a storm of aborts; each placement
policy decides as documented on hand-built pools, without a model; a replica killed mid-run is dropped, its sequences
finish on the other with the same tokens, and the stats report it; bad options are refused naming the field.
"""

import argparse
import asyncio
import dataclasses
import os
import signal

import pytest

from grading.parity import assert_greedy_close, hf_greedy, hf_oracle
from grading.tiny_models import prompts_with_a_shared_head, sampled_token_ids, tiny_checkpoint
from solutions import LLM, SamplingParams
from solutions.config import ParallelConfig
from solutions.core.data_parallel_kv_cache_manager import DataParallelKVCacheManager
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sched.data_parallel_scheduler import DataParallelModelRunnerOutput, DataParallelScheduler
from solutions.core.sched.output import ModelRunnerOutput, sampling_rows
from solutions.core.sched.placement import (
    PLACEMENT_POLICIES,
    ApproxPrefixPolicy,
    LeastLoadedPolicy,
    PrefixAwarePolicy,
    ReplicaState,
    RoundRobinPolicy,
    create_placement_policy,
)
from solutions.core.sched.request_queue import SchedulingPolicy
from solutions.core.sched.scheduler import Scheduler
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.engine.arg_utils import AsyncEngineArgs, EngineArgs
from solutions.engine.async_llm import AsyncLLM
from solutions.exceptions import ParameterError
from solutions.metrics.prometheus import PrometheusStatLogger
from solutions.model.loader import resolve_model

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=NEW_TOKENS, ignore_eos=True)
# per replica: preemption (KV for a few sequences), chunked prompts beside decodes, prefix-cache hits (a shared head)
HARD = dict(block_size=8, num_kv_blocks=20, max_num_batched_tokens=32, long_prefill_token_threshold=16, max_num_seqs=5,
            max_model_len=256)


def prompts(vocab_size: int, count: int = 8, seed: int = 0) -> list[list[int]]:
    return prompts_with_a_shared_head(count, vocab_size, seed)


def core_of(llm: LLM):
    return llm.llm_engine.engine_core  # the client: the core's parts are in this process


def assert_no_leak(scheduler: DataParallelScheduler) -> None:
    for replica, manager in enumerate(scheduler.kv_cache_manager.replicas):
        assert manager.num_free_blocks == manager.num_blocks, f"replica {replica} leaked blocks"
        assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks), f"replica {replica} holds references"
    assert not scheduler.requests and not scheduler.waiting


@pytest.fixture(scope="module")
def tiny():
    """One DP=1 and one DP=2 engine on a tiny model, and the DP=1 engine's tokens as the reference."""
    path = str(tiny_checkpoint("llama-gqa"))
    one = LLM(path, **HARD)
    batch = prompts(one.llm_engine.vllm_config.model_config.vocab_size)
    reference = sampled_token_ids(one, batch, GREEDY), sampled_token_ids(one, batch, SAMPLED)
    two = LLM(path, data_parallel_size=2, **HARD)
    yield path, batch, reference, two
    two.llm_engine.shutdown()


# --- the engine ----------------------------------------------------------------------------------------------------


def test_two_replicas_give_one_replicas_tokens_and_hugging_faces(tiny):
    path, batch, (greedy_one, sampled_one), two = tiny
    greedy_two, sampled_two = sampled_token_ids(two, batch, GREEDY), sampled_token_ids(two, batch, SAMPLED)
    scheduler = core_of(two).scheduler
    assert scheduler.num_preemptions > 0, "the tight pools should have preempted"
    assert all(manager.num_blocks_copied >= 0 for manager in scheduler.kv_cache_manager.replicas)
    assert greedy_two == greedy_one
    assert sampled_two == sampled_one, "a seeded sample must not depend on the replica it ran on"
    folder = str(resolve_model(path))
    for prompt, (ours,) in zip(batch[:3], greedy_two, strict=False):
        assert_greedy_close(ours, hf_greedy(folder, tuple(prompt), NEW_TOKENS), prompt, hf_oracle(folder))
    assert_no_leak(scheduler)


def test_greedy_and_seeded_samples_in_one_batch_give_one_replicas_tokens(tiny):
    """Only a sequence that draws has its generator's state sent to its replica and back: greedy and seeded ones in
    the same steps, on both replicas, sample what one replica samples."""
    path, batch, (greedy_one, sampled_one), two = tiny
    mixed = [GREEDY if i % 2 else SAMPLED for i in range(len(batch))]
    expected = [greedy_one[i] if i % 2 else sampled_one[i] for i in range(len(batch))]
    assert sampled_token_ids(two, batch, mixed) == expected


@pytest.mark.parametrize("policy", PLACEMENT_POLICIES)
def test_every_placement_policy_gives_the_same_tokens_on_both_replicas(tiny, policy):
    _, batch, (greedy_one, _), two = tiny
    scheduler = core_of(two).scheduler
    scheduler.placement = create_placement_policy(policy, 2)
    pools = scheduler.kv_cache_manager.replicas
    admitted = [pool.prefix_cache_stats.num_requests for pool in pools]  # one lookup per admission on a pool
    assert sampled_token_ids(two, batch, GREEDY) == greedy_one
    admitted = [pool.prefix_cache_stats.num_requests - before for pool, before in zip(pools, admitted, strict=True)]
    assert all(admitted), f"{policy} placed every sequence on one replica: admissions per replica {admitted}"
    assert_no_leak(scheduler)


def test_no_block_leaks_on_any_pool_after_a_storm_of_aborts_preemptions_and_forks(tiny):
    _, batch, _, two = tiny
    engine, scheduler = two.llm_engine, core_of(two).scheduler
    params = [SamplingParams(n=1 + i % 3, temperature=1.0, seed=i, max_tokens=30 + 2 * i, ignore_eos=True)
              for i in range(len(batch))]
    preempted = scheduler.num_preemptions
    for i, (prompt, p) in enumerate(zip(batch * 2, params * 2, strict=True)):
        engine.add_request(f"storm-{i}", prompt, p)
    steps, done = 0, set()
    while engine.has_unfinished_requests():
        done.update(out.request_id for out in engine.step() if out.finished)
        steps += 1
        if steps in (2, 5, 9):  # abort some mid-prefill, some decoding, some still waiting unplaced
            aborted = [f"storm-{i}" for i in range(steps % 3, 16, 4) if f"storm-{i}" not in done]
            engine.abort_request(aborted)
            done.update(aborted)
        assert steps < 500, "the storm did not end"
    assert scheduler.num_preemptions > preempted, "the storm should have preempted"
    assert_no_leak(scheduler)


def test_a_replica_killed_mid_run_is_dropped_and_its_sequences_finish_on_the_other(tiny):
    path, batch, (greedy_one, _), _ = tiny
    llm = LLM(path, data_parallel_size=2, **HARD)
    try:
        engine, core = llm.llm_engine, core_of(llm)
        for i, prompt in enumerate(batch):
            engine.add_request(str(i), prompt, GREEDY)
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(batch))}
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():  # each step's new tokens
                tokens[out.request_id] += out.outputs[0].token_ids
            steps += 1
            if steps == 4:
                os.kill(core.model_executor.workers[1].pid, signal.SIGKILL)
            assert steps < 500, "the run did not end after a replica died"
        scheduler = core.scheduler
        assert scheduler.kv_cache_manager.alive == [True, False]
        assert scheduler.num_requeued > 0, "replica 1 had sequences to hand back"
        assert [tokens[str(i)] for i in range(len(batch))] == [g[0] for g in greedy_one]
        stats = scheduler.make_stats()
        assert stats.num_dead_replicas == 1
        logger = PrometheusStatLogger("tiny")
        logger.record(stats, None)
        assert b"vllm:num_dead_replicas{model_name=\"tiny\"} 1.0" in logger.render()
        kept_serving = sampled_token_ids(llm, batch[:2], GREEDY) == greedy_one[:2]
        assert kept_serving, "the engine keeps serving on the live replica"
    finally:
        llm.llm_engine.shutdown()


def test_smollm2_on_two_replicas_gives_hugging_faces_greedy_tokens():
    llm = LLM("smollm2-135m", data_parallel_size=2, max_num_seqs=4, max_model_len=256)
    try:
        batch = [[1, 504, 3458, 282, 253, 1168], [1, 504, 3458, 282, 253, 1168, 30, 2593], [1, 9707, 28, 314]]
        ours = sampled_token_ids(llm, batch, GREEDY)
    finally:
        llm.llm_engine.shutdown()
    folder = str(resolve_model("smollm2-135m"))
    for prompt, (tokens,) in zip(batch, ours, strict=True):
        assert_greedy_close(tokens, hf_greedy(folder, tuple(prompt), NEW_TOKENS), prompt, hf_oracle(folder))


# --- the options ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_a_bad_data_parallel_size_is_refused_naming_the_field(value):
    with pytest.raises(ParameterError, match="data_parallel_size") as info:
        EngineArgs(data_parallel_size=value)
    assert info.value.parameter == "data_parallel_size"


def test_the_server_takes_the_flags_and_its_core_process_starts_the_replicas(tiny):
    """The server's engine core runs in its own process (the default), which starts the replicas' workers."""
    path, batch, (greedy_one, _), _ = tiny
    parser = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser())
    argv = ["--model", path, "--data-parallel-size", "2", "--data-parallel-placement", "least_loaded"]
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(argv))
    assert (args.data_parallel_size, args.data_parallel_placement, args.engine_core) == (2, "least_loaded", "process")
    args = dataclasses.replace(args, **HARD)

    async def serve() -> list[list[int]]:
        async with AsyncLLM.from_engine_args(args) as llm:
            async def one(i: int) -> list[int]:
                return [t async for out in llm.generate(batch[i], GREEDY, str(i)) for t in out.outputs[0].token_ids]
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(4))), timeout=120)

    assert asyncio.run(serve()) == [g[0] for g in greedy_one[:4]]


def test_an_unknown_placement_is_refused_listing_the_policies():
    with pytest.raises(ParameterError, match="data_parallel_placement") as info:
        EngineArgs(data_parallel_placement="random")
    assert all(name in str(info.value) for name in PLACEMENT_POLICIES)


@pytest.mark.parametrize("options, field", [
    (dict(tensor_parallel_size=2), "tensor_parallel_size"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
    (dict(distributed_executor_backend="external_launcher"), "distributed_executor_backend"),
    (dict(kv_reservation="max"), "kv_reservation"),
])
def test_what_data_parallelism_does_not_run_with_is_refused(options, field):
    with pytest.raises(ParameterError, match="data_parallel_size=2") as info:
        EngineArgs(data_parallel_size=2, **options)
    assert info.value.parameter == field


@pytest.mark.parametrize("options, field", [
    (dict(data_parallel_size=0), "data_parallel_size"),
    (dict(worker_multiproc_method="forkserver"), "worker_multiproc_method"),
    (dict(data_parallel_placement="random"), "data_parallel_placement"),
    (dict(data_parallel_size=2, tensor_parallel_size=2), "tensor_parallel_size"),
    (dict(data_parallel_size=2, distributed_executor_backend="external_launcher"), "distributed_executor_backend"),
])
def test_parallel_config_checks_its_own_values_naming_the_field(options, field):
    """The rules live in `ParallelConfig`: made directly, without `EngineArgs`, a bad value is refused the same."""
    with pytest.raises(ParameterError, match=field) as info:
        ParallelConfig(**options)
    assert info.value.parameter == field
    assert ParallelConfig(data_parallel_size=2).data_parallel and not ParallelConfig().data_parallel


# --- placement on hand-built pools, no model -----------------------------------------------------------------------

BLOCK_SIZE = 4


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    seq = Sequence(seq_id, tokens)
    seq.request_id, seq.sampling_params = f"r{seq_id}", SamplingParams(max_tokens=3, ignore_eos=True)
    return seq


def run_step(scheduler: DataParallelScheduler) -> None:
    """One step, every sampling sequence given token 7 (the scheduler's side of a step, without a model): every
    replica scheduled comes back at once."""
    out = scheduler.schedule()
    sampled = {}
    for r, part in out.replica_outputs.items():
        _, seqs = sampling_rows(part)
        sampled[r] = ModelRunnerOutput([s.seq_id for s in seqs], [[7] for _ in seqs], [None] * len(seqs))
    scheduler.update_from_output(out, DataParallelModelRunnerOutput(sampled))


def hand_built(num_replicas: int = 2, num_blocks: int = 16, placement=None) -> DataParallelScheduler:
    replicas = [
        Scheduler(KVCacheManager(num_blocks, BLOCK_SIZE), max_num_seqs=4, max_num_batched_tokens=64,
                  long_prefill_token_threshold=64, max_model_len=64)
        for _ in range(num_replicas)
    ]
    return DataParallelScheduler(replicas, placement or PrefixAwarePolicy(), SchedulingPolicy.FCFS)


def cache_on(manager: KVCacheManager, seq_id: int, tokens: list[int]) -> None:
    """Compute `tokens` on `manager`'s pool and free them: their full blocks stay cached, free."""
    seq = make_seq(seq_id, tokens)
    manager.allocate_slots(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    manager.free(seq)


def state(replica: int, running: int = 0, waiting: int = 0, cached: int = 0) -> ReplicaState:
    return ReplicaState(replica, running, waiting, 16, cached)


def test_round_robin_takes_each_replica_in_turn_and_skips_the_full_ones():
    policy, seq = RoundRobinPolicy(), make_seq(0, [1, 2, 3])
    everyone = [state(0), state(1), state(2)]
    assert [policy.place(seq, everyone) for _ in range(4)] == [0, 1, 2, 0]
    assert policy.place(seq, [state(0), state(2)]) == 2  # 1 cannot take it now


def pool_state(replica: int, running: int = 0, waiting: int = 0, free: int = 16) -> ReplicaState:
    """A replica whose pool has 16 blocks, `free` of them free."""
    return ReplicaState(replica, running, waiting, free, 0, num_blocks=16)


def test_the_load_score_weighs_a_waiting_sequence_by_its_pools_kv_cache_usage():
    # by hand, vLLM's score: running + waiting + waiting * 6 * max(0, usage - 0.5), usage = 1 - free / 16
    assert pool_state(0, running=3, waiting=2).load == 5  # usage 0
    assert pool_state(0, running=3, waiting=2, free=8).load == 5  # usage 0.5: no pressure yet
    assert pool_state(0, running=3, waiting=2, free=4).load == 3 + 2 + 2 * 6 * 0.25  # usage 0.75: 8
    assert pool_state(0, running=3, waiting=1, free=0).load == 3 + 1 + 3  # full: a waiting one weighs 4
    assert pool_state(0, running=3, free=0).load == 3  # nobody waiting: no pressure counted
    assert state(0, running=3, waiting=2).load == 5  # pool size not given: usage 0


def test_least_loaded_weighs_a_waiting_sequence_more_as_its_pool_fills():
    seq = make_seq(0, [1, 2, 3])
    half_full = [pool_state(0, running=3), pool_state(1, waiting=2, free=8)]  # loads 3 and 2
    assert LeastLoadedPolicy(2).place(seq, half_full) == 1
    three_quarters = [pool_state(0, running=3), pool_state(1, waiting=2, free=4)]  # loads 3 and 2 + 3
    assert LeastLoadedPolicy(2).place(seq, three_quarters) == 0


def test_least_loaded_ties_rotate_from_one_placement_to_the_next():
    policy, seq = LeastLoadedPolicy(3), make_seq(0, [1, 2, 3])
    everyone = [state(0), state(1), state(2)]
    assert [policy.place(seq, everyone) for _ in range(4)] == [0, 1, 2, 0]  # scans start at 0, 1, 2, 0
    assert policy.place(seq, [state(0), state(1, running=1), state(2)]) == 2  # scan from 1: 1 is busier, then 2
    assert policy.place(seq, [state(0), state(1)]) == 0  # scan from 2, which is not offered: 0 comes next
    assert policy.place(seq, [state(0, waiting=1), state(1, running=1), state(2)]) == 2  # the least loaded wins


def test_the_scheduler_gives_placement_each_pools_size():
    scheduler = hand_built(2, num_blocks=12)
    assert [s.num_blocks for s in scheduler.replica_states([0, 0])] == [12, 12]
    assert all(s.kv_cache_usage == 0 for s in scheduler.replica_states([0, 0]))


def test_the_prefix_policy_finds_the_pool_holding_the_longest_prefix():
    scheduler = hand_built(3)
    head = list(range(100, 112))  # three full blocks
    cache_on(scheduler.kv_cache_manager.replicas[1], 0, head[:8])
    cache_on(scheduler.kv_cache_manager.replicas[2], 1, head + [7])
    seq = make_seq(2, head + [9, 9])
    assert scheduler.kv_cache_manager.num_cached_blocks(seq) == [0, 2, 3]
    assert all(m.prefix_cache_stats.queries == 0 for m in scheduler.kv_cache_manager.replicas), "a lookup, no query"
    assert all(m.num_free_blocks == m.num_blocks for m in scheduler.kv_cache_manager.replicas), "nothing allocated"
    scheduler.add_request(seq)
    scheduler.place_waiting()
    assert seq.replica == 2


def test_the_prefix_policy_breaks_near_ties_by_load_and_caps_the_load_of_a_hot_prefix():
    policy, seq = PrefixAwarePolicy(load_cap=4, near_tie_blocks=1), make_seq(0, [1])
    assert policy.place(seq, [state(0, running=2, cached=5), state(1, running=1, cached=4)]) == 1  # near tie
    assert policy.place(seq, [state(0, running=2, cached=5), state(1, running=1, cached=3)]) == 0  # the cache wins
    assert policy.place(seq, [state(0, running=5, cached=5), state(1, running=1, cached=0)]) == 0  # within the cap
    assert policy.place(seq, [state(0, running=6, cached=5), state(1, running=1, cached=0)]) == 1  # past it
    assert policy.place(seq, [state(0, running=3), state(1, running=1)]) == 1  # nothing cached: least loaded


def test_a_hot_prefix_does_not_pile_every_sequence_onto_one_replica():
    scheduler = hand_built(2, num_blocks=64, placement=PrefixAwarePolicy(load_cap=4))
    for r in range(2):
        scheduler.replicas[r].max_num_seqs = 16
    hot = list(range(200, 216))
    cache_on(scheduler.kv_cache_manager.replicas[0], 99, hot + [1])
    seqs = [make_seq(i, hot + [i]) for i in range(8)]
    for seq in seqs:
        scheduler.add_request(seq)
    scheduler.place_waiting()
    counts = [sum(seq.replica == r for seq in seqs) for r in range(2)]
    assert counts[0] > counts[1] > 0, f"the hot replica should get more, and the other some: {counts}"


def test_the_approximate_router_follows_its_tree_past_the_threshold_and_balances_below():
    policy = ApproxPrefixPolicy(2, cache_threshold=0.5, balance_abs_threshold=4)
    first = make_seq(0, list(range(10)))
    assert policy.place(first, [state(0, running=1), state(1)]) == 1  # no match anywhere: the shortest queue
    similar = make_seq(1, list(range(8)) + [50, 51])  # 8 of 10 tokens match replica 1's tree
    assert policy.place(similar, [state(0), state(1, running=2)]) == 1
    other = make_seq(2, [7, 7, 7, 7])
    assert policy.place(other, [state(0), state(1, running=2)]) == 0
    assert policy.place(similar, [state(0), state(1, running=9)]) == 0  # out of balance: the shortest queue


def test_the_approximate_tree_stays_within_its_size():
    policy = ApproxPrefixPolicy(1, max_tree_tokens=20)
    for i in range(10):
        policy.place(make_seq(i, [i] * 8), [state(0)])
    assert policy.trees[0].num_tokens <= 20
    assert policy.trees[0].match([9] * 8) == 8, "the newest prompt is kept, the oldest dropped"


def test_a_replica_without_room_is_not_offered_and_the_queue_keeps_its_order():
    scheduler = hand_built(2, num_blocks=4)
    seqs = [make_seq(i, [i + 1] * 12) for i in range(3)]  # 3 blocks each
    for seq in seqs:
        scheduler.add_request(seq)
    scheduler.place_waiting()
    assert [seq.replica for seq in seqs] == [0, 1, None], "each pool holds one; the third waits, unplaced"
    scheduler.schedule()
    assert [seq.status for seq in seqs[:2]] == [SequenceStatus.RUNNING] * 2


def test_a_dead_replicas_sequences_are_requeued_unplaced_and_its_pool_is_gone():
    scheduler = hand_built(2)
    seqs = [make_seq(i, list(range(i, i + 9))) for i in range(4)]
    for seq in seqs:
        scheduler.add_request(seq)
    run_step(scheduler)
    on_one = [seq for seq in seqs if seq.replica == 1]
    assert on_one and all(seq.num_computed_tokens > 0 for seq in on_one)
    scheduler.drop_replica(1)
    assert all(seq.replica is None and seq.num_computed_tokens == 0 for seq in on_one)
    assert all(seq.status is SequenceStatus.PREEMPTED for seq in on_one)
    assert list(scheduler.waiting) == sorted(on_one, key=lambda s: s.seq_id)
    gone = scheduler.kv_cache_manager.replicas[1]
    assert gone.num_free_blocks == gone.num_blocks, "the gone pool's books balance"
    assert scheduler.kv_cache_manager.num_blocks == scheduler.kv_cache_manager.replicas[0].num_blocks
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
        assert all(seq.replica in (0, None) for seq in on_one), "nothing is placed on a gone replica"
    assert all(seq.num_output_tokens == 3 for seq in seqs)
    assert_no_leak(scheduler)
    with pytest.raises(RuntimeError, match="every data-parallel replica has died"):
        scheduler.drop_replica(0)


def test_a_kv_cache_manager_needs_a_pool():
    with pytest.raises(ValueError, match="at least one"):
        DataParallelKVCacheManager([])

"""The differential grader (`grading/differential.py`) sees what it must and nothing else: a different LRU order, a
reference count, an object shared or not; not a heap's layout. A wrong exercise fails with its workload cut down;
the reference passes."""

import copy

import pytest

from grading.differential import RequestSpec, SchedulerWorld, differences, run_alike, scheduler_step, snapshot
from grading.impl import Implementation
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sched import scheduler as scheduler_module
from solutions.core.sched.request_queue import PriorityRequestQueue
from solutions.core.sched.scheduler import Scheduler
from solutions.core.sequence import Sequence


def pool_with_freed(order: list[int]) -> KVCacheManager:
    manager = KVCacheManager(4, 4)
    blocks = manager.block_pool.get_new_blocks(4)
    manager.block_pool.free_blocks([blocks[i] for i in order])
    return manager


def test_a_different_lru_order_or_reference_count_is_a_difference():
    same = differences(snapshot(pool_with_freed([0, 1, 2, 3])), snapshot(pool_with_freed([0, 1, 2, 3])))
    assert same == []
    assert differences(snapshot(pool_with_freed([0, 1, 2, 3])), snapshot(pool_with_freed([1, 0, 2, 3])))
    held = pool_with_freed([0, 1, 2, 3])
    held.block_pool.blocks[2].ref_cnt = 1
    assert any("ref_cnt" in d for d in differences(snapshot(pool_with_freed([0, 1, 2, 3])), snapshot(held)))


def test_sharing_is_compared_and_a_heaps_layout_is_not():
    seq = Sequence(0, [1, 2])
    assert differences(snapshot([seq, seq]), snapshot([seq, copy.deepcopy(seq)]))
    one, other = PriorityRequestQueue(), PriorityRequestQueue()
    seqs = [Sequence(i, [1], priority=p) for i, p in enumerate([3, 1, 2, 0])]
    for seq in seqs:
        one.add(seq)
    for seq in reversed(seqs):
        other.add(seq)
    assert one._heap != other._heap  # the same queue, laid out otherwise
    assert differences(snapshot(one), snapshot(other)) == []


def fcfs_world(specs: list[RequestSpec]) -> SchedulerWorld:
    scheduler = Scheduler(KVCacheManager(10, 4), max_num_seqs=4, max_num_batched_tokens=16,
                          long_prefill_token_threshold=16, max_model_len=64)
    return SchedulerWorld(scheduler, specs)


def specs(count: int) -> list[RequestSpec]:
    return [RequestSpec(prefix=i % 2, tail=5 + i, n=1 + i % 2, max_tokens=8, priority=0, arrives=i, aborted=None)
            for i in range(count)]


def first_started(scheduler):
    """A wrong victim: the first to start running instead of the last."""
    return scheduler.running[0]


def test_the_reference_passes_and_a_wrong_victim_fails_cut_down():
    reference = {"select_victim": scheduler_module.select_victim}
    run_alike(Implementation("reference", reference), "select_victim", scheduler_module.select_victim, fcfs_world,
              specs(6), scheduler_step, "10 blocks")
    wrong = Implementation("mutant", {"select_victim": first_started})
    with pytest.raises(AssertionError, match="select_victim") as failure:
        run_alike(wrong, "select_victim", scheduler_module.select_victim, fcfs_world, specs(6), scheduler_step,
                  "10 blocks", shrink_seconds=3.0)
    shown = str(failure.value).split("requests ")[1].split("; before step")[0]
    assert shown.count("RequestSpec(") < 6, shown  # the workload was cut down

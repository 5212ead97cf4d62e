"""The grader's rank runner (`grading.ranks.run_on_ranks`): results come back whole, failures come back named.

A rank's result is a tensor made in a process that exits at once, and on a busy machine ranks reach the group at
very different times. Both once failed chapter 9's tests with connection errors instead of a verdict.
"""

import pytest
import torch
import torch.distributed as dist

from grading.ranks import run_on_ranks


def fresh_tensors(rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """No collective at all: the rank returns as soon as the group is made, and exits."""
    g = torch.Generator().manual_seed(rank)
    return torch.randn(rows, 4, generator=g), torch.arange(rows) + rank


def summed(rank: int, value: float) -> torch.Tensor:
    x = torch.full((3,), value * (rank + 1))
    dist.all_reduce(x)
    return x


def raises_on_rank_one(rank: int) -> int:
    if rank == 1:
        raise ValueError("rank one's layer is wrong")
    return rank


def test_tensors_come_back_from_ranks_that_exit_at_once():
    for _ in range(5):  # each round a fresh group of 3 processes; once they failed now and then
        results = run_on_ranks(fresh_tensors, 3, 5)
        for rank, (x, ids) in enumerate(results):
            g = torch.Generator().manual_seed(rank)
            assert torch.equal(x, torch.randn(5, 4, generator=g))
            assert torch.equal(ids, torch.arange(5) + rank)


def test_every_rank_gets_the_collectives_result():
    assert [x.tolist() for x in run_on_ranks(summed, 2, 1.5)] == [[4.5] * 3] * 2


def test_a_rank_that_raises_is_named_with_its_error():
    with pytest.raises(AssertionError, match="rank 1: ValueError: rank one's layer is wrong"):
        run_on_ranks(raises_on_rank_one, 2)

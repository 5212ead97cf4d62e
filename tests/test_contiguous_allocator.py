"""The contiguous baseline: reservation policies and the first-fit `ContiguousAllocator`.

Flat tests per behaviour, then a stateful property test that checks the allocator against a dense oracle (one
owner per slot) through long random runs of allocate / free.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from solutions.baselines.contiguous_allocator import ContiguousAllocator, ReservationPolicy, Segment, reserved_length

# reservation policies ------------------------------------------------------------------------------------------


def test_max_model_len_policy_reserves_the_whole_context():
    assert reserved_length(10, 25, 2048, ReservationPolicy.MAX_MODEL_LEN) == 2048


def test_pow2_policy_rounds_the_output_up_to_a_power_of_two():
    assert reserved_length(10, 25, 2048, ReservationPolicy.POW2) == 10 + 32  # the paper's example
    assert reserved_length(10, 32, 2048, ReservationPolicy.POW2) == 10 + 32
    assert reserved_length(10, 1, 2048, ReservationPolicy.POW2) == 10 + 1


def test_pow2_policy_is_capped_at_max_model_len():
    assert reserved_length(1000, 1030, 2048, ReservationPolicy.POW2) == 2048


def test_oracle_policy_reserves_the_true_length():
    assert reserved_length(10, 25, 2048, ReservationPolicy.ORACLE) == 35


@pytest.mark.parametrize("prompt_len, output_len", [(0, 5), (5, 0), (2000, 49)])
def test_reserved_length_rejects_impossible_requests(prompt_len, output_len):
    with pytest.raises(ValueError):
        reserved_length(prompt_len, output_len, 2048, ReservationPolicy.ORACLE)


# allocator -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 2.0, False])
def test_allocator_rejects_bad_num_slots_naming_the_field(bad):
    with pytest.raises(ValueError, match="num_slots"):
        ContiguousAllocator(bad)


def test_allocate_places_ranges_first_fit():
    allocator = ContiguousAllocator(100)
    assert allocator.allocate(0, 30) == 0
    assert allocator.allocate(1, 20) == 30
    assert allocator.allocate(2, 10) == 50
    allocator.free(0)
    assert allocator.allocate(3, 40) == 60  # the 30-slot hole at 0 is too small
    assert allocator.allocate(4, 25) == 0  # first fit: the hole at 0 comes first


def test_segments_draw_the_swiss_cheese():
    allocator = ContiguousAllocator(100)
    for request_id, num_slots in enumerate([30, 20, 10]):
        allocator.allocate(request_id, num_slots)
    allocator.free(1)
    assert allocator.segments() == [Segment(0, 30, 0), Segment(30, 20, None), Segment(50, 10, 2), Segment(60, 40, None)]
    assert (allocator.num_free_slots, allocator.num_used_slots, allocator.largest_free_extent) == (60, 40, 40)
    assert allocator.external_fragmentation == pytest.approx(20 / 60)


def test_freeing_a_neighbour_merges_the_holes():
    allocator = ContiguousAllocator(100)
    for request_id in range(4):
        allocator.allocate(request_id, 25)
    allocator.free(1)
    allocator.free(2)
    assert allocator.largest_free_extent == 50
    assert allocator.allocate(9, 50) == 25


def test_allocate_refuses_when_free_slots_are_split_into_small_holes():
    allocator = ContiguousAllocator(100)
    for request_id in range(4):
        allocator.allocate(request_id, 25)
    allocator.free(0)
    allocator.free(2)
    assert allocator.num_free_slots == 50 and not allocator.can_allocate(30)
    with pytest.raises(ValueError, match="cannot allocate 30 contiguous slots for request 7: 50 of 100 slots are "
                                         "free, but the largest hole has 25"):
        allocator.allocate(7, 30)
    assert allocator.num_free_slots == 50


def test_allocate_refuses_a_request_that_already_holds_slots():
    allocator = ContiguousAllocator(100)
    allocator.allocate(0, 10)
    with pytest.raises(ValueError, match="already holds"):
        allocator.allocate(0, 10)


def test_free_refuses_an_unknown_request():
    with pytest.raises(ValueError, match="request 3 holds no slots"):
        ContiguousAllocator(10).free(3)


def test_external_fragmentation_is_zero_for_one_hole_or_none():
    allocator = ContiguousAllocator(10)
    assert allocator.external_fragmentation == 0.0
    allocator.allocate(0, 10)
    assert allocator.external_fragmentation == 0.0


# stateful property test -----------------------------------------------------------------------------------------


class ContiguousAllocatorMachine(RuleBasedStateMachine):
    """Random allocate / free runs checked against `owner_of_slot`, a dense list with one owner per slot."""

    @initialize(num_slots=st.integers(1, 64))
    def setup(self, num_slots):
        self.allocator = ContiguousAllocator(num_slots)
        self.owner_of_slot: list[int | None] = [None] * num_slots
        self.next_id = 0

    def holes(self) -> list[int]:
        """Lengths of the runs of free slots in the oracle."""
        runs, run = [], 0
        for owner in self.owner_of_slot + [-1]:
            if owner is None:
                run += 1
            else:
                runs.append(run)
                run = 0
        return [r for r in runs if r]

    @rule(num_slots=st.integers(1, 40))
    def allocate(self, num_slots):
        request_id, self.next_id = self.next_id, self.next_id + 1
        fits = any(hole >= num_slots for hole in self.holes())
        assert self.allocator.can_allocate(num_slots) == fits
        if fits:
            start = self.allocator.allocate(request_id, num_slots)
            assert self.owner_of_slot[start : start + num_slots] == [None] * num_slots, "overlaps a held range"
            self.owner_of_slot[start : start + num_slots] = [request_id] * num_slots
        else:
            free = self.allocator.num_free_slots
            with pytest.raises(ValueError, match=rf"cannot allocate {num_slots} contiguous slots.*{free} of"):
                self.allocator.allocate(request_id, num_slots)

    @precondition(lambda self: any(owner is not None for owner in self.owner_of_slot))
    @rule(index=st.integers(0, 1000))
    def free(self, index):
        owners = sorted({owner for owner in self.owner_of_slot if owner is not None})
        request_id = owners[index % len(owners)]
        self.allocator.free(request_id)
        self.owner_of_slot = [None if owner == request_id else owner for owner in self.owner_of_slot]
        with pytest.raises(ValueError, match="holds no slots"):  # a double free is refused
            self.allocator.free(request_id)

    @invariant()
    def segments_match_the_oracle(self):
        drawn = []
        for segment in self.allocator.segments():
            assert segment.length > 0
            drawn += [segment.owner] * segment.length
        assert drawn == self.owner_of_slot, "segments do not tile the pool as the oracle does"

    @invariant()
    def counts_match_the_oracle(self):
        allocator = self.allocator
        num_free = self.owner_of_slot.count(None)
        assert (allocator.num_free_slots, allocator.num_used_slots) == (num_free, allocator.num_slots - num_free)
        assert allocator.largest_free_extent == max(self.holes(), default=0)


TestContiguousAllocatorMachine = ContiguousAllocatorMachine.TestCase
TestContiguousAllocatorMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)

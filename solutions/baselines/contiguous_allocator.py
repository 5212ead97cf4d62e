"""The baseline paged attention replaces: one contiguous slab of KV slots per request, reserved up front.

Before vLLM, systems such as Orca stored each request's keys and values in one contiguous range of slots reserved
at admission, because attention kernels wanted a dense `(seq, ...)` tensor. The final length is unknown then, so
the system must guess:

    MAX_MODEL_LEN  Orca (Max): reserve `max_model_len` slots for every request.
    POW2           Orca (Pow2): the prompt plus the output length rounded up to a power of two (25 → 32 slots).
    ORACLE         Orca (Oracle): exactly prompt + output; needs the future, so no real system can.

POW2 and ORACLE read the true output length: as in the vLLM paper (§6.1), they are bounds, not policies. Three
kinds of waste follow (Fig. 2): *reservation* (slots held for tokens generated later), *internal fragmentation*
(slots beyond the final length) and *external fragmentation* (free slots cut into holes too small for the next
request). `ContiguousAllocator` is a first-fit allocator that makes the last visible: `segments()` draws the
"Swiss cheese".
"""

import bisect
from enum import Enum, auto
from typing import NamedTuple


class ReservationPolicy(Enum):
    MAX_MODEL_LEN = auto()
    POW2 = auto()
    ORACLE = auto()


def reserved_length(prompt_len: int, output_len: int, max_model_len: int, policy: ReservationPolicy) -> int:
    """Slots a contiguous system reserves at admission for a request with these true lengths."""
    if prompt_len < 1 or output_len < 1:
        raise ValueError(f"prompt_len and output_len must be >= 1, got {prompt_len} and {output_len}")
    if prompt_len + output_len > max_model_len:
        raise ValueError(f"prompt_len + output_len = {prompt_len + output_len} exceeds max_model_len = {max_model_len}")
    if policy is ReservationPolicy.MAX_MODEL_LEN:
        return max_model_len
    if policy is ReservationPolicy.POW2:
        output_pow2 = 1 << (output_len - 1).bit_length()  # smallest power of two >= output_len
        return min(prompt_len + output_pow2, max_model_len)
    return prompt_len + output_len


class Segment(NamedTuple):
    """A run of slots `[start, start + length)`: held by request `owner`, or a hole when `owner` is None.

    A named tuple, so a plot can write `for start, length, owner in allocator.segments()`.
    """

    start: int
    length: int
    owner: int | None


class ContiguousAllocator:
    """First-fit allocation of contiguous slot ranges from a pool of `num_slots` token slots.

    Invariants: the held ranges never overlap and lie inside `[0, num_slots)`; `_starts` is sorted and
    `_starts[i]` starts the range of `_owners[i]`; `num_free_slots + num_used_slots == num_slots`.
    Kept as sorted lists rather than a free list: a few hundred live requests at most, and holes are simply
    the gaps between neighbours, so freeing needs no coalescing.
    """

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        self.num_slots = num_slots
        self._starts: list[int] = []
        self._owners: list[int] = []
        self._ranges: dict[int, tuple[int, int]] = {}  # request_id -> (start, length)
        self.num_used_slots = 0

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - self.num_used_slots

    def _holes(self) -> list[tuple[int, int]]:
        """(start, length) of every gap between held ranges, in address order."""
        holes, cursor = [], 0
        for start, owner in zip(self._starts, self._owners):
            if start > cursor:
                holes.append((cursor, start - cursor))
            cursor = start + self._ranges[owner][1]
        if cursor < self.num_slots:
            holes.append((cursor, self.num_slots - cursor))
        return holes

    def _first_fit(self, num_slots: int) -> int | None:
        return next((start for start, length in self._holes() if length >= num_slots), None)

    def can_allocate(self, num_slots: int) -> bool:
        """Is there one hole of at least `num_slots` slots? (Enough free slots in total is not enough.)"""
        return self._first_fit(num_slots) is not None

    def allocate(self, request_id: int, num_slots: int) -> int:
        """Reserve `num_slots` contiguous slots in the first hole that fits; returns the range's start."""
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        if request_id in self._ranges:
            raise ValueError(f"request {request_id} already holds slots {self._ranges[request_id]}")
        start = self._first_fit(num_slots)
        if start is None:
            raise ValueError(
                f"cannot allocate {num_slots} contiguous slots for request {request_id}: {self.num_free_slots} "
                f"of {self.num_slots} slots are free, but the largest hole has {self.largest_free_extent}"
            )
        index = bisect.bisect_left(self._starts, start)
        self._starts.insert(index, start)
        self._owners.insert(index, request_id)
        self._ranges[request_id] = (start, num_slots)
        self.num_used_slots += num_slots
        return start

    def free(self, request_id: int) -> None:
        """Release the range held by `request_id`; it merges with neighbouring holes by construction."""
        if request_id not in self._ranges:
            raise ValueError(f"request {request_id} holds no slots")
        start, length = self._ranges.pop(request_id)
        index = bisect.bisect_left(self._starts, start)
        del self._starts[index], self._owners[index]
        self.num_used_slots -= length

    def segments(self) -> list[Segment]:
        """The whole pool in address order, held ranges and holes alternating as they fall."""
        segments = [Segment(start, self._ranges[owner][1], owner) for start, owner in zip(self._starts, self._owners)]
        segments += [Segment(start, length, None) for start, length in self._holes()]
        return sorted(segments, key=lambda segment: segment.start)

    @property
    def largest_free_extent(self) -> int:
        return max((length for _, length in self._holes()), default=0)

    @property
    def external_fragmentation(self) -> float:
        """Share of the free slots that lie outside the largest hole (0.0 when nothing or one hole is free).

        Those slots are free but useless to a request bigger than every other hole: 0.0 means the free memory
        is one block, values near 1.0 mean it is crumbs.
        """
        return 0.0 if self.num_free_slots == 0 else 1.0 - self.largest_free_extent / self.num_free_slots

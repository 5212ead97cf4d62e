"""The waiting queue, in two policies: first come first served, or by priority.

Both queues hold sequences and answer the same five verbs, so the scheduler never asks which policy it runs:
`add` a new arrival, `prepend` a preempted sequence (it goes back to the front of the line), `peek`/`pop` the
next to admit, `remove` an aborted one.

Where this lives in vLLM: `vllm/v1/core/sched/request_queue.py` (`FCFSRequestQueue`, `PriorityRequestQueue`,
`SchedulingPolicy`).
"""

import heapq
from collections import deque
from collections.abc import Iterator
from enum import Enum

from solutions.core.sequence import Sequence


class SchedulingPolicy(Enum):
    FCFS = "fcfs"  # arrival order
    PRIORITY = "priority"  # lower `priority` first; arrival order breaks ties


class FCFSRequestQueue:
    """A deque in arrival order; a preempted sequence is put back at the front (it arrived before the rest)."""

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self._queue.append(seq)

    def prepend(self, seq: Sequence) -> None:
        self._queue.appendleft(seq)

    def peek(self) -> Sequence:
        return self._queue[0]

    def pop(self) -> Sequence:
        return self._queue.popleft()

    def remove(self, seq: Sequence) -> None:
        self._queue.remove(seq)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)


class PriorityRequestQueue:
    """A binary heap keyed by (priority, arrival, seq_id): O(log n) add and pop.

    `prepend` is `add`: a preempted sequence's key already places it ahead of everything that arrived after it
    at its priority. The seq_id in the key keeps the order total (samples of one request share an arrival).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Sequence]] = []

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.priority, seq.arrival, seq.seq_id, seq))

    prepend = add

    def peek(self) -> Sequence:
        return self._heap[0][3]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[3]

    def remove(self, seq: Sequence) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not seq]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        """In the order `pop` would hand them out."""
        return iter([entry[3] for entry in sorted(self._heap, key=lambda e: e[:3])])


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    return FCFSRequestQueue() if policy is SchedulingPolicy.FCFS else PriorityRequestQueue()

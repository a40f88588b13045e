"""The waiting queue of a policy whose key is fixed at queueing (sjf, srpt, priority, edf), compiled.

The scheduler reads the queue's head, length and truth at every admission and pushes and pops at
every arrival, admission and preemption: kept in the compiled kernel (build_compiled.MODULES), none
of those calls runs an interpreted frame. Subclassable from interpreted code.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Any

from mypy_extensions import mypyc_attr

from policies.request import SequenceGroup


@mypyc_attr(allow_interpreted_subclasses=True)  # a policy may give its own (QueuePolicy.new_queue)
class KeyedQueue:
    """A waiting queue ordered by `key(group)`, fixed when the group is pushed: a heap (push and
    popleft in O(log n)); `[0]` is the smallest group, and iterating gives the groups in heap order.

    Invariant: `heap` is a heap of entries, each the key's items followed by the group, flat (so the
    heap compares the keys' first items directly, not two tuples holding them); keys are unique
    (they end with the group id), so a comparison is decided before the groups are reached."""

    def __init__(self, key: Callable[[SequenceGroup], Any]) -> None:  # a tuple (a list is taken too)
        self.key = key
        self.heap: list[tuple] = []

    def push(self, group: SequenceGroup, front: bool = False) -> None:
        key = self.key(group)
        heapq.heappush(self.heap, (key if isinstance(key, tuple) else tuple(key)) + (group,))  # a list key too

    def __getitem__(self, i: int) -> SequenceGroup:
        if i != 0:
            raise IndexError("KeyedQueue gives only its head, [0]")
        return self.heap[0][-1]

    def popleft(self) -> SequenceGroup:
        return heapq.heappop(self.heap)[-1]

    def __len__(self) -> int:
        return len(self.heap)

    def __iter__(self) -> Iterator[SequenceGroup]:
        return iter([entry[-1] for entry in self.heap])

    def remove(self, group: SequenceGroup) -> None:
        """Take `group` out (Scheduler.abort of a waiting request): O(n)."""
        kept = [entry for entry in self.heap if entry[-1] is not group]
        if len(kept) == len(self.heap):
            raise ValueError(f"group {group.group_id} is not waiting")
        heapq.heapify(kept)
        self.heap = kept

    def candidates(self) -> list[SequenceGroup]:
        """The group that comes first until something arrives: the head (keys are fixed)."""
        return [self.heap[0][-1]]

"""The simulator's waiting queue: groups already built, then arrived trace rows built only when reached.

An overloaded trace keeps millions of requests waiting (the issue's 10M-request trace: ~4.6 M at once).
As objects they dominated the run's memory, yet the Scheduler only ever looks at the head of the queue
(FCFS: `head_admission`, `popleft`; preempted groups go back to the front). So a row becomes a
SequenceGroup only when it reaches the head: same order, same length, same decisions, and memory for
the queue's objects stays bounded by the requests that were preempted back into it.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from simulator.core.sequence import SequenceGroup


class PendingQueue:
    """A deque of SequenceGroups followed by the trace rows [next_row, end_row), built on demand.

    It offers what the Scheduler and the loop use of a deque: len, truth, [0], popleft, appendleft,
    append (only once no row is pending: order would break) and iteration.
    """

    __slots__ = ("_groups", "_make", "next_row", "end_row")

    def __init__(self, make_group: Callable[[int], SequenceGroup], start_row: int = 0):
        self._groups: deque[SequenceGroup] = deque()
        self._make = make_group
        self.next_row = start_row  # the first trace row not yet built
        self.end_row = start_row  # rows before this one have arrived

    def arrive(self, end_row: int) -> None:
        """Rows up to `end_row` (exclusive) have arrived: they queue behind everything else."""
        self.end_row = end_row

    def _build(self) -> SequenceGroup:
        group = self._make(self.next_row)
        self.next_row += 1
        self._groups.append(group)
        return group

    def close(self) -> None:
        """No row will be built any more: drop the builder, which refers back to the run (the run's one
        reference cycle), so that a finished run is freed as soon as it is dropped."""
        self._make = None

    def __len__(self) -> int:
        return len(self._groups) + self.end_row - self.next_row

    def __bool__(self) -> bool:
        return bool(self._groups) or self.next_row < self.end_row

    def __getitem__(self, index: int) -> SequenceGroup:
        if index != 0:
            raise IndexError("the waiting queue is read at its head only")
        if self._groups:
            return self._groups[0]
        if self.next_row < self.end_row:
            return self._build()
        raise IndexError("the waiting queue is empty")

    def popleft(self) -> SequenceGroup:
        """Take the head."""
        if not self._groups and self.next_row < self.end_row:
            self._build()
        return self._groups.popleft()

    def appendleft(self, group: SequenceGroup) -> None:
        """Put a (preempted) group back at the front."""
        self._groups.appendleft(group)

    def append(self, group: SequenceGroup) -> None:
        """Queue a group at the tail (only while no row is pending)."""
        if self.next_row < self.end_row:
            raise RuntimeError("cannot queue a group behind trace rows that are still pending")
        self._groups.append(group)

    def __iter__(self) -> Iterator[SequenceGroup]:
        """Every waiting group, in order (this builds the pending rows)."""
        while self.next_row < self.end_row:
            self._build()
        return iter(self._groups)

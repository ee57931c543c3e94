"""The scheduler's running groups: a list's order and reads, with removal by identity in O(1).

Fast mode removes one finished group per step from ~max_num_seqs running ones, and a finished group sits
anywhere in admission order (measured: uniformly), so `list.remove` scanned half the list every time: a few
percent of a long simulation. An insertion-ordered dict keyed by the group (identity hash) keeps the order
and drops a group directly.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from simulator.core.sequence import SequenceGroup


class RunningGroups:
    """Groups in admission order (the last one is preempted first); iterate, index, append, remove."""

    __slots__ = ("_groups",)

    def __init__(self, groups: Iterable[SequenceGroup] = ()) -> None:
        self._groups: dict[SequenceGroup, None] = dict.fromkeys(groups)

    def __len__(self) -> int:
        return len(self._groups)

    def __bool__(self) -> bool:
        return bool(self._groups)

    def __iter__(self) -> Iterator[SequenceGroup]:
        return iter(self._groups)

    def __reversed__(self) -> Iterator[SequenceGroup]:
        return reversed(self._groups)

    def __contains__(self, group: object) -> bool:
        return group in self._groups

    def __getitem__(self, index: int | slice) -> SequenceGroup | list[SequenceGroup]:
        """By position, as a list would (O(n): for inspection, not for the scheduler's loops)."""
        return list(self._groups)[index]

    def __add__(self, other: Iterable[SequenceGroup]) -> list[SequenceGroup]:
        return [*self._groups, *other]

    def __radd__(self, other: Iterable[SequenceGroup]) -> list[SequenceGroup]:
        return [*other, *self._groups]

    def __repr__(self) -> str:
        return f"RunningGroups({[g.request_id for g in self._groups]})"

    def append(self, group: SequenceGroup) -> None:
        """Add a group at the end (the newest)."""
        if group in self._groups:
            raise ValueError(f"request {group.request_id} is already running")
        self._groups[group] = None

    def remove(self, group: SequenceGroup) -> None:
        """Drop a group wherever it is."""
        try:
            del self._groups[group]
        except KeyError:
            raise ValueError(f"request {group.request_id} is not running") from None

    def clear(self) -> None:
        """Drop every group."""
        self._groups.clear()

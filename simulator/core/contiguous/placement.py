"""Placement of contiguous regions in a linear slot space: binary buddy and first-fit."""
from __future__ import annotations

import bisect

from simulator.core.errors import AllocationError, ConfigError


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


class BuddyPlacement:
    """Binary buddy allocation over `capacity` slots.

    A capacity that is not a power of two is split into aligned power-of-two roots (largest first), each
    its own buddy tree; buddies never merge across roots. Lowest address first, so runs are deterministic.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ConfigError(f"contiguous pool needs at least one slot, got {capacity}")
        self.capacity = capacity
        self._roots: list[tuple[int, int]] = []  # (start, order), sorted by start
        start = 0
        while start < capacity:
            order = (capacity - start).bit_length() - 1
            self._roots.append((start, order))
            start += 1 << order
        self._max_order = max(o for _, o in self._roots)
        self._free: list[list[int]] = [[] for _ in range(self._max_order + 1)]
        for s, o in self._roots:
            bisect.insort(self._free[o], s)
        self._order: dict[int, int] = {}  # allocated start -> order
        self.total_free = capacity
        self._empty_room: dict[int, int] = {}  # order -> regions of that order the empty pool holds

    def placed_size(self, size: int) -> int:
        """Slots actually taken for a request of `size` slots."""
        return next_pow2(size)

    @property
    def max_size(self) -> int:
        """Largest request that can ever be placed."""
        return 1 << self._max_order

    def empty_room(self, size: int) -> int:
        """How many regions of `size` slots the empty pool holds."""
        k = (size - 1).bit_length()
        room = self._empty_room.get(k)
        if room is None:  # depends on the roots only
            room = self._empty_room[k] = sum(1 << (o - k) for _, o in self._roots if o >= k)
        return room

    def can_fit(self, size: int, count: int = 1) -> bool:
        """Whether `count` regions of `size` slots fit now."""
        k = (size - 1).bit_length()
        if count <= 0:
            return True
        if k > self._max_order:
            return False
        free = self._free
        room = 0
        for j in range(k, self._max_order + 1):
            if free[j]:
                room += len(free[j]) << (j - k)
                if room >= count:
                    return True
        return False

    def alloc(self, size: int) -> int:
        """Place a region of `size` slots; return its start."""
        k = (size - 1).bit_length()
        for j in range(k, self._max_order + 1):
            if self._free[j]:
                start = self._free[j].pop(0)
                while j > k:
                    j -= 1
                    bisect.insort(self._free[j], start + (1 << j))
                self._order[start] = k
                self.total_free -= 1 << k
                return start
        raise AllocationError(f"no free buddy block of {1 << k} slots")

    def free(self, start: int) -> None:
        """Release the region at `start`, merging buddies back up to the root."""
        k = self._order.pop(start)
        self.total_free += 1 << k
        root_order = self._roots[bisect.bisect_right(self._roots, (start, 1 << 62)) - 1][1]
        while k < root_order:
            buddy = start ^ (1 << k)
            lst = self._free[k]
            i = bisect.bisect_left(lst, buddy)
            if i == len(lst) or lst[i] != buddy:
                break
            lst.pop(i)
            start = min(start, buddy)
            k += 1
        bisect.insort(self._free[k], start)

    def free_spans(self) -> list[tuple[int, int]]:
        """Every free chunk as (start, size)."""
        return [(s, 1 << j) for j, lst in enumerate(self._free) for s in lst]

    def usable_free(self, size: int) -> int:
        """Free slots that regions of `size` slots could occupy."""
        k = (size - 1).bit_length()
        return sum(len(self._free[j]) << j for j in range(k, self._max_order + 1))


class FirstFitPlacement:
    """First-fit over a sorted list of holes, coalescing neighbours on free."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ConfigError(f"contiguous pool needs at least one slot, got {capacity}")
        self.capacity = capacity
        self._starts = [0]
        self._sizes = [capacity]
        self._size_of: dict[int, int] = {}
        self.total_free = capacity

    def placed_size(self, size: int) -> int:
        """Slots actually taken for a request of `size` slots."""
        return size

    @property
    def max_size(self) -> int:
        """Largest request that can ever be placed."""
        return self.capacity

    def empty_room(self, size: int) -> int:
        """How many regions of `size` slots the empty pool holds."""
        return self.capacity // size

    def can_fit(self, size: int, count: int = 1) -> bool:
        """Whether `count` regions of `size` slots fit now (first-fit packs equal sizes greedily)."""
        return sum(h // size for h in self._sizes) >= count

    def can_fit_all(self, sizes: list[int]) -> bool:
        """Whether regions of `sizes` slots, placed in that order by `alloc`, all fit now."""
        holes = list(self._sizes)  # what `alloc` does to the holes' sizes, on a copy
        for size in sizes:
            for i, hole in enumerate(holes):
                if hole >= size:
                    holes[i] -= size
                    break
            else:
                return False
        return True

    def alloc(self, size: int) -> int:
        """Place a region in the lowest hole that holds it; return its start."""
        for i, hole in enumerate(self._sizes):
            if hole >= size:
                start = self._starts[i]
                if hole == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                self._size_of[start] = size
                self.total_free -= size
                return start
        raise AllocationError(f"no hole of {size} slots")

    def free(self, start: int) -> None:
        """Release the region at `start` and merge it with adjacent holes."""
        size = self._size_of.pop(start)
        self.total_free += size
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and start + size == self._starts[i]:  # merge with the hole after
            size += self._sizes[i]
            del self._starts[i], self._sizes[i]
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:  # and with the hole before
            self._sizes[i - 1] += size
        else:
            self._starts.insert(i, start)
            self._sizes.insert(i, size)

    def free_spans(self) -> list[tuple[int, int]]:
        """Every hole as (start, size)."""
        return list(zip(self._starts, self._sizes, strict=True))

    def usable_free(self, size: int) -> int:
        """Free slots that regions of `size` slots could occupy."""
        return sum(h // size * size for h in self._sizes)


PLACEMENTS = {"buddy": BuddyPlacement, "first-fit": FirstFitPlacement}

"""One tier of a tier_lru.NumberedLRU as the rest of the core reads a tier: its spec, its counters and the
blocks it holds (tier.Tier's attributes), all kept by the stack."""
from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from simulator.core.paged.tier import TierSpec, TierStats

if TYPE_CHECKING:
    from simulator.core.paged.tier_lru import NumberedLRU


class HeldKeys(Mapping):
    """The blocks tier `index` of a NumberedLRU holds, hash -> the pool's key, oldest first (by hash alone a
    block is found by a scan: LRUTier.holds is the indexed query)."""

    def __init__(self, stack: NumberedLRU, index: int) -> None:
        self.stack, self.code = weakref.proxy(stack), index + 1  # a proxy: no cycle with the stack

    def __getitem__(self, h: int) -> tuple:
        s = self.stack
        g = s.find(h)
        if g is None or s.where[g - s.base] != self.code:
            raise KeyError(h)
        return s.keys[g - s.base]

    def __contains__(self, h: object) -> bool:
        try:
            self[h]
        except KeyError:
            return False
        return True

    def __len__(self) -> int:
        return self.stack.used[self.code - 1]

    def __iter__(self) -> Iterator[int]:
        s = self.stack
        for a, b in list(s.ranges[self.code - 1]):
            for g in range(a - s.base, b - s.base):
                if s.where[g] == self.code:
                    yield s.hashes[g]


class LRUTier:
    """One tier of a NumberedLRU: its spec, counters and held keys, read as tier.Tier's are."""

    lru = True

    def __init__(self, spec: TierSpec, stack: NumberedLRU, index: int) -> None:
        # A proxy: a cycle with the stack would keep a long run's entries alive until the cyclic
        # collector runs, instead of freeing them with the run.
        self.spec, self.stack, self.index = spec, weakref.proxy(stack), index
        self.keys = HeldKeys(stack, index)
        self.stats = TierStats()
        self.pending = 0  # blocks loaded from this tier since the step time last took them
        self.below: list[LRUTier] = []  # the tiers under this one, nearest first

    def holds(self, h: int, key: tuple) -> bool:
        """Whether this tier holds the block with hash `h` and the pool's key `key`."""
        s = self.stack
        g = s.entry(h, key[1])
        return g is not None and s.where[g - s.base] == self.index + 1

    @property
    def used(self) -> int:
        """Blocks held."""
        return self.stack.used[self.index]

    @property
    def capacity(self) -> int:
        """Blocks it may hold now."""
        return self.stack.caps[self.index]

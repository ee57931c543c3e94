"""Eviction policies for caches of prefix blocks: LRU, LFU and S3-FIFO, over keys that take a size.

Shared by the reuse analysis of a trace (traces/reuse.py simulates them at given capacities) and by the
KV tiers below the GPU (simulator/core/paged/tiers.py). Pure Python: each operation is O(1) amortised.
`admit` evicts to the cache's own capacity; `use` and `evict` let a holder that sizes its keys and its
room itself (a grouped tier, whose entries weigh their pages: simulator/core/paged/group_policy.py) evict
in the same order.

- `lru`: least recently used first.
- `lfu`: least frequently used first, the least recently used among equals (O(1) LFU: one LRU list per
  use count).
- `s3fifo`: S3-FIFO (Juncheng Yang et al., "FIFO queues are all you need for cache eviction", SOSP
  2023): new keys enter a small FIFO (10 % of the capacity); a key not reused before it leaves the small
  FIFO is dropped and remembered in a ghost FIFO, a reused one moves to the main FIFO, where keys reused
  since their last pass get another round. It is reuse-aware: a block read once (the private tail of a
  conversation that never returns) leaves before the shared and returning prefixes do.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class EvictionPolicy:
    """A cache of `capacity` units of size: `admit` inserts or refreshes a key and returns what left."""

    name = ""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"cache capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self.size: dict[Hashable, int] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self.size

    def __len__(self) -> int:
        return len(self.size)

    def admit(self, key: Hashable, size: int = 1) -> list[Hashable]:
        """Insert `key` (or refresh it, taking the larger size) and evict until the cache fits; the
        evicted keys, in eviction order. A key larger than the whole cache is not kept."""
        self.use(key, size)
        return self._evict_to_fit()

    def use(self, key: Hashable, size: int = 1) -> None:
        """Insert `key`, or count a use of it and grow it to `size` if larger, without evicting."""
        old = self.size.get(key)
        if old is None:
            self.size[key] = size
            self.used += size
            self._insert(key)
        else:
            self._hit(key)
            if size > old:
                self.size[key] = size
                self.used += size - old
                self._grow(key, size - old)

    def evict(self) -> Hashable:
        """Evict the next key in the policy's order (one must be held) and release its size; the key."""
        victim = self._victim()
        self.used -= self.size.pop(victim)
        return victim

    def resize(self, capacity: int) -> list[Hashable]:
        """Take a new capacity; the keys evicted to fit it, in eviction order."""
        self.capacity = capacity
        return self._evict_to_fit()

    def _evict_to_fit(self) -> list[Hashable]:
        evicted: list[Hashable] = []
        while self.used > self.capacity:
            evicted.append(self.evict())
        return evicted

    def remove(self, key: Hashable) -> None:
        """Drop `key` (loaded back to the GPU, or discarded) without counting it as an eviction."""
        size = self.size.pop(key)
        self.used -= size
        self._forget(key, size)

    # what each policy keeps
    def _hit(self, key: Hashable) -> None:
        raise NotImplementedError

    def _insert(self, key: Hashable) -> None:
        raise NotImplementedError

    def _victim(self) -> Hashable:
        """Take the next key to evict out of the policy's order (its size is released by the caller)."""
        raise NotImplementedError

    def _forget(self, key: Hashable, size: int) -> None:
        raise NotImplementedError

    def _grow(self, key: Hashable, by: int) -> None:
        """A held key grew by `by` units (only S3-FIFO keeps a sum to follow)."""


class LRU(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.order: OrderedDict[Hashable, None] = OrderedDict()

    def _hit(self, key):
        self.order.move_to_end(key)

    def _insert(self, key):
        self.order[key] = None

    def _victim(self):
        return self.order.popitem(last=False)[0]

    def _forget(self, key, size):
        del self.order[key]


class LFU(EvictionPolicy):
    """Least frequently used first; least recently used among keys of equal use count."""

    name = "lfu"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.count: dict[Hashable, int] = {}
        self.buckets: dict[int, OrderedDict[Hashable, None]] = {}
        self.lowest = 1

    def _move(self, key, count: int) -> None:
        self.count[key] = count
        self.buckets.setdefault(count, OrderedDict())[key] = None

    def _hit(self, key):
        c = self.count[key]
        bucket = self.buckets[c]
        del bucket[key]
        if not bucket:
            del self.buckets[c]
            if self.lowest == c:
                self.lowest = c + 1
        self._move(key, c + 1)

    def _insert(self, key):
        self._move(key, 1)
        self.lowest = 1

    def _victim(self):
        while self.lowest not in self.buckets:
            self.lowest += 1
        bucket = self.buckets[self.lowest]
        key, _ = bucket.popitem(last=False)
        if not bucket:
            del self.buckets[self.lowest]
        del self.count[key]
        return key

    def _forget(self, key, size):
        c = self.count.pop(key)
        bucket = self.buckets[c]
        del bucket[key]
        if not bucket:
            del self.buckets[c]


class S3FIFO(EvictionPolicy):
    """S3-FIFO: a small probationary FIFO, a main FIFO with second chances, a ghost FIFO of keys seen."""

    name = "s3fifo"
    SMALL = 0.1  # share of the capacity the small FIFO holds (the paper's choice)
    MAX_FREQ = 3  # the paper's two-bit counter

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.small: OrderedDict[Hashable, None] = OrderedDict()
        self.main: OrderedDict[Hashable, None] = OrderedDict()
        self.ghost: OrderedDict[Hashable, None] = OrderedDict()
        self.freq: dict[Hashable, int] = {}
        self.small_used = 0

    def _hit(self, key):
        self.freq[key] = min(self.freq[key] + 1, self.MAX_FREQ)

    def _insert(self, key):
        self.freq[key] = 0
        if key in self.ghost:  # seen recently enough to be remembered: straight to the main FIFO
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None
            self.small_used += self.size[key]

    def _victim(self):
        size, freq = self.size, self.freq
        while True:
            if self.small and (self.small_used > self.SMALL * self.capacity or not self.main):
                key, _ = self.small.popitem(last=False)
                self.small_used -= size[key]
                if freq[key] > 0:  # reused while on probation: promote
                    freq[key] = 0
                    self.main[key] = None
                    continue
                self.ghost[key] = None
                while len(self.ghost) > max(len(self.main), 1) * 2:
                    self.ghost.popitem(last=False)
                del freq[key]
                return key
            key, _ = self.main.popitem(last=False)
            if freq[key] > 0:  # a second chance for a key reused since its last pass
                freq[key] -= 1
                self.main[key] = None
                continue
            del freq[key]
            return key

    def _grow(self, key, by):
        if key in self.small:
            self.small_used += by

    def _forget(self, key, size):
        del self.freq[key]
        if key in self.small:
            del self.small[key]
            self.small_used -= size
        else:
            del self.main[key]


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRU, "lfu": LFU, "s3fifo": S3FIFO}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """A policy by name (lru, lfu, s3fifo) over `capacity` units."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](capacity)

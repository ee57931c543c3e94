"""A grouped KV tier's entries under LFU or S3-FIFO, each entry weighing the pages it holds.

kv_group_tiers.py keeps a tier's entries (range hash -> [content, extra key, group mask]) in an OrderedDict
in LRU order and evicts through the calls that order takes. `PolicyEntries` is a dict of the same entries
that gives those calls the meaning of a pagelab.eviction policy over the entries' page counts, so the
grouped tier code runs unchanged under every policy (and LRU keeps its OrderedDict):

- `entries[h] = e`: a new entry, admitted at `e`'s page count;
- `move_to_end(h)`: a use of the entry, one per page stored into it (a page joining it grows it to its
  new count) or loaded from it;
- `popitem(last=False)`: the policy's next victim, the tier evicting until its pages fit its capacity;
- `pop(h)`: the entry leaves without an eviction (it goes up to the top tier, or newer content of its
  range replaces it).

The victim order is the policy's, blind to weight (it picks the next entry; the tier takes as many as
make room):

- `lfu`: the fewest uses first, the least recently used among equals (the O(1) LFU of K. Shah, A. Mitra
  and D. Matani, "An O(1) algorithm for implementing the LFU cache eviction scheme", 2010);
- `s3fifo`: S3-FIFO (Juncheng Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023),
  its small FIFO sized at 10 % of the tier's pages, as the paper sizes it in bytes for objects of
  several sizes: an entry not used again before it leaves the small FIFO is evicted (and remembered in
  the ghost FIFO), a used one moves to the main FIFO.

With one group every entry weighs one page, and the order is that of the policy's `admit`.
"""
from __future__ import annotations

from pagelab.eviction import make_policy


class PolicyEntries(dict):
    """A grouped tier's entries by range hash, evicted by `tier.spec.policy` over their page counts."""

    def __init__(self, tier) -> None:
        super().__init__()
        self.tier = tier  # its capacity shrinks and grows with swap (S3-FIFO sizes its small FIFO by it)
        self.policy = make_policy(tier.spec.policy, tier.spec.num_blocks)

    def __setitem__(self, h: int, entry: list) -> None:
        super().__setitem__(h, entry)
        self.policy.use(h, entry[2].bit_count())

    def move_to_end(self, h: int) -> None:
        """A page of entry `h` was stored or loaded: a use, at the entry's page count."""
        self.policy.use(h, self[h][2].bit_count())

    def popitem(self, last: bool = False) -> tuple[int, list]:
        """Evict the policy's next victim at the tier's capacity; (range hash, entry)."""
        if last:
            raise ValueError("a tier under an eviction policy evicts only in the policy's order")
        self.policy.capacity = self.tier.capacity
        h = self.policy.evict()
        return h, super().pop(h)

    def pop(self, h: int, *default):
        """Take entry `h` out without an eviction (`default`, when given, if it is not held)."""
        if default and h not in self:
            return default[0]
        entry = super().pop(h)
        self.policy.remove(h)
        return entry

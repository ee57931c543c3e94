"""The data moves of the KV tiers of a model with several KV cache groups (kv_group_tiers.GroupTiers), for
a driver that keeps real KV data in them (the engine), as tier_log.TierLog does for one group.

A GroupTiers entry holds the pages of several groups of one block's token range; the driver keeps one
page per slot, keyed by (range hash, group). The log mirrors which tier holds each page and, after each
change of the tiers, records the difference as one frame: pages dropped, pages moved between the tiers
and the page just stored from the GPU. Changes are seen from the tiers' entry dicts (replaced by
`_noted`, which notes each range they gain or lose) and from GroupTiers' hooks (a page stored, a page
loaded), so the eviction code that moves entries between the tiers needs no hook of its own.

Ops, in order:
- ("read", token, bid): a page the GPU pool hands down is in GPU block `bid` now; the driver reads it
  before anything writes the pool (its block may be re-taken in the same step), for the frame that
  stores it under `token` (that frame may come in a later step).
- ("frame", changes, token): the tiers changed; each change is (page, from tier, to tier): from None is
  the page read under `token`, to None a drop. A driver reads every moving page before it frees any
  slot, so moves between two full tiers need no spare slot. `token` is consumed, stored or not.
- ("load", tier, page, dst): the page is read from `tier` (where the frames so far put it) into GPU
  block `dst`, written after every read of the batch has taken what the GPU held.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from simulator.core.paged.group_policy import PolicyEntries
from simulator.core.paged.kv_group_tiers import mask_groups


class _Noting:
    """Notes each range hash whose entry arrives in or leaves a tier's entries (into `touched`), over the
    entries' own class (LRU's OrderedDict, or an eviction policy's PolicyEntries)."""

    touched: set

    def __setitem__(self, h, e) -> None:
        self.touched.add(h)
        super().__setitem__(h, e)

    def __delitem__(self, h) -> None:
        self.touched.add(h)
        super().__delitem__(h)

    def pop(self, h, *default):
        """The entries' pop, noted."""
        self.touched.add(h)
        return super().pop(h, *default)

    def popitem(self, *args, **kwargs):
        """The entries' popitem, noted."""
        h, e = super().popitem(*args, **kwargs)
        self.touched.add(h)
        return h, e


class _NotedLRU(_Noting, OrderedDict):
    """An LRU tier's entries, noted."""


class _NotedPolicy(_Noting, PolicyEntries):
    """A policy tier's entries, noted."""


def _noted(tier, touched: set) -> _Noting:
    """Empty entries for `tier` of the class it keeps, noting into `touched`."""
    keys = _NotedLRU() if type(tier.keys) is OrderedDict else _NotedPolicy(tier)
    keys.touched = touched
    return keys


class GroupTierLog:
    """The ordered data moves of one GroupTiers (see the module docstring for the ops)."""

    def __init__(self, tiers) -> None:
        self.tiers = tiers
        self.ops: list = []
        self.touched: set[int] = set()  # range hashes whose entries changed since the last frame
        # range hash -> (content, extra key, {group: tier name}) of the pages the driver's slots hold
        self.held: dict[int, tuple[object, object, dict[int, str]]] = {}
        self.tokens: deque[int] = deque()  # tokens of the pages handed down, in the order flush stores them
        self.next_token = 0

    def take(self) -> list:
        """The ops logged since the last call (the log is then empty)."""
        self._frame(None, None)
        ops, self.ops = self.ops, []
        return ops

    # ------------------------------------------------------------ hooks
    def hand(self, bid: int) -> None:
        """The GPU pool hands down the page in block `bid` (stored by a later `stored`, in this order)."""
        token = self.next_token
        self.next_token += 1
        self.ops.append(("read", token, bid))
        self.tokens.append(token)

    def stored(self, h: int, g: int) -> None:
        """GroupTiers stored the next handed page, group `g`'s of range `h` (it may have been dropped)."""
        self.touched.add(h)
        self._frame((h, g), self.tokens.popleft())

    def load(self, tier, h: int, g: int, dst: int) -> None:
        """Group `g`'s page of range `h` is read from `tier` into GPU block `dst`."""
        self._frame(None, None)
        self.ops.append(("load", tier.spec.name, (h, g), dst))

    # ------------------------------------------------------------ frames
    def _frame(self, new: tuple[int, int] | None, token: int | None) -> None:
        """Log how the pages of the touched ranges moved since the last frame; `new` is the only page that
        may enter the tiers from the GPU (read under `token`)."""
        touched, held = self.touched, self.held
        if not touched:
            if token is not None:
                self.ops.append(("frame", [], token))
            return
        changes = []
        for h in touched:
            content = extra = None
            pages: dict[int, str] = {}
            for tier in self.tiers.tiers:
                e = tier.keys.get(h)
                if e is not None:
                    content, extra = e[0], e[1]
                    pages.update(dict.fromkeys(mask_groups(e[2]), tier.spec.name))
            old = held.pop(h, None)
            before = {} if old is None else old[2]
            if before and pages and not (old[0] == content and old[1] == extra):  # a colliding range
                changes.extend(((h, g), t, None) for g, t in before.items())
                before = {}
            for g, t in before.items():
                if pages.get(g) != t:
                    changes.append(((h, g), t, pages.get(g)))
            for g, t in pages.items():
                if g not in before:
                    if (h, g) != new:
                        raise RuntimeError(f"KV tiers: page {g} of range {h:#x} entered {t} from nowhere")
                    changes.append(((h, g), None, t))
            if pages:
                held[h] = (content, extra, pages)
        touched.clear()
        if changes or token is not None:
            self.ops.append(("frame", changes, token))

    def pages(self, name: str) -> set[tuple[int, int]]:
        """The pages the log says tier `name` holds."""
        return {(h, g) for h, (_, _, p) in self.held.items() for g, t in p.items() if t == name}


def attach_group_log(bm, log: GroupTierLog) -> None:
    """Record the data moves of the GroupTiers attached to GroupedBlockManager `bm` (attach_groups) into
    `log`: the GPU block of each page the pool hands down is noted while the pool still maps it."""
    tiers, pool = bm.tiers, bm.pool
    if any(t.keys for t in tiers.tiers) or tiers.queue:
        raise RuntimeError("a GroupTierLog must be attached before the tiers hold anything")
    for tier in tiers.tiers:
        tier.keys = _noted(tier, log.touched)
    tiers.log = log
    cached, queue = pool.cached, tiers.queue

    def hand(hashes: list[int], keys: list[tuple]) -> None:
        for h, key in zip(hashes, keys, strict=True):
            log.hand(cached[h])
            queue.append((h, key))

    if tiers.eager:
        pool.on_release = hand
    else:
        pool.on_evict = hand

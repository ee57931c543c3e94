"""A stack of LRU tiers (CPU over disk) kept as one log of numbered entries.

A tier stack sees every block the GPU evicts, millions over a long multi-turn trace, and a disk tier
holds a million of them: an ordered map per tier costs a map insert and a pop per block in each tier it
passes. Here each block a tier takes gets the next entry number; `loc` maps its content key (below) to
that number, and `where` (one byte per entry) says which tier holds it (0: it left). A tier's LRU order is
a queue of ranges of entry numbers, oldest first. Evicting the oldest blocks of a tier into the one below
relabels their bytes and hands the range over (`bytes.translate`, C speed): a block keeps its number
while it moves down, so a spill costs per range, not per block. The per-block map work is `loc`: once
when a block enters the top tier and once when it leaves the bottom one. A block used again (loaded, or
stored while held) takes a new number at the end of its tier's order; its old entry is marked as left.

A batch is stored as one block at a time would store it (`PolicyTiers` with LRU, the rules the tests
compare against) unless a block of the batch that some tier holds could leave that tier before its own
turn comes, or a content key repeats, or a block of it is indexed in `clash`; such a batch is stored
one block at a time.

The index (`loc`) is keyed by each block's content key, not its chained hash: a trace's block ids are
numbered as they first appear, so the blocks of one prompt, stored and looked up together, sit side by
side in the index. With a million blocks held, a map keyed by random hashes takes a cache miss per
probe, several times the cost of one keyed by neighbouring ids. An entry's hash confirms what the index
finds (a hash names one block: the pool's chained hash of its key). A block whose content key another
held block has (the same content under another prefix or extra key) is indexed by its hash in `clash`.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Hashable
from itertools import compress, repeat
from operator import itemgetter, lt, sub

from simulator.core.paged.lru_tier import LRUTier
from simulator.core.paged.tier import TierSpec

_drain = deque(maxlen=0).extend  # runs a map's calls at C speed, keeping nothing
_CONTENT = itemgetter(1)  # of the pool's key, (parent key, content, extra key)


class NumberedLRU:
    """LRU tiers, top first, as numbered entries (see the module docstring)."""

    def __init__(self, specs: list[TierSpec]) -> None:
        n = len(specs)
        self.loc: dict[object, int] = {}  # content key -> entry number of the block stored under it
        self.clash: dict[int, int] = {}  # hash -> entry number, of blocks whose content key another has
        # entry - base -> the block's hash and the pool's key (None once it left); two lists, not one of
        # pairs: a million tuples held would crowd the caches the pool's own maps run from
        self.hashes: list[int | None] = []
        self.keys: list[tuple | None] = []
        self.where = bytearray()  # entry - base -> 1 + index of the tier holding it; 0 once it left
        self.base = 0  # entry number of keys[0]: entries below it are gone
        self.compact_min = 1 << 16  # entries kept before the first compaction (tests make it small)
        self.compact_at = self.compact_min
        self.ranges: list[deque[list[int]]] = [deque() for _ in specs]  # [start, end) per tier, oldest first
        self.used = [0] * n
        self.caps = [s.num_blocks for s in specs]
        self.tiers = [LRUTier(s, self, i) for i, s in enumerate(specs)]
        for i, tier in enumerate(self.tiers):
            tier.below = self.tiers[i + 1:]
        # bytes.translate tables, per tier: its code moved one tier down, its code cleared, its code as 1
        codes = range(1, n + 1)
        self.down = [bytes.maketrans(bytes([c]), bytes([c + 1])) for c in codes]
        self.gone = [bytes.maketrans(bytes([c]), b"\0") for c in codes]
        self.pick = [bytes(int(b == c) for b in range(256)) for c in codes]
        self.log = None  # a tier_log.TierLog when a driver keeps the blocks' data

    # ----------------------------------------------------------------- queries
    def lookup(self, h: int, content: Hashable) -> tuple | None:
        """(tier, key) of the block stored under hash `h` with content key `content`, if a tier holds it."""
        g = self.loc.get(content)  # `entry` inlined: a prompt's every block past its GPU hits asks
        if g is None or self.hashes[g - self.base] != h:
            g = self.clash.get(h) if self.clash else None
            if g is None:
                return None
        g -= self.base
        return self.tiers[self.where[g] - 1], self.keys[g]

    def entry(self, h: int, content: Hashable) -> int | None:
        """The entry number of the held block with hash `h` and content key `content`, if any."""
        base, hashes = self.base, self.hashes
        g = self.loc.get(content)
        # A batch being stored maps its keys before it appends their entries: not held yet.
        if g is not None and g - base < len(hashes) and hashes[g - base] == h:
            return g
        g = self.clash.get(h) if self.clash else None
        return g if g is not None and g - base < len(hashes) else None

    def find(self, h: int) -> int | None:
        """The entry number of the held block with hash `h`, knowing only the hash: a scan of the entries,
        for tests (the tiers' own paths know each block's key)."""
        try:
            return self.base + self.hashes.index(h)
        except ValueError:
            return None

    def _apart(self, hashes: list[int]) -> bool:
        """Whether a block of `hashes` is indexed by its hash (in `clash`)."""
        return bool(self.clash) and not self.clash.keys().isdisjoint(hashes)

    def _slot(self, h: int, content: Hashable) -> tuple[dict, object]:
        """The index holding the block with hash `h` and content key `content`, and its key there."""
        return (self.clash, h) if h in self.clash else (self.loc, content)

    # ----------------------------------------------------------------- mutations
    def store(self, hashes: list[int], keys: list[tuple]) -> None:
        """Store blocks (`hashes` and the pool's `keys`) into the top tier as one `put` at a time would, in
        order."""
        n, loc = len(hashes), self.loc
        contents = list(map(_CONTENT, keys))
        if self._apart(hashes):
            self._store_apart(hashes, keys)
            return
        g0 = self.base + len(self.keys)
        numbers = range(g0, g0 + n)
        # One probe per block maps the new keys to their entries and finds the ones some tier holds.
        before = len(loc)
        olds = list(map(loc.setdefault, contents, numbers))
        held: list[int] = []
        remap: tuple = ()
        if len(loc) - before != n:  # a key was mapped already
            older = list(map(lt, olds, repeat(g0)))
            held = list(compress(olds, older))
            # A key another held block has, a key twice in the batch (a second probe finds this batch's
            # entry, or the held one again), or a held entry that could leave before its turn: one block
            # at a time.
            others = list(map(self.hashes.__getitem__, map(sub, held, repeat(self.base))))
            if others != list(compress(hashes, older)) or len(loc) - before + len(held) != n or (
                    len(set(held)) != len(held)) or (n > 1 and self._may_leave_first(held, n)):
                for k, g in zip(contents, olds, strict=True):  # undo the mapping
                    if g >= g0:
                        loc.pop(k, None)
                self._store_apart(hashes, keys)
                return
            if held:
                remap = (loc, list(compress(contents, older)), list(compress(numbers, older)))
        self._put(hashes, keys, held, remap)

    def _store_apart(self, hashes: list[int], keys: list[tuple]) -> None:
        """Store blocks one at a time; a block whose content key another held block has is indexed by its
        hash in `clash`."""
        loc, clash = self.loc, self.clash
        for h, key in zip(hashes, keys, strict=True):
            k = key[1]
            g0 = self.base + len(self.keys)
            g = clash.get(h)
            if g is not None:  # held, indexed apart
                self._put([h], [key], [g], (clash, [h], [g0]))
                continue
            g = loc.setdefault(k, g0)
            if g == g0:
                self._put([h], [key], [], ())
            elif self.hashes[g - self.base] == h:  # held
                self._put([h], [key], [g], (loc, [k], [g0]))
            else:  # another held block has its content key
                clash[h] = g0
                self._put([h], [key], [], ())

    def _put(self, hashes: list[int], keys: list[tuple], held: list[int], remap: tuple) -> None:
        """Append blocks to the top tier: entries `held` (of those some tier holds) leave, and `remap`,
        (index, keys in it, entry numbers) points the index at their new entries; new blocks are mapped
        already."""
        top, log = self.tiers[0], self.log
        if log is not None:
            log.entering(top, list(zip(hashes, keys, strict=True)))
        refreshed = self._leave(held)
        if remap:
            index, moved, numbers = remap
            index.update(zip(moved, numbers, strict=True))
        self._append(0, hashes, keys)
        top.stats.stored_blocks += len(hashes) - refreshed
        self._trim(0)
        if log is not None:
            log.entered(top)

    def touch(self, i: int, hashes: list[int], keys: list[tuple]) -> None:
        """Blocks of tier `i` (hashes and keys) were used again, in this order: they become its newest."""
        contents = list(map(_CONTENT, keys))
        apart = self._apart(hashes)
        if apart:
            slots = list(map(self._slot, hashes, contents))
            gs = [index[k] for index, k in slots]
        else:
            gs = list(map(self.loc.__getitem__, contents))
        self._leave(gs)
        g0 = self.base + len(self.keys)
        numbers = range(g0, g0 + len(hashes))
        if apart:
            for (index, k), g in zip(slots, numbers, strict=True):
                index[k] = g
        else:
            self.loc.update(zip(contents, numbers, strict=True))
        self._append(i, hashes, keys)

    def resize(self, i: int, capacity: int) -> None:
        """Give tier `i` a new capacity; what it evicts goes one tier down."""
        self.caps[i] = capacity
        self._trim(i)

    # ----------------------------------------------------------------- internals
    def _append(self, i: int, hashes: list[int], keys: list[tuple]) -> None:
        """New entries, in order, at the newest end of tier `i` (the caller maps their hashes)."""
        g0, n = self.base + len(self.keys), len(keys)
        self.hashes.extend(hashes)
        self.keys.extend(keys)
        self.where.extend(bytes([i + 1]) * n)
        q = self.ranges[i]
        if q and q[-1][1] == g0:
            q[-1][1] = g0 + n
        else:
            q.append([g0, g0 + n])
        self.used[i] += n

    def _leave(self, gs: list[int]) -> int:
        """Mark entries `gs` as left (their blocks move or refresh); how many were in the top tier."""
        if not gs:
            return 0
        where, used = self.where, self.used
        at = list(map(sub, gs, repeat(self.base)))
        codes = bytes(map(where.__getitem__, at))
        for i in range(len(used)):
            used[i] -= codes.count(i + 1)
        _drain(map(where.__setitem__, at, repeat(0)))
        _drain(map(self.hashes.__setitem__, at, repeat(None)))
        _drain(map(self.keys.__setitem__, at, repeat(None)))
        return codes.count(1)

    def _nth(self, code: int, a: int, b: int, k: int) -> int:
        """The entry number just past the `k`-th entry of tier `code` in [a, b) (it has at least `k`)."""
        base, where = self.base, self.where
        lo, hi = a - base + k, b - base  # the answer lies in [lo, hi]: at least k entries precede it
        if where.count(code, a - base, lo) == k:
            return lo + base
        while lo < hi:  # the shortest prefix holding k entries of the tier; each count runs at C speed
            mid = (lo + hi) // 2
            if where.count(code, a - base, mid) >= k:
                hi = mid
            else:
                lo = mid + 1
        return lo + base

    def _may_leave_first(self, held: list[int], n: int) -> bool:
        """Whether a held entry is among those that storing `n` blocks could evict before its turn: the
        top tier's oldest (as many as it overflows by), each lower tier's oldest `n` (each block stored
        moves at most one down)."""
        base, where = self.base, self.where
        codes = bytes(map(where.__getitem__, map(sub, held, repeat(base))))
        for i, q in enumerate(self.ranges):
            code = i + 1
            mine = sorted(compress(held, codes.translate(self.pick[i])))
            left = min(n, self.used[0] + n - self.caps[0]) if i == 0 else n
            if not mine or left <= 0:
                continue
            for a, b in q:
                live = where.count(code, a - base, b - base)
                end = self._nth(code, a, b, left) if live >= left else b
                j = bisect_left(mine, a)
                if j < len(mine) and mine[j] < end:
                    return True
                left -= live
                if left <= 0:
                    break
        return False

    def _trim(self, i: int) -> None:
        """Evict tier `i`'s oldest blocks down to its capacity: into the tier below, or dropped."""
        over = self.used[i] - self.caps[i]
        if over <= 0:
            return
        code, q, base, where = i + 1, self.ranges[i], self.base, self.where
        out: list[tuple[int, int]] = []
        left = over
        while left:
            seg = q[0]
            a, b = seg
            live = where.count(code, a - base, b - base)
            if live <= left:
                q.popleft()
                cut, left = b, left - live
            else:
                cut = seg[0] = self._nth(code, a, b, left)
                left = 0
            if live:
                out.append((a, cut))
        tier = self.tiers[i]
        self.used[i] -= over
        tier.stats.evicted_blocks += over
        log = self.log
        evicted = self._held_pairs(code, out) if log is not None else None
        if log is not None:
            log.spilling(tier, evicted)
        if not tier.below:
            self._drop(i, out)
            return
        lower = tier.below[0]
        if log is not None:
            log.entering(lower, evicted)
        table, dq = self.down[i], self.ranges[i + 1]
        for a, cut in out:
            where[a - base:cut - base] = where[a - base:cut - base].translate(table)
            if dq and dq[-1][1] == a:
                dq[-1][1] = cut
            else:
                dq.append([a, cut])
        self.used[i + 1] += over
        lower.stats.stored_blocks += over
        self._trim(i + 1)
        if log is not None:
            log.entered(lower)

    def _held_pairs(self, code: int, spans: list[tuple[int, int]]) -> list[tuple[int, tuple]]:
        """The (hash, key) pairs tier `code` holds in `spans`, in order."""
        base, pick, where = self.base, self.pick[code - 1], self.where
        out: list[tuple[int, tuple]] = []
        for a, b in spans:
            held = where[a - base:b - base].translate(pick)
            out += zip(compress(self.hashes[a - base:b - base], held),
                       compress(self.keys[a - base:b - base], held), strict=True)
        return out

    def _drop(self, i: int, spans: list[tuple[int, int]]) -> None:
        """Blocks of the bottom tier `i` in `spans` leave the stack."""
        base, where, hashes, pick = self.base, self.where, self.hashes, self.pick[i]
        for a, b in spans:
            held = where[a - base:b - base]
            mine = held.translate(pick)
            contents = list(map(_CONTENT, compress(self.keys[a - base:b - base], mine)))
            hs = list(compress(hashes[a - base:b - base], mine)) if self.clash else []
            if self._apart(hs):
                for index, k in map(self._slot, hs, contents):
                    del index[k]
            else:
                _drain(map(self.loc.__delitem__, contents))
            where[a - base:b - base] = held.translate(self.gone[i])
            hashes[a - base:b - base] = self.keys[a - base:b - base] = [None] * (b - a)
        if len(hashes) >= self.compact_at:
            self._compact()

    def _compact(self) -> None:
        """Forget the entries before the oldest one any tier's order still covers."""
        starts = [a for q in self.ranges for a, _ in q]
        first = min(starts) if starts else self.base + len(self.keys)
        k = first - self.base
        if k:
            del self.hashes[:k]
            del self.keys[:k]
            del self.where[:k]
            self.base = first
        self.compact_at = max(self.compact_min, 2 * len(self.keys))

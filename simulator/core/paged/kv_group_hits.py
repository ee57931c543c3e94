"""Prefix caching for the GroupedBlockManager's tables (kv_group_tables.py): each sequence's chain of
content keys, each group's longest hit, the hit every group holds, and publishing.

Published blocks are keyed (group, chained key). A lookup compares whole keys, so a hash collision can never
alias two prefixes; the chain it walks takes over the pool's key objects as they match, which keeps each
comparison O(1) (equal tuples compare by identity first) instead of O(the chain's depth).

A waiting request's hit is asked for at every step while it waits (admission). The answer for the last
sequence asked is kept and reused while nothing it read can have changed: a publish can only lengthen a
hit, and an eviction changes it only when it evicts one of the blocks it found.
"""
from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from operator import itemgetter

from simulator.core.paged.prefix_cache import LINK_HASH, LINK_KEY, ROOT_HASH, chain_links, same_key
from simulator.core.sequence import Sequence


def _gather(blocks: list[list[int]]) -> Callable[[list], tuple]:
    """A function reading the entries of `blocks` (every group's, in order) out of a per-block list as
    one tuple: a waiting request's hit blocks are read at every step it waits."""
    flat = [b for per_group in blocks for b in per_group]
    if len(flat) > 1:
        return itemgetter(*flat)
    return lambda values: tuple(values[b] for b in flat)


class GroupHits:
    """Prefix keys, lookups and publishing over GroupTables' pool (a mixin: GroupTables holds the state)."""

    def init_hits(self) -> None:
        """No chain kept and no answer remembered yet."""
        self.chains: dict[int, list[tuple[tuple, int]]] = {}  # seq id -> (key, hash) of its full blocks
        self.publishes = 0  # blocks published so far: a remembered hit holds while this is unchanged
        # (sequence, its length, publishes, hit, blocks per group, chain, their reader) of the last lookup
        self.hit_memo: tuple | None = None

    def chain(self, seq: Sequence, upto: int) -> list[tuple[tuple, int]]:
        """(key, hash) of the sequence's first full blocks, at least `upto` of them where their content is
        known (the list may run longer: callers index it)."""
        # Kept only for held sequences (their blocks are published as they fill); a waiting one's lookups
        # rebuild it, so a request that is never admitted leaves nothing behind.
        out = self.chains.setdefault(seq.seq_id, []) if seq.seq_id in self.seqs else []
        return self.extend(seq, out, upto)

    def extend(self, seq: Sequence, out: list[tuple[tuple, int]], upto: int) -> list[tuple[tuple, int]]:
        """`out`, a chain of `seq`'s blocks, extended to `upto` links where their content is known."""
        if len(out) < upto:
            out += chain_links(seq, len(out), upto, out[-1] if out else (None, ROOT_HASH), self.hash_fn,
                               self.block_size)
        return out

    def cached(self, g: int, link: tuple[tuple, int]) -> int | None:
        """The block of group `g` published under `link`, if any (whole keys compared)."""
        bid = self.pool.cached.get(self.hash_fn((g, link[1])))
        if bid is None:
            return None
        stored = self.pool.key[bid]
        return bid if stored[0] == g and same_key(stored[1], link[0]) else None

    def find(self, g: int, chain: list, i: int) -> int | None:
        """`cached(g, chain[i])`; on a hit, link `i` takes the pool's (equal) key object."""
        key, h = chain[i]
        bid = self.pool.cached.get(self.hash_fn((g, h)))
        if bid is None:
            return None
        stored = self.pool.key[bid]
        if stored[1] is not key:
            if stored[0] != g or not same_key(stored[1], key):
                return None
            chain[i] = (stored[1], h)
        elif stored[0] != g:
            return None
        return bid

    def group_hit(self, g: int, seq: Sequence, chain: list, max_blocks: int) -> int:
        """Blocks of the longest hit of group `g` within `max_blocks` (`find_longest_cache_hit`): a full
        group's leading run of cached blocks; a sliding group's last `need` cached blocks before the
        hit's end, scanned from the right, or its leading run when shorter than `need`. The chain of
        content keys is extended only as far as the scan reads."""
        need = self.specs[g].need
        find = self.find
        if not need:
            for i in range(max_blocks):
                if len(chain) <= i and len(self.extend(seq, chain, i + 1)) <= i:
                    return i
                if find(g, chain, i) is None:
                    return i
            return max_blocks
        max_blocks = min(max_blocks, len(self.extend(seq, chain, max_blocks)))
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            if find(g, chain, i) is None:
                run = 0
                continue
            run += 1
            if run >= need:
                return i + need
        return run

    def longest_hit(self, seq: Sequence) -> tuple[int, list[list[int]]]:
        """The prefix hit in blocks that every group holds (the coordinator shrinks it until each group's
        hit reaches it; full groups first, as their hits cut the sliding groups' scans short), and each
        group's hit blocks (a sliding group's from its window start). The lists are shared: read only."""
        if not self.enabled or (seq.token_ids is None and not seq.prefix_keys):
            return 0, [[] for _ in self.specs]
        held = seq.seq_id in self.seqs
        memo = self.hit_memo
        if not held and memo is not None and memo[0] is seq and memo[1] == seq.length:
            if memo[2] == self.publishes and None not in memo[6](self.pool.key):  # none was evicted
                return memo[3], memo[4]
            chain = memo[5]
        else:
            chain = self.chains.get(seq.seq_id, []) if held else []
        hit = (seq.length - 1) // self.block_size
        changed = True
        while changed and hit:
            changed = False
            for g in self.hit_order:
                got = self.group_hit(g, seq, chain, hit)
                if got < hit:
                    hit, changed = got, True
        blocks = [[self.find(g, chain, i) for i in range(self.first_held(g, hit), hit)]
                  for g in range(self.num_groups)]
        if not held:
            self.hit_memo = (seq, seq.length, self.publishes, hit, blocks, chain, _gather(blocks))
        return hit, blocks

    def lookup_chain(self, seq: Sequence) -> list[tuple[tuple, int]] | None:
        """The chain the last lookup of `seq` built, if it was the last sequence looked up."""
        memo = self.hit_memo
        return memo[5] if memo is not None and memo[0] is seq and memo[1] == seq.length else None

    def num_held(self, blocks: list[list[int]]) -> int:
        """How many of `blocks` some sequence holds (hits on them take no free block)."""
        memo = self.hit_memo
        gather = memo[6] if memo is not None and memo[4] is blocks else _gather(blocks)
        refs = gather(self.pool.ref)
        return len(refs) - refs.count(0)

    def publish_range(self, seq: Sequence, start: int, stop: int) -> None:
        """Publish full blocks `start` to `stop` - 1 of `seq`, in that order, in every group that still holds
        them, under the group-tagged chained key of their content."""
        if not self.enabled or start >= stop:
            return
        chain = self.chain(seq, stop)
        stop = min(stop, len(chain))
        if start >= stop:
            return
        if self.bulk and self.tiers is None and self._publish_fresh(seq, chain, start, stop):
            return
        pool, hash_fn, tables = self.pool, self.hash_fn, self.tables[seq.seq_id]
        keys, hashes, setdefault = pool.key, pool.hash, pool.cached.setdefault
        tiers = self.tiers
        groups = range(len(tables))
        published = 0
        for i in range(start, stop):
            key, h = chain[i]
            for g in groups:
                bid = tables[g][i]
                if bid is None or keys[bid] is not None:
                    continue
                gh = hash_fn((g, h))
                keys[bid], hashes[bid] = (g, key), gh
                if setdefault(gh, bid) == bid and tiers is not None:  # tiers key pages by range, untagged
                    tiers.ranges[gh] = h
                published += 1
        if published:
            pool.plain = False
            self.publishes += published

    def _publish_fresh(self, seq: Sequence, chain: list, start: int, stop: int) -> bool:
        """The loop above, group by group as C-level maps, where its order cannot matter: every block is
        held and unpublished, and no two tagged hashes are equal or already cached (so each `setdefault`
        inserts). A prompt's fresh blocks in every group are the common case. False: nothing done."""
        pool, hash_fn, tables = self.pool, self.hash_fn, self.tables[seq.seq_id]
        keys, n = pool.key, stop - start
        runs = [table[start:stop] for table in tables]
        for bids in runs:
            if None in bids:
                return False
            if (itemgetter(*bids)(keys).count(None) != n) if n > 1 else keys[bids[0]] is not None:
                return False
        links = chain[start:stop]
        hs = list(map(LINK_HASH, links))
        tagged = [list(map(hash_fn, zip(repeat(g), hs))) for g in range(len(tables))]
        every = set().union(*tagged)
        if len(every) != n * len(tables) or not pool.cached.keys().isdisjoint(every):
            return False
        chained = list(map(LINK_KEY, links))
        for g, (bids, ghs) in enumerate(zip(runs, tagged, strict=True)):
            pool.publish(bids, zip(repeat(g), chained), ghs)
        self.publishes += n * len(tables)
        return True

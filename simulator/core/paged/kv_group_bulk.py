"""Block work of every KV cache group at once (a mixin of GroupTables, kv_group_tables.py).

A hybrid model's groups move in step: a prompt takes the same number of blocks in every group, a block
boundary takes one in every group, and a window hands back a run of blocks in each sliding group. Taking
per group costs a pool call, a pass to fill the blocks in and a pass over the counters for each group;
here all groups' blocks come off the pool in one take, in the order the per-group takes would pop them
(group 0's first), and a release walks its blocks once. Where the pool logs events or hands blocks to KV
tiers (`events`, `on_evict`, `on_release`), the per-group path (GroupTables.take / release) runs instead,
as it does per block what those need.
"""
from __future__ import annotations

from operator import itemgetter


class GroupBulk:
    """Takes and releases over all groups in one pass (GroupTables holds the state)."""

    def bulk_ok(self) -> bool:
        """Whether the pool needs nothing per block beyond its own state (no event log, no KV tiers)."""
        pool = self.pool
        return self.bulk and pool.events is None and pool.on_evict is None and pool.on_release is None

    def take_each(self, num: int, rid: int, sid: int, fills: list[int]) -> list[list[int]]:
        """`num` fresh blocks for every group, filled as `fills` says (all full but the last): `take(g,
        num, ...)` for each group in order, in one pass."""
        pool, groups = self.pool, self.num_groups
        total = num * groups
        if not total or not self.bulk_ok() or len(pool.free) + len(pool.free_cached) < total:
            return [self.take(g, num, rid, sid, fills) for g in range(groups)]
        new = pool.take(total, rid, sid)  # in the order the per-group takes would pop them
        filled, group_of = pool.filled, self.group_of
        out = []
        full, last = fills[0], fills[-1]  # every fill is `full` but the last one's
        for g in range(groups):
            mine = new[g * num:(g + 1) * num]
            for bid in mine:
                filled[bid] = full
                group_of[bid] = g
            filled[mine[-1]] = last
            out.append(mine)
        if self.window_released:
            self.window_released.difference_update(new)
        per_group = sum(fills)
        pool.total_filled += per_group * groups
        held_in, filled_in = self.held_in, self.filled_in
        for g in range(groups):
            held_in[g] += num
            filled_in[g] += per_group
        return out

    def release_run(self, bids: list, keep: bool) -> None:
        """`release(bids)` (one table's blocks, the last released first) in one pass; with `keep`, those
        the prefix cache keeps are recorded as handed back by a window (`window_released`)."""
        pool = self.pool
        if pool.plain or not self.bulk_ok():
            self.release(bids)
            if keep:
                free_cached = pool.free_cached
                self.window_released.update([b for b in bids if b in free_cached])
            return
        ref, filled, hashes, keys = pool.ref, pool.filled, pool.hash, pool.key
        cached, free_cached, free = pool.cached, pool.free_cached, pool.free
        n = len(bids)
        if n > 1:
            get = itemgetter(*bids)
            if list(map(cached.get, get(hashes))) == bids:
                # The common window run: every block is one the prefix cache keeps, so each one whose last
                # holder lets go goes to the most recently used end, last block first.
                if get(ref).count(1) == n:
                    gone = bids
                    for bid in reversed(bids):
                        ref[bid] = 0
                        free_cached[bid] = None
                else:
                    gone = []
                    for bid in reversed(bids):
                        r = ref[bid] - 1
                        ref[bid] = r
                        if not r:
                            free_cached[bid] = None
                            gone.append(bid)
                if gone:
                    fills = sum(map(filled.__getitem__, gone))
                    if keep:
                        self.window_released.update(gone)
                    g = self.group_of[bids[0]]
                    self.held_in[g] -= len(gone)
                    self.filled_in[g] -= fills
                    pool.total_filled -= fills
                return
        kept = self.window_released if keep else None
        freed = freed_fill = 0
        for bid in reversed(bids):
            r = ref[bid] - 1
            ref[bid] = r
            if r:
                continue
            f = filled[bid]
            freed += 1
            freed_fill += f
            h = hashes[bid]
            if h is not None and cached.get(h) == bid:
                free_cached[bid] = None  # most recently used end
                if kept is not None:
                    kept.add(bid)
            else:
                keys[bid] = hashes[bid] = None
                filled[bid] = 0
                free.append(bid)
        if freed:
            g = self.group_of[bids[0]]  # one table's blocks: all of one group
            self.held_in[g] -= freed
            self.filled_in[g] -= freed_fill
            pool.total_filled -= freed_fill

"""The BlockManager's physical block pools: taking, sharing and returning blocks, in bulk where it pays.

A mixin of `BlockManager` (block_manager.py), which owns the state it works on: flat lists
indexed by block id (`_ref`, `_filled`, `_key`, `_hash`), the free stack `_free`, the LRU of cached free
blocks `_free_cached` and the content index `_cached`. Split out to keep each module readable; `_take`
serves one block or many (a slice of the free stack unless it must evict), and the fast case of
`_release_device` does exactly what a loop of `_decref` would do.
"""
from __future__ import annotations

from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING

from simulator.core.errors import AllocationError
from simulator.core.sequence import Sequence

_request_id = attrgetter("request_id")

if TYPE_CHECKING:
    from collections import OrderedDict

    from simulator.core.allocator import RegionRecorder
    from simulator.core.paged.block_stats import BlockManagerStats


class BlockPool:
    """Block-level operations of the BlockManager (see the module docstring for the state they use)."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    stats: BlockManagerStats
    _recorder: RegionRecorder | None
    _bulk_recorder: object
    _ref: list[int]
    _filled: list[int]
    _key: list
    _hash: list
    _cached: dict[int, int]
    _free: list[int]
    _free_cached: OrderedDict[int, None]
    _seqs: dict[int, Sequence]
    _total_filled: int
    _internal: int
    _plain: bool

    def _take(self, num: int, request_id: int | list[int], times: list[float] | None = None) -> list[int]:
        """`num` blocks with ref count 1: from the free stack (lowest id first), then the least recently
        used cached ones, evicted. `request_id` is one id or one per block; `times` (events only) says
        when each was taken if not now."""
        free = self._free
        if len(free) >= num and (self._recorder is None or self._bulk_recorder is not None):
            # No eviction: one slice off the top of the stack, in the order repeated pops give.
            new = free[len(free) - num:]
            del free[len(free) - num:]
            new.reverse()
            ref = self._ref
            for bid in new:
                ref[bid] = 1
            self.stats.allocated_blocks += num
            if self._bulk_recorder is not None:
                self._bulk_recorder.acquire_blocks(new, self.block_size, request_id, times)
            return new
        if len(free) + len(self._free_cached) < num:
            raise AllocationError(f"out of KV blocks: {num} needed, {len(free) + len(self._free_cached)} "
                                  f"of {self.num_blocks} free")
        # Evictions, or a per-region recorder: one block at a time, each recorded when it is taken.
        rids = [request_id] * num if isinstance(request_id, int) else request_id
        rec, bulk = self._recorder, self._bulk_recorder
        now = rec.now if rec is not None and times is not None else None
        new = []
        for k, rid in enumerate(rids):
            if free:
                bid = free.pop()
            else:
                bid, _ = self._free_cached.popitem(last=False)
                del self._cached[self._hash[bid]]
                self._key[bid] = self._hash[bid] = None
                self._filled[bid] = 0
                self.stats.evictions += 1
            self._ref[bid] = 1
            if rec is not None:
                if times is not None:
                    rec.now = times[k]
                if bulk is not None:
                    bulk.acquire_blocks((bid,), self.block_size, rid)
                else:
                    rec.acquire(bid * self.block_size, self.block_size, rid)
            new.append(bid)
        if now is not None:
            rec.now = now
        self.stats.allocated_blocks += num
        return new

    def _incref(self, bid: int, request_id: int) -> None:
        ref = self._ref[bid]
        if ref == 0:  # a cache hit on an evictable block: it becomes live again
            del self._free_cached[bid]
            self._total_filled += self._filled[bid]
            if self._bulk_recorder is not None:
                self._bulk_recorder.acquire_blocks((bid,), self.block_size, request_id)
            elif self._recorder is not None:
                self._recorder.acquire(bid * self.block_size, self.block_size, request_id)
        self._ref[bid] = ref + 1
        if ref >= 1:
            self._plain = False
            if self._bulk_recorder is not None:
                self._bulk_recorder.share_block(bid, self.block_size, ref + 1)
            elif self._recorder is not None:
                self._recorder.share(bid * self.block_size, ref + 1)

    def _decref(self, bid: int) -> None:
        ref = self._ref[bid] - 1
        self._ref[bid] = ref
        if ref:
            return
        filled = self._filled[bid]
        self._total_filled -= filled
        if self._bulk_recorder is not None:
            self._bulk_recorder.release_blocks((bid,), self.block_size, (filled,))
        elif self._recorder is not None:
            self._recorder.release(bid * self.block_size, filled)
        h = self._hash[bid]
        if h is not None and self._cached.get(h) == bid:
            self._free_cached[bid] = None  # most recently used end
        else:
            self._key[bid] = self._hash[bid] = None
            self._filled[bid] = 0
            self._free.append(bid)

    # ----------------------------------------------------------------- lazy decode batch (simulator)
    def append_decode_blocks(self, seqs: list[Sequence], times: list[float] | None = None) -> None:
        """Give each of `seqs`, in order, the fresh block its next token needs, as `append_slot` does when a
        sequence's last block is full (a sequence may appear again for a later step). For the simulator's
        lazy decode batch, which counts tokens itself and settles them with `set_num_tokens`."""
        rids = list(map(_request_id, seqs)) if self._recorder is not None else 0
        new = self._take(len(seqs), rids, times)
        filled, bs = self._filled, self.block_size
        for s, bid in zip(seqs, new, strict=True):
            table = s.block_table
            filled[table[-1]] = bs
            filled[bid] = 1
            table.append(bid)
            # `_limit` is the final length, or 2^62 when unknown: one attribute read on the common path.
            if len(table) * bs >= s._limit and not s._internal_counted:
                self._count_internal(s)

    def add_decode_tokens(self, num_tokens: int) -> None:
        """Count `num_tokens` more tokens held, whose slots the decode batch will settle later."""
        self._total_filled += num_tokens

    def set_num_tokens(self, seq: Sequence, num_tokens: int) -> None:
        """Settle a decode-batch sequence: its token count and the fill of its (unshared) last block."""
        seq.num_tokens = num_tokens
        table = seq.block_table
        self._filled[table[-1]] = num_tokens - (len(table) - 1) * self.block_size

    def _release_device(self, seq: Sequence) -> None:
        """Drop the sequence's device blocks, last first (what `_decref` does, inlined: it runs per block)."""
        del self._seqs[seq.seq_id]
        ref, filled, hashes, keys = self._ref, self._filled, self._hash, self._key
        table = seq.block_table
        n = len(table)
        if n > 1:
            get = itemgetter(*table)
            if self._plain or (get(ref).count(1) == n and get(hashes).count(None) == n
                               and get(keys).count(None) == n):
                # The common case: no block shared, none cached: all go back to the free stack at once.
                fills = get(filled)
                self._total_filled -= sum(fills)
                for bid in table:
                    ref[bid] = 0
                    filled[bid] = 0
                self._free.extend(reversed(table))  # last block first, as one by one
                if self._bulk_recorder is not None:  # (the order inside one release does not matter)
                    self._bulk_recorder.release_blocks(table, self.block_size, fills)
                elif self._recorder is not None:
                    for bid, f in zip(reversed(table), reversed(fills), strict=True):
                        self._recorder.release(bid * self.block_size, f)
                self._internal -= seq._internal_counted
                seq._internal_counted = 0
                seq.block_table = []
                return
        free, cached, free_cached = self._free, self._cached, self._free_cached
        recording = self._recorder is not None
        released: list[int] = []
        released_filled: list[int] = []
        total = self._total_filled
        for bid in reversed(seq.block_table):
            r = ref[bid] - 1
            ref[bid] = r
            if r:
                continue
            f = filled[bid]
            total -= f
            if recording:
                released.append(bid)
                released_filled.append(f)
            h = hashes[bid]
            if h is not None and cached.get(h) == bid:
                free_cached[bid] = None  # most recently used end
            else:
                keys[bid] = hashes[bid] = None
                filled[bid] = 0
                free.append(bid)
        self._total_filled = total
        if released:
            if self._bulk_recorder is not None:
                self._bulk_recorder.release_blocks(released, self.block_size, released_filled)
            else:
                for bid, f in zip(released, released_filled, strict=True):
                    self._recorder.release(bid * self.block_size, f)
        self._internal -= seq._internal_counted
        seq._internal_counted = 0
        seq.block_table = []

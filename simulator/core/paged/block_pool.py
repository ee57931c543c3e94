"""The physical blocks of the paged allocator: ref counts, fill levels, content keys, the free queue.

Block state lives in flat lists indexed by block id, so the hot paths are a handful of list operations.
Free blocks sit in two pools: blocks with no cached content (a stack, lowest id on top) and blocks whose
content stays reusable until evicted (an LRU OrderedDict, oldest first, O(1) to take back on a cache hit).
New blocks come from the first pool before anything is evicted. As in vLLM v1's BlockPool, the pool also
holds the map from content hash to the block published under it (`cached`); the prefix cache
(prefix_cache.py) decides what to publish and looks blocks up.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from itertools import compress, islice, repeat
from operator import eq, itemgetter, not_

from simulator.core.allocator import EventLog
from simulator.core.errors import AllocationError, ConfigError

_drain = deque(maxlen=0).extend  # runs a map's calls at C speed, keeping nothing
_BLOCK = itemgetter(0)  # of a free_cached item


@dataclass
class BlockManagerStats:
    """Counters a run reports; only mutations touch them."""

    prefix_queries: int = 0  # full prompt blocks looked up in the prefix cache
    prefix_hits: int = 0  # of those, found
    prefix_query_tokens: int = 0  # prompt tokens of the sequences looked up (vLLM v1's `queries`)
    prefix_hit_tokens: int = 0  # of those, found in the cache (vLLM v1's `hits`)
    # The same two for requests re-admitted after a preemption, which vLLM v1 counts apart (its
    # `preempted_queries`, `preempted_hits`): the four above count first admissions only.
    preempted_query_tokens: int = 0
    preempted_hit_tokens: int = 0
    evictions: int = 0  # cached blocks reused for other content
    cow_copies: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    allocated_blocks: int = 0  # blocks taken from the free pools

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def hit_counts(stats: BlockManagerStats, tiers) -> tuple[int, ...]:
    """The prefix-hit counters a lookup adds to (the pool's, then each KV tier's), for `count_apart`."""
    tier_hits = () if tiers is None else tuple(t.stats.hit_tokens for t in tiers.tiers)
    return (stats.prefix_queries, stats.prefix_hits, stats.prefix_query_tokens, stats.prefix_hit_tokens,
            *tier_hits)


def count_apart(stats: BlockManagerStats, tiers, before: tuple[int, ...]) -> None:
    """Move what a re-admitted request's lookups added since `before` (`hit_counts`) to the counters of
    preempted requests, as vLLM v1 does, so that recomputing a request does not raise the hit rate."""
    now = hit_counts(stats, None)
    queries, hits, query_tokens, hit_tokens = (now[i] - before[i] for i in range(4))
    stats.prefix_queries -= queries
    stats.prefix_hits -= hits
    stats.prefix_query_tokens -= query_tokens
    stats.prefix_hit_tokens -= hit_tokens
    stats.preempted_query_tokens += query_tokens
    stats.preempted_hit_tokens += hit_tokens
    if tiers is not None:
        for tier, then in zip(tiers.tiers, before[4:], strict=True):
            gained = tier.stats.hit_tokens - then
            tier.stats.hit_tokens -= gained
            tier.stats.preempted_hit_tokens += gained


class BlockPool:
    """`num_blocks` blocks of `block_size` token slots, and what each holds."""

    def __init__(self, num_blocks: int, block_size: int, stats: BlockManagerStats,
                 events: EventLog | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.stats = stats
        self.events = events
        self.ref = [0] * num_blocks
        self.filled = [0] * num_blocks
        self.key: list[tuple | None] = [None] * num_blocks  # (parent key, content, extra) of published blocks
        self.hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # content hash -> the block published under it
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack: lowest id first
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self.total_filled = 0  # slots holding tokens in referenced blocks
        # No block has been shared or given a content key since the pool was made: every held block is
        # then unshared and uncached, and a release needs no per-block check (`release_table`). Cleared
        # where shares and keys originate (`incref`, the prefix cache's publish).
        self.plain = True
        # KV tiers below the GPU (tiers.py) when configured: handed the hashes and keys of the published
        # blocks the pool evicts (`on_evict`) and, storing eagerly, of those whose last holder releases them
        # (`on_release`), a list of each per call, in order.
        self.on_evict: Callable[[list[int], list[tuple]], None] | None = None
        self.on_release: Callable[[list[int], list[tuple]], None] | None = None

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now, cached-but-unreferenced ones included."""
        return len(self.free) + len(self.free_cached)

    def take(self, num: int, request_id: int | list[int], seq_id: int | list[int],
             times: list[float] | None = None) -> list[int]:
        """`num` blocks with ref count 1: from the free stack (lowest id first), then the least recently
        used cached ones, evicted. `request_id` and `seq_id` (the acquiring sequence, events only) are one
        id each or one per block; `times` (events only) says when each was taken if not now."""
        free = self.free
        if len(free) >= num:
            # No eviction: one slice off the top of the stack, in the order repeated pops give.
            new = free[len(free) - num:]
            del free[len(free) - num:]
            new.reverse()
        else:
            if len(free) + len(self.free_cached) < num:
                raise AllocationError(f"out of KV blocks: {num} needed, {len(free) + len(self.free_cached)} "
                                      f"of {self.num_blocks} free")
            # The whole free stack, then the oldest cached blocks (each handed to the tiers, if any, while
            # the pool still maps its hash to it).
            new = free[::-1]
            free.clear()
            evicted = num - len(new)
            self._evict_oldest(evicted, new)
            self.stats.evictions += evicted
        ref = self.ref
        for bid in new:
            ref[bid] = 1
        self.stats.allocated_blocks += num
        if self.events is not None:
            self.events.acquire_blocks(new, self.block_size, request_id, seq_id, times)
        return new

    def take_filled(self, num_tokens: int, request_id: int, seq_id: int) -> list[int]:
        """Fresh blocks (`take`) holding `num_tokens` tokens in order: every one full but the last."""
        bs = self.block_size
        new = self.take(-(-num_tokens // bs), request_id, seq_id)
        if new:
            filled = self.filled
            for bid in new:
                filled[bid] = bs
            filled[new[-1]] = num_tokens - (len(new) - 1) * bs
            self.total_filled += num_tokens
        return new

    def evicts_none_of(self, num: int, hashes: list[int]) -> bool:
        """Whether taking `num` blocks now evicts no block published under one of `hashes`."""
        evicted = num - len(self.free)
        if evicted <= 0 or not hashes:
            return True
        if not any(map(self.cached.__contains__, hashes)):  # the common case: none is cached at all
            return True
        return set(map(self.hash.__getitem__, islice(self.free_cached, evicted))).isdisjoint(hashes)

    def publish(self, bids: list[int], keys: Iterable[tuple], hashes: list[int]) -> None:
        """Give held, unkeyed blocks `bids` the content `keys` and `hashes`, in order (`bids` may run
        longer); a hash already cached keeps its block (the block published first wins)."""
        if not hashes:
            return
        self.plain = False
        key, hash_ = self.key, self.hash
        for bid, k, h in zip(bids, keys, hashes, strict=False):
            key[bid] = k
            hash_[bid] = h
        _drain(map(self.cached.setdefault, hashes, bids))

    def _evict_oldest(self, num: int, out: list[int]) -> None:
        """Evict the `num` least recently used cached free blocks onto `out`, handing each to the tiers
        first (`on_evict`, while the pool still maps its hash to it). Long prompts evict thousands of
        blocks at a time: the dict work runs as C-level maps over them (a list store is cheaper in a loop)."""
        keys, hashes, filled = self.key, self.hash, self.filled
        old = list(map(_BLOCK, map(self.free_cached.popitem, repeat(False, num))))
        hs = list(map(hashes.__getitem__, old))
        if self.on_evict is not None:
            self.on_evict(hs, list(map(keys.__getitem__, old)))
        _drain(map(self.cached.__delitem__, hs))
        for bid in old:
            keys[bid] = hashes[bid] = None
            filled[bid] = 0
        out += old

    def incref(self, bid: int, request_id: int, seq_id: int) -> None:
        """One more holder of block `bid` (a free cached block comes back into use, its tenure then
        acquired by sequence `seq_id`)."""
        ref = self.ref[bid]
        if ref == 0:  # a cache hit on an evictable block: it becomes live again
            del self.free_cached[bid]
            self.total_filled += self.filled[bid]
            if self.events is not None:
                self.events.acquire_blocks((bid,), self.block_size, request_id, seq_id)
        self.ref[bid] = ref + 1
        if ref >= 1:
            self.plain = False
            if self.events is not None:
                self.events.share_block(bid, self.block_size, ref + 1)

    def decref(self, bid: int) -> None:
        """One holder less; a block nobody holds goes to the LRU if published, else to the free stack."""
        ref = self.ref[bid] - 1
        self.ref[bid] = ref
        if ref:
            if self.events is not None:
                self.events.ref_change(bid, self.block_size, ref)
            return
        filled = self.filled[bid]
        self.total_filled -= filled
        h = self.hash[bid]
        if self.events is not None:
            self.events.release_blocks((bid,), self.block_size, (filled,), None if h is None else (h,))
        if h is not None and self.cached.get(h) == bid:
            self.free_cached[bid] = None  # most recently used end
            if self.on_release is not None:
                self.on_release([h], [self.key[bid]])
        else:
            self.key[bid] = self.hash[bid] = None
            self.filled[bid] = 0
            self.free.append(bid)

    def release_table(self, table: list[int]) -> None:
        """Drop one holder of every block of `table`, last block first (`decref` per block, in a few passes
        over the blocks: it runs for every block a finished sequence held)."""
        n = len(table)
        if n > 1 and self.plain:
            # No block shared or cached since the pool was made: all go back to the free stack at once.
            ref, filled = self.ref, self.filled
            fills = itemgetter(*table)(filled)
            self.total_filled -= sum(fills)
            for bid in table:
                ref[bid] = 0
                filled[bid] = 0
            self.free.extend(reversed(table))  # last block first, as one by one
            if self.events is not None:  # (the order inside one release does not matter)
                self.events.release_blocks(table, self.block_size, fills)
            return
        rev = table[::-1]
        refs = list(map(self.ref.__getitem__, rev))
        if refs.count(1) == n:
            gone = rev
        else:  # shared blocks lose a holder and stay
            ref, logging = self.ref, self.events is not None
            gone = []
            for bid, r in zip(rev, refs, strict=True):
                ref[bid] = r - 1
                if r == 1:
                    gone.append(bid)
                elif logging:
                    self.events.ref_change(bid, self.block_size, r - 1)
        if gone:
            self._let_go(gone)

    def _let_go(self, blocks: list[int]) -> None:
        """Blocks whose last holder let go, in release order: those published under their own hash go to
        the LRU's most recently used end, the others to the free stack."""
        hs = list(map(self.hash.__getitem__, blocks))
        fills = list(map(self.filled.__getitem__, blocks))
        kept = list(map(eq, map(self.cached.get, hs), blocks))
        self.total_filled -= sum(fills)
        ref = self.ref
        for bid in blocks:
            ref[bid] = 0
        cached = list(compress(blocks, kept))
        if cached:
            self.free_cached.update(zip(cached, repeat(None)))
            if self.on_release is not None:
                self.on_release(list(compress(hs, kept)), list(map(self.key.__getitem__, cached)))
        if len(cached) < len(blocks):
            dropped = list(compress(blocks, map(not_, kept)))
            keys, hashes, filled = self.key, self.hash, self.filled
            for bid in dropped:
                keys[bid] = hashes[bid] = None
                filled[bid] = 0
            self.free.extend(dropped)
        if self.events is not None:
            logged = [h or 0 for h in hs]  # the events' prefix_key (0: none)
            self.events.release_blocks(blocks, self.block_size, fills, logged if any(logged) else None)


class PoolCounts:
    """The block counts a paged allocator reports, read from its `pool`, `swap` and `num_blocks`; shared by
    BlockManager and GroupedBlockManager (it declares no state)."""

    @staticmethod
    def check_sizes(num_blocks: int, num_cpu_blocks: int, watermark: float) -> None:
        """Refuse negative pools and a watermark outside [0, 1)."""
        if num_blocks < 0 or num_cpu_blocks < 0:
            raise ConfigError(f"block counts must be >= 0, got {num_blocks} GPU / {num_cpu_blocks} CPU")
        if not 0.0 <= watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {watermark}")

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached-but-unreferenced ones included."""
        pool = self.pool  # the pool's own count, inlined: the loop asks nearly every step
        return len(pool.free) + len(pool.free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks still holding reusable prefix content."""
        return len(self.pool.free_cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.pool.num_free

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks of the CPU swap pool."""
        return self.swap.num_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        """Free blocks of the CPU swap pool."""
        return len(self.swap.free)

"""The paged KV-cache allocator (vLLM's block manager): block tables over a shared pool of blocks.

The BlockManager has a BlockPool (block_pool.py: ref counts, fill levels, free queue, published blocks),
a PrefixCache (prefix_cache.py: chained content keys, lookups, publishing) and a SwapSpace (swap.py: the
CPU pool that preempted groups move to). It owns the sequences' block tables and the accounting of
internal fragmentation, and answers the scheduler's queries.
"""
from __future__ import annotations

from collections.abc import Callable

from simulator.core.allocator import AllocStatus, EventLog, KVAllocator, MemoryBreakdown
from simulator.core.errors import AllocationError, ConfigError
from simulator.core.paged.block_pool import BlockManagerStats, BlockPool, PoolCounts, count_apart, hit_counts
from simulator.core.paged.prefix_cache import LINK_HASH, LINK_KEY, PrefixCache
from simulator.core.paged.swap import SwapSpace
from simulator.core.paged.tiers import tier_hits
from simulator.core.sequence import (
    Sequence,
    SequenceGroup,
    SequenceStatus,
    shared_prompt_blocks,
    shares_allocation,
)

_NO_COPIES: list = []
_new_tuple = tuple.__new__


class BlockManager(PoolCounts, KVAllocator):
    """Paged allocator over `num_blocks` blocks of `block_size` token slots (vLLM's BlockSpaceManager)."""

    name = "paged"
    shares_prompt = True

    def __init__(self, num_blocks: int, block_size: int, *, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.0,
                 capacity_tokens: int | None = None, debug: bool = False,
                 hash_fn: Callable[[object], int] = hash, record_events: bool = False):
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        self.check_sizes(num_blocks, num_cpu_blocks, watermark)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.capacity_tokens = num_blocks * block_size if capacity_tokens is None else capacity_tokens
        self.capacity_slots = self.capacity_tokens
        if self.capacity_tokens < num_blocks * block_size:
            raise ConfigError(f"capacity {self.capacity_tokens} is smaller than {num_blocks} blocks of "
                              f"{block_size}")
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.debug = debug
        self.stats = BlockManagerStats()
        self.events = EventLog() if record_events else None
        self.pool = BlockPool(num_blocks, block_size, self.stats, self.events)
        self.prefix_cache = PrefixCache(self.pool, enable_prefix_caching, hash_fn)
        self.seqs: dict[int, Sequence] = {}  # sequences holding device blocks, by id
        # The swap space is handed the two callbacks per call: held here, they would tie the manager into
        # a reference cycle that keeps the pool and its tiers alive until the cyclic collector runs.
        self.swap = SwapSpace(num_cpu_blocks, self.pool, self.seqs, self.watermark_blocks)
        self.num_internal_slots = 0  # slots of final blocks that their sequences will never fill
        self.tiers = None  # the CPU and disk tiers behind the pool, when attached (tiers.py)

    @classmethod
    def from_capacity(cls, capacity_tokens: int, block_size: int, **kwargs) -> BlockManager:
        """A manager over `capacity_tokens` slots; the remainder `C mod block_size` is unusable."""
        return cls(capacity_tokens // block_size, block_size, capacity_tokens=capacity_tokens, **kwargs)

    # ----------------------------------------------------------------- queries
    def can_allocate(self, group: SequenceGroup, num_new_tokens: int | None = None) -> AllocStatus:
        """OK, LATER, or NEVER for the group's prompt (prefix hits on referenced blocks cost nothing)."""
        seqs, needed = self._blocks_needed(group)
        if needed < 0:
            return AllocStatus.NEVER
        # Hits on referenced blocks cost nothing; hits on evictable ones use up a free block like a miss.
        pool = self.pool
        if self.enable_prefix_caching:
            ref = pool.ref
            # Sequences that share their prompt's blocks share its hits too: the first one's count.
            for s in seqs[:1] if len(seqs) > 1 and shared_prompt_blocks(seqs, self.block_size) else seqs:
                for b in self.prefix_cache.lookup(s):
                    if ref[b] > 0:
                        needed -= 1
        if len(pool.free) + len(pool.free_cached) - needed < self.watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def can_ever_allocate(self, group: SequenceGroup) -> bool:
        """Whether `can_allocate` would not answer NEVER: that depends only on the group's lengths."""
        return self._blocks_needed(group)[1] >= 0

    def _blocks_needed(self, group: SequenceGroup) -> tuple[list[Sequence], int]:
        """The live sequences `allocate` gives blocks to one by one (equal ones share a single table) and
        the blocks their tokens need before prefix hits (the prompt blocks diverged ones share counted
        once), -1 when they could never fit (a sequence whose final length can never fit would preempt
        itself forever: refuse it now)."""
        seqs = group.live_seqs()
        if not seqs:
            raise AllocationError(f"request {group.request_id}: every sequence has finished")
        if len(seqs) > 1 and shares_allocation(seqs):
            seqs = seqs[:1]
        bs = self.block_size
        # One sequence (the common case) shares with nobody: no call for it.
        needed = -shared_prompt_blocks(seqs, bs) * (len(seqs) - 1) if len(seqs) > 1 else 0
        final = 0
        for s in seqs:
            n = s.prompt_len + s.num_generated  # s.length
            needed += -(-n // bs)
            f = s.final_len
            m = -(-(f if f is not None and f > n else n) // bs)
            if m > final:
                final = m
        return seqs, -1 if max(needed, final) > self.num_blocks - self.watermark_blocks else needed

    def can_append(self, seqs: list[Sequence], num_tokens: int = 1) -> bool:
        """Whether every sequence can grow by `num_tokens` at once (copy-on-write copies included)."""
        need = 0
        for s in seqs:
            if s.num_tokens + num_tokens > s._limit:
                return False
            need += self._blocks_needed_to_append(s, num_tokens)
        return need <= self.pool.num_free

    def _blocks_needed_to_append(self, seq: Sequence, k: int) -> int:
        n, bs = seq.num_tokens, self.block_size
        new = -(-(n + k) // bs) - -(-n // bs)
        if n % bs and k > 0 and self.pool.ref[seq.block_table[-1]] > 1:
            new += 1  # the shared partial last block must be copied first
        return new

    def can_fork(self, parent: Sequence) -> bool:
        """Forking shares every block, so it always fits."""
        return True

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the CPU pool has room for the group's distinct blocks."""
        return self.swap.can_swap_out(group)

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        """OK, LATER, or NEVER for bringing the group back and giving each sequence its next slot."""
        return self.swap.can_swap_in(group)

    def breakdown(self, head: SequenceGroup | None = None) -> MemoryBreakdown:
        """Taxonomy now; for paged memory the waiting queue does not matter (any free block fits)."""
        pool, bs = self.pool, self.block_size
        num_free = len(pool.free) + len(pool.free_cached)
        used = (self.num_blocks - num_free) * bs
        empty = used - pool.total_filled
        internal = min(self.num_internal_slots, empty)
        # tuple.__new__ skips the Python frame of the named tuple's own constructor (asked every step)
        return _new_tuple(MemoryBreakdown, (self.capacity_tokens, pool.total_filled, empty - internal,
                                            internal, self.capacity_tokens - self.num_blocks * bs,
                                            num_free * bs, len(pool.free_cached) * bs, used))

    # ----------------------------------------------------------------- mutations
    def allocate(self, group: SequenceGroup, num_new_tokens: int | None = None) -> int:
        """Give the group's live sequences blocks for all their tokens; return prefix-cached tokens.

        `num_new_tokens` is how many tokens past the cached prefix this step computes (None: all of them);
        only the full blocks they complete are published to the prefix cache, the rest by `cache_blocks`
        as later chunks are scheduled. Sequences with the same tokens (a fresh prompt, n samples or a
        beam) share every block; sequences that diverged (a group re-admitted after a recompute
        preemption) are allocated one by one, and prefilled in that order, sharing the first one's full
        prompt blocks when they are simulated (`shared_prompt_blocks`).
        """
        seqs = group.live_seqs()
        for s in seqs:
            if s.seq_id in self.seqs or s.seq_id in self.swap.seqs:
                raise AllocationError(f"sequence {s.seq_id} already holds blocks")
        status = self.can_allocate(group)
        if status is not AllocStatus.OK:
            raise AllocationError(f"request {group.request_id}: cannot allocate its blocks now "
                                  f"({status.value}); {self.num_free_blocks} free")
        budget = (1 << 62) if num_new_tokens is None else num_new_tokens
        before = hit_counts(self.stats, self.tiers) if group.readmitted else None
        if len(seqs) == 1 or shares_allocation(seqs):
            hit = self._allocate_one(seqs[0], group.request_id, budget)
            for s in seqs[1:]:
                for bid in seqs[0].block_table:
                    self.pool.incref(bid, group.request_id, s.seq_id)
                s.block_table = list(seqs[0].block_table)
                s.num_tokens = seqs[0].num_tokens
                s.num_cached_tokens = seqs[0].num_cached_tokens
                self.seqs[s.seq_id] = s
                self.count_internal(s)
        else:
            hit = 0
            shared = shared_prompt_blocks(seqs, self.block_size)
            for s in seqs:
                head = seqs[0].block_table[:shared] if shared and s is not seqs[0] else None
                got = self._allocate_one(s, group.request_id, budget, head)
                if head is None:
                    hit += got
                budget = max(0, budget - (s.length - s.num_cached_tokens))
        if before is not None:
            count_apart(self.stats, self.tiers, before)
        self._check()
        return hit

    def _allocate_one(self, seq: Sequence, rid: int, budget: int, head: list[int] | None = None) -> int:
        """Blocks for every token of `seq`, led by its prefix hits or by `head` (the prompt blocks another
        sequence of its group holds); publish the full ones within `budget` tokens past those."""
        pool, stats, bs, n, sid = self.pool, self.stats, self.block_size, seq.length, seq.seq_id
        if head is None:
            hits = self.prefix_cache.lookup(seq)
            loaded = tier_hits(self, seq, hits) if self.tiers is not None else ()
            if self.enable_prefix_caching:
                stats.prefix_queries += (n - 1) // bs
                stats.prefix_query_tokens += n
            stats.prefix_hits += len(hits)
            stats.prefix_hit_tokens += len(hits) * bs
        else:
            hits, loaded = head, ()
        table: list[int] = []
        seq.block_table = table
        for bid in hits:
            pool.incref(bid, rid, sid)
            table.append(bid)
        first = len(hits)
        count = -(-n // bs) - first
        # Only computed blocks with known content are published (simulated decode tokens have none).
        num_full = min(n, (first + len(loaded)) * bs + budget) // bs if self.enable_prefix_caching else 0
        if seq.token_ids is None:
            num_full = min(num_full, len(seq.prefix_keys))
        chain = self.prefix_cache.chain(seq, first, num_full) if num_full > first else []
        hashes = list(map(LINK_HASH, chain))
        if len(pool.free) < count and not pool.evicts_none_of(count, hashes):
            # A block evicted here holds a hash published here: which of the two the cache keeps depends
            # on the order, and the pool's order is one block taken, then published, at a time.
            publish = self.prefix_cache.publish
            for i in range(first, first + count):
                bid = pool.take(1, rid, sid)[0]
                filled = min(bs, n - i * bs)
                pool.filled[bid] = filled
                pool.total_filled += filled
                table.append(bid)
                if i < num_full:
                    publish(seq, i, bid)
        elif count:
            new = pool.take_filled(n - first * bs, rid, sid)
            table.extend(new)
            pool.publish(new, map(LINK_KEY, chain), hashes)
        if loaded and self.tiers.log is not None:  # the driver copies the loaded blocks' data in
            self.tiers.log.place(table[first:first + len(loaded)])
        seq.num_tokens = n
        self.seqs[seq.seq_id] = seq
        self.count_internal(seq)
        seq.num_cached_tokens = (len(hits) + len(loaded)) * bs
        return seq.num_cached_tokens

    def cache_blocks(self, group: SequenceGroup, num_left: int) -> None:
        """Publish the full blocks of the group whose tokens are computed once its prefill has `num_left`
        prompt tokens left to compute (call when scheduling each chunk after the first)."""
        if not self.enable_prefix_caching:
            return
        seqs = [s for s in group.live_seqs() if s.seq_id in self.seqs]
        if len(seqs) > 1 and shares_allocation(seqs):
            seqs = seqs[:1]  # one table shared by all
        self.prefix_cache.publish_computed(seqs, num_left)

    def append_slot(self, seq: Sequence, num_tokens: int = 1) -> list[tuple[int, int]]:
        """Grow `seq` by `num_tokens` in O(new blocks); return the copy-on-write (src, dst) pairs."""
        n = seq.num_tokens
        table = seq.block_table
        pool = self.pool
        # The common case, one decode token: it fits in the sequence's own, partly filled last block and
        # completes no block that would need publishing, so nothing is allocated or checked beyond this.
        if num_tokens == 1 and n % self.block_size and n < seq._limit and pool.ref[table[-1]] == 1 \
                and seq.seq_id in self.seqs and not self.debug \
                and (seq.token_ids is None or (n + 1) % self.block_size):
            pool.filled[table[-1]] += 1
            pool.total_filled += 1
            seq.num_tokens = n + 1
            return _NO_COPIES
        if seq.seq_id not in self.seqs:
            state = "finished" if seq.status is SequenceStatus.FINISHED else "not allocated (or swapped out)"
            raise AllocationError(f"cannot append to sequence {seq.seq_id}: it is {state}")
        if seq.status is SequenceStatus.FINISHED:
            raise AllocationError(f"cannot append to sequence {seq.seq_id}: it is finished")
        if num_tokens < 0:
            raise AllocationError(f"cannot append a negative number of tokens ({num_tokens})")
        if num_tokens == 0:
            return _NO_COPIES
        if n + num_tokens > seq._limit:
            raise AllocationError(f"sequence {seq.seq_id} would grow past its final length {seq.final_len}")
        bs, rid, sid = self.block_size, seq.request_id, seq.seq_id
        rem = n % bs
        # can_append for one sequence, inlined: this is the bulk decode path's every call.
        need = -(-(n + num_tokens) // bs) - -(-n // bs) + (1 if rem and pool.ref[table[-1]] > 1 else 0)
        if need > len(pool.free) + len(pool.free_cached):
            raise AllocationError(
                f"out of KV blocks: sequence {seq.seq_id} needs {need} blocks, {self.num_free_blocks} free")
        copies = _NO_COPIES
        left = num_tokens
        if rem:
            last = table[-1]
            if pool.ref[last] > 1:  # never write a shared block in place: copy it first
                new = pool.take(1, rid, sid)[0]
                pool.filled[new] = rem
                pool.total_filled += rem
                pool.decref(last)
                table[-1] = new
                copies = [(last, new)]
                self.stats.cow_copies += 1
            fill = min(num_tokens, bs - rem)
            pool.filled[table[-1]] += fill
            pool.total_filled += fill
            left -= fill
        if left > 0:  # pool.take_filled, inlined: the bulk decode path's every call
            pool.total_filled += left
            nb = -(-left // bs)
            new = pool.take(nb, rid, sid)
            filled = pool.filled
            for bid in new:
                filled[bid] = bs
            filled[new[-1]] = left - (nb - 1) * bs
            table.extend(new)
        seq.num_tokens = n + num_tokens
        if seq.token_ids is not None and self.enable_prefix_caching:
            for i in range(n // bs, seq.num_tokens // bs):
                self.prefix_cache.publish(seq, i, table[i])
        if not seq._internal_counted:
            self.count_internal(seq)
        self._check()
        return copies

    def count_internal(self, seq: Sequence) -> None:
        """Once a sequence holds its final block, the slots past its final length are internal waste
        (counted once, when it takes that block)."""
        final = seq.final_len
        if final is not None and len(seq.block_table) * self.block_size >= final:
            waste = len(seq.block_table) * self.block_size - final
            self.num_internal_slots += waste - seq._internal_counted
            seq._internal_counted = waste

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Let `child` share every block of `parent`; nothing is copied."""
        if parent.seq_id not in self.seqs:
            raise AllocationError(f"cannot fork sequence {parent.seq_id}: it holds no device blocks")
        if child.seq_id in self.seqs or child.seq_id in self.swap.seqs:
            raise AllocationError(f"cannot fork into sequence {child.seq_id}: it already holds blocks")
        for bid in parent.block_table:
            self.pool.incref(bid, parent.request_id, child.seq_id)
        child.block_table = list(parent.block_table)
        child.num_tokens = parent.num_tokens
        self.seqs[child.seq_id] = child
        self.count_internal(child)  # its decode tokens may all fit the blocks it shares: counted now
        self._check()
        return _NO_COPIES

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (last block first, so tails are evicted before shared heads)."""
        if seq.seq_id in self.seqs:
            self.release_device(seq)
        elif seq.seq_id in self.swap.seqs:
            self.swap.drop(seq)
        else:
            raise AllocationError(f"cannot free sequence {seq.seq_id}: it holds no blocks (freed twice?)")
        seq.num_tokens = 0
        self._check()

    def release_device(self, seq: Sequence) -> None:
        """Drop the sequence's device blocks and its internal-fragmentation share (free, swap out)."""
        del self.seqs[seq.seq_id]
        self.pool.release_table(seq.block_table)
        self.num_internal_slots -= seq._internal_counted
        seq._internal_counted = 0
        seq.block_table = []

    def _adopt(self, seq: Sequence) -> None:
        """`seq` holds device blocks again (swapped in): count it."""
        self.seqs[seq.seq_id] = seq
        self.count_internal(seq)

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's device blocks to the CPU pool; blocks shared inside the group stay shared."""
        copies = self.swap.swap_out(group, self.release_device)
        if self.tiers is not None:  # the swapped blocks take their room from the CPU tier's cache
            self.tiers.fit()
        self._check()
        return copies

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Bring the group's blocks back; full blocks still cached on the device are shared again."""
        copies = self.swap.swap_in(group, self._adopt)
        self._check()
        return copies

    def _check(self) -> None:
        if self.debug:
            from simulator.core.invariants import check_invariants

            check_invariants(self)

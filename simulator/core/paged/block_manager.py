"""The paged KV-cache allocator: blocks, ref counts, prefix caching, copy-on-write and swapping.

Physical block state lives in flat lists indexed by block id (ref count, filled slots, content key), so
the hot paths are a handful of list operations. Free blocks sit in two pools: blocks with no cached
content (a stack) and blocks whose content stays reusable until evicted (an LRU OrderedDict, O(1) to
remove a block on a cache hit). New blocks come from the first pool before anything is evicted.
Block-level pool operations live in block_pool.py, the admission and growth queries in block_queries.py,
prefix caching in prefix_cache.py, CPU swapping in block_swap.py (same folder).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from simulator.core.allocator import AllocStatus, KVAllocator, MemoryBreakdown, RegionRecorder
from simulator.core.errors import AllocationError, ConfigError
from simulator.core.paged.block_pool import BlockPool
from simulator.core.paged.block_queries import BlockQueries
from simulator.core.paged.block_stats import BlockManagerStats
from simulator.core.paged.block_swap import SwapMixin
from simulator.core.paged.prefix_cache import PrefixCacheMixin
from simulator.core.sequence import Sequence, SequenceGroup, SequenceStatus, shares_allocation

_NO_COPIES: list = []


class BlockManager(BlockPool, BlockQueries, PrefixCacheMixin, SwapMixin, KVAllocator):
    """Paged allocator over `num_blocks` blocks of `block_size` token slots (vLLM's BlockSpaceManager)."""

    name = "paged"

    def __init__(self, num_blocks: int, block_size: int, *, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.0,
                 capacity_tokens: int | None = None, debug: bool = False,
                 hash_fn: Callable[[object], int] = hash, recorder: RegionRecorder | None = None):
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 0 or num_cpu_blocks < 0:
            raise ConfigError(f"block counts must be >= 0, got {num_blocks} GPU / {num_cpu_blocks} CPU")
        if not 0.0 <= watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.capacity_tokens = num_blocks * block_size if capacity_tokens is None else capacity_tokens
        if self.capacity_tokens < num_blocks * block_size:
            raise ConfigError(f"capacity {self.capacity_tokens} is smaller than {num_blocks} blocks of "
                              f"{block_size}")
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.debug = debug
        self._hash_fn = hash_fn
        self._recorder = recorder
        # The simulator's EventRecorder takes whole runs of blocks at once; any other recorder gets the
        # per-region calls of the RegionRecorder interface.
        self._bulk_recorder = recorder if hasattr(recorder, "acquire_blocks") else None
        self.num_cpu_blocks = num_cpu_blocks
        self.reset()

    def reset(self) -> None:
        """Return to the state of a new manager (between runs): every block free, nothing cached, counters
        zero. Sequences still holding blocks lose them."""
        for s in list(getattr(self, "_seqs", {}).values()) + list(getattr(self, "_cpu_seqs", {}).values()):
            s.block_table, s.cpu_block_table, s.num_tokens, s._internal_counted = [], [], 0, 0
        num_blocks, num_cpu_blocks = self.num_blocks, self.num_cpu_blocks
        self.stats = BlockManagerStats()
        self._ref = [0] * num_blocks
        self._filled = [0] * num_blocks
        self._key: list[tuple | None] = [None] * num_blocks  # (parent key, content, extra) of full blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # content hash -> block id
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack: lowest id first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self._seqs: dict[int, Sequence] = {}  # sequences holding device blocks
        self._total_filled = 0
        self._internal = 0  # slots of final blocks that their sequence will never fill
        # No block has been shared or given a content key since the reset: every held block is then
        # unshared and uncached, and a release needs no per-block check (`_release_device`). Cleared where
        # shares and keys originate, `_incref` and `_register_full` (a swap-in only restores saved keys).
        self._plain = True
        self._cpu_ref = [0] * num_cpu_blocks
        self._cpu_filled = [0] * num_cpu_blocks
        self._cpu_key: list[tuple | None] = [None] * num_cpu_blocks
        self._cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self._cpu_seqs: dict[int, Sequence] = {}

    @classmethod
    def from_capacity(cls, capacity_tokens: int, block_size: int, **kwargs) -> BlockManager:
        """A manager over `capacity_tokens` slots; the remainder `C mod block_size` is unusable."""
        return cls(capacity_tokens // block_size, block_size, capacity_tokens=capacity_tokens, **kwargs)

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached-but-unreferenced ones included."""
        return len(self._free) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks still holding reusable prefix content."""
        return len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free) - len(self._free_cached)

    @property
    def num_used_slots(self) -> int:
        """Slots inside referenced blocks."""
        return self.num_used_blocks * self.block_size

    @property
    def num_free_cpu_blocks(self) -> int:
        """Free blocks in the CPU swap pool."""
        return len(self._cpu_free)

    @property
    def num_internal_slots(self) -> int:
        """Slots of final blocks that their sequences will never fill (before capping by empty slots)."""
        return self._internal

    def ref_count(self, block_id: int) -> int:
        """Current ref count of a device block."""
        return self._ref[block_id]

    def num_filled(self, block_id: int) -> int:
        """Slots of a device block that hold tokens."""
        return self._filled[block_id]

    def breakdown(self, head: SequenceGroup | None = None) -> MemoryBreakdown:
        """Taxonomy now; for paged memory the waiting queue does not matter (any free block fits)."""
        return MemoryBreakdown(*self.breakdown_slots(head))

    def breakdown_slots(self, head: SequenceGroup | None = None) -> tuple[int, ...]:
        """`breakdown` as a plain tuple in MemoryBreakdown's field order (cheap enough to call every step)."""
        bs = self.block_size
        num_free = len(self._free) + len(self._free_cached)
        used = (self.num_blocks - num_free) * bs
        empty = used - self._total_filled
        internal = min(self._internal, empty)
        return (self.capacity_tokens, self._total_filled, empty - internal, internal,
                self.capacity_tokens - self.num_blocks * bs, num_free * bs, len(self._free_cached) * bs, used)

    # ----------------------------------------------------------------- mutations
    def allocate(self, group: SequenceGroup, num_new_tokens: int | None = None) -> int:
        """Give the group's live sequences blocks for all their tokens; return prefix-cached tokens.

        `num_new_tokens` is how many tokens past the cached prefix this step computes (None: all of them);
        only the full blocks they complete are published to the prefix cache, the rest by `cache_blocks`
        as later chunks are scheduled. Sequences of equal length (a fresh prompt, n samples or a beam)
        share every block; sequences that diverged (a group re-admitted after a recompute preemption) are
        allocated one by one, and prefilled in that order.
        """
        seqs = group.live_seqs()
        for s in seqs:
            if s.seq_id in self._seqs or s.seq_id in self._cpu_seqs:
                raise AllocationError(f"sequence {s.seq_id} already holds blocks")
        status = self.can_allocate(group)
        if status is not AllocStatus.OK:
            raise AllocationError(f"request {group.request_id}: cannot allocate its blocks now "
                                  f"({status.value}); {self.num_free_blocks} free")
        budget = (1 << 62) if num_new_tokens is None else num_new_tokens
        if len(seqs) == 1 or shares_allocation(seqs):
            hit = self._allocate_one(seqs[0], group.request_id, budget)
            for s in seqs[1:]:
                for bid in seqs[0].block_table:
                    self._incref(bid, group.request_id)
                s.block_table = list(seqs[0].block_table)
                s.num_tokens = seqs[0].num_tokens
                s.num_cached_tokens = seqs[0].num_cached_tokens
                self._seqs[s.seq_id] = s
                self._count_internal(s)
        else:
            hit = 0
            for s in seqs:
                got = self._allocate_one(s, group.request_id, budget)
                hit += got
                budget = max(0, budget - (s.length - got))
        if self.debug:
            self.check_invariants()
        return hit

    def _allocate_one(self, seq: Sequence, rid: int, budget: int) -> int:
        """Blocks for every token of `seq`; publish the full ones within `budget` tokens past the hit."""
        bs, n = self.block_size, seq.length
        hits = self._lookup(seq)
        if self.enable_prefix_caching:
            self.stats.prefix_queries += (n - 1) // bs
            self.stats.prefix_query_tokens += n
        self.stats.prefix_hits += len(hits)
        self.stats.prefix_hit_tokens += len(hits) * bs
        table: list[int] = []
        seq.block_table = table
        for bid in hits:
            self._incref(bid, rid)
            table.append(bid)
        first = len(hits)
        count = self._blocks_for(n) - first
        # Only computed blocks with known content are published (simulated decode tokens have none).
        num_full = min(n, first * bs + budget) // bs if self.enable_prefix_caching else 0
        if seq.token_ids is None:
            num_full = min(num_full, len(seq.prefix_keys))
        if len(self._free) < count:  # evictions interleave with publishing: keep them in step
            for i in range(first, first + count):
                bid = self._take(1, rid)[0]
                filled = min(bs, n - i * bs)
                self._filled[bid] = filled
                self._total_filled += filled
                table.append(bid)
                if i < num_full:
                    self._register_full(seq, i, bid)
        elif count:
            new = self._take(count, rid)
            filled = self._filled
            for bid in new:
                filled[bid] = bs
            filled[new[-1]] = n - (first + len(new) - 1) * bs
            self._total_filled += n - first * bs
            table.extend(new)
            for i in range(first, num_full):
                self._register_full(seq, i, table[i])
        seq.num_tokens = n
        self._seqs[seq.seq_id] = seq
        self._count_internal(seq)
        seq.num_cached_tokens = len(hits) * bs
        return seq.num_cached_tokens

    def append_slots(self, seq: Sequence, num_tokens: int = 1) -> list[tuple[int, int]]:
        """Grow `seq` by `num_tokens` in O(new blocks); return the copy-on-write (src, dst) pairs."""
        n = seq.num_tokens
        table = seq.block_table
        # The common case, one decode token: it fits in the sequence's own, partly filled last block and
        # completes no block that would need publishing, so nothing is allocated or checked beyond this.
        if num_tokens == 1 and n % self.block_size and n < seq._limit and self._ref[table[-1]] == 1 \
                and seq.seq_id in self._seqs and not self.debug \
                and (seq.token_ids is None or (n + 1) % self.block_size):
            self._filled[table[-1]] += 1
            self._total_filled += 1
            seq.num_tokens = n + 1
            return _NO_COPIES
        if seq.seq_id not in self._seqs:
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
        if not self.can_append(seq, num_tokens):
            raise AllocationError(
                f"out of KV blocks: sequence {seq.seq_id} needs "
                f"{self._blocks_needed_to_append(seq, num_tokens)} blocks, {self.num_free_blocks} free")
        bs, rid = self.block_size, seq.request_id
        copies = _NO_COPIES
        left = num_tokens
        rem = n % bs
        if rem:
            last = table[-1]
            if self._ref[last] > 1:  # never write a shared block in place: copy it first
                new = self._take(1, rid)[0]
                self._filled[new] = rem
                self._total_filled += rem
                self._decref(last)
                table[-1] = new
                copies = [(last, new)]
                self.stats.cow_copies += 1
            fill = min(num_tokens, bs - rem)
            self._filled[table[-1]] += fill
            self._total_filled += fill
            left -= fill
        if left > 0:
            self._total_filled += left
            nb = -(-left // bs)
            new = self._take(nb, rid)
            filled = self._filled
            for bid in new:
                filled[bid] = bs
            filled[new[-1]] = left - (nb - 1) * bs
            table.extend(new)
        seq.num_tokens = n + num_tokens
        if seq.token_ids is not None and self.enable_prefix_caching:
            for i in range(n // bs, seq.num_tokens // bs):
                self._register_full(seq, i, table[i])
        if not seq._internal_counted:
            self._count_internal(seq)
        if self.debug:
            self.check_invariants()
        return copies

    # One token is the common call (a decode step); it takes the same path.
    append_slot = append_slots

    def _count_internal(self, seq: Sequence) -> None:
        """Once a sequence holds its final block, the slots past its final length are internal waste."""
        final = seq.final_len
        if final is not None and len(seq.block_table) * self.block_size >= final:
            waste = len(seq.block_table) * self.block_size - final
            self._internal += waste - seq._internal_counted
            seq._internal_counted = waste

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Let `child` share every block of `parent`; nothing is copied."""
        if parent.seq_id not in self._seqs:
            raise AllocationError(f"cannot fork sequence {parent.seq_id}: it holds no device blocks")
        if child.seq_id in self._seqs or child.seq_id in self._cpu_seqs:
            raise AllocationError(f"cannot fork into sequence {child.seq_id}: it already holds blocks")
        for bid in parent.block_table:
            self._incref(bid, parent.request_id)
        child.block_table = list(parent.block_table)
        child.num_tokens = parent.num_tokens
        self._seqs[child.seq_id] = child
        if self.debug:
            self.check_invariants()
        return _NO_COPIES

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (last block first, so tails are evicted before shared heads)."""
        if seq.seq_id in self._seqs:
            self._release_device(seq)
        elif seq.seq_id in self._cpu_seqs:
            del self._cpu_seqs[seq.seq_id]
            for cid in seq.cpu_block_table:
                self._cpu_decref(cid)
            seq.cpu_block_table = []
        else:
            raise AllocationError(f"cannot free sequence {seq.seq_id}: it holds no blocks (freed twice?)")
        seq.num_tokens = 0
        if self.debug:
            self.check_invariants()

    # ----------------------------------------------------------------- debugging
    def check_invariants(self) -> None:
        """Recompute ref counts, pools and fill levels from the block tables; raise on any mismatch."""
        from simulator.core.invariants import check_block_manager
        check_block_manager(self)


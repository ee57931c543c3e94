"""The paged allocator of a model with several KV cache groups (simulator/core/kv_layout.py), as vLLM v1's
KVCacheManager with a HybridKVCacheCoordinator runs them.

All groups draw equal blocks from ONE BlockPool (one free stack, one LRU of cached free blocks); every
sequence has a block table per group. A full-attention group keeps a block per `block_size` tokens; a
sliding-window group hands a block back to the pool as soon as every token in it has left the window
(`SlidingWindowManager.remove_skipped_blocks`: a token is skipped once `window - 1` newer tokens are
computed), leaving a hole (vLLM's null block) in its table. A prefix-cache hit holds only where every
group hits (each group's `find_longest_cache_hit`, then the coordinator shrinks the hit until all agree);
a sliding group needs only the last `ceil((window - 1) / block_size)` blocks before the hit's end.

Published blocks carry their group in their content key (vLLM's BlockHashWithGroupId), so a group only
ever hits its own blocks. Memory is counted in layer slots: a block is `block_size` token slots in each of
`group_size` layers, of which a padded group leaves `padding` layers unused (`padding` in the breakdown,
counted as internal fragmentation, waste inside held blocks).
"""
from __future__ import annotations

from collections.abc import Callable

from simulator.core.allocator import AllocStatus, EventLog, HybridBreakdown, KVAllocator
from simulator.core.errors import AllocationError
from simulator.core.kv_layout import KVLayout
from simulator.core.paged.block_pool import BlockManagerStats, BlockPool, PoolCounts, count_apart, hit_counts
from simulator.core.paged.kv_group_swap import GroupSwap
from simulator.core.paged.kv_group_tables import GroupTables
from simulator.core.sequence import (
    Sequence,
    SequenceGroup,
    SequenceStatus,
    shared_prompt_blocks,
    shares_allocation,
)

_NO_COPIES: list = []


class GroupedBlockManager(PoolCounts, KVAllocator):
    """Paged allocator over `num_blocks` blocks shared by the layout's KV cache groups."""

    name = "paged"
    shares_prompt = True

    def __init__(self, num_blocks: int, layout: KVLayout, *, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.0, debug: bool = False,
                 hash_fn: Callable[[object], int] = hash, record_events: bool = False,
                 prefill_chunk: int | None = None):
        self.check_sizes(num_blocks, num_cpu_blocks, watermark)
        # Chunked prefill's largest chunk: a one-sequence prompt then gets the blocks of each chunk as it
        # is scheduled, its windows freeing what they passed in between (vLLM v1's `allocate_slots`), so
        # a sliding group never holds more than its window and a chunk. None: all blocks at admission.
        self.prefill_chunk = prefill_chunk
        # Such a prompt is admitted only while all of it fits (vLLM's `can_fit_full_sequence` gate): every
        # block of it in a full group, at most what a sliding group holds while prefilling by chunks (the
        # cap vLLM 0.20 puts on the gate, `max_admission_blocks_per_request`, which startup also sizes by).
        self.admission_caps = None if prefill_chunk is None else \
            [g.spec.max_blocks(1 << 62, prefill_chunk) for g in layout.groups]
        self.layout = layout
        self.block_size = layout.block_size
        self.num_blocks = num_blocks
        self.capacity_tokens = layout.num_tokens(num_blocks)  # each block holds one group's page
        self.capacity_slots = num_blocks * self.block_size
        self.block_slots = self.block_size * layout.group_size  # layer slots of one block (breakdown)
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.debug = debug
        self.stats = BlockManagerStats()
        self.events = EventLog() if record_events else None
        self.pool = BlockPool(num_blocks, self.block_size, self.stats, self.events)
        self.seqs: dict[int, Sequence] = {}  # sequences holding device blocks, by id
        self.tables = GroupTables(self.pool, self.seqs, layout, enable_prefix_caching, hash_fn)
        self.swap = GroupSwap(num_cpu_blocks, self.tables)
        self.tiers = None  # the CPU and disk tiers behind the pool, when attached (kv_group_tiers.py)

    # ----------------------------------------------------------------- counts
    @property
    def num_internal_slots(self) -> int:
        """Layer slots past final lengths in final blocks."""
        return self.tables.num_internal_slots

    # ----------------------------------------------------------------- queries
    def can_allocate(self, group: SequenceGroup, num_new_tokens: int | None = None) -> AllocStatus:
        """OK, LATER, or NEVER for the group's prompt in every KV cache group (allocating by chunk: for
        its first `num_new_tokens` past the hit)."""
        seqs = self._allocation_seqs(group)
        chunked = self.by_chunk(len(group.live_seqs()))
        if self._peak_blocks(seqs, chunked) > self.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        first_chunk = chunked and num_new_tokens is not None
        shared = shared_prompt_blocks(seqs, self.block_size) if len(seqs) > 1 else 0
        needed = 0
        if shared:  # the others share the first one's prompt blocks (and so its hits)
            needed = sum(-(-s.length // self.block_size) - shared for s in seqs[1:]) * self.tables.num_groups
            seqs = seqs[:1]
        for s in seqs:
            hit, blocks = self.tables.longest_hit(s)
            held = self.tables.num_held(blocks)
            if first_chunk and self.pool.num_free - (self._admission_blocks(s.length, hit) - held) < \
                    self.watermark_blocks:
                return AllocStatus.LATER  # its first chunk may fit, but not the whole prompt
            if first_chunk and self.tiers is not None:
                # Tiers may extend the hit by pages each needing a fresh block, as far as the whole prompt:
                # count the widest first step a sliding group can take (what the NEVER bound allows).
                needed += self.tables.peak_blocks(s.length, num_new_tokens)
            else:
                slots = min(s.length, hit * self.block_size + num_new_tokens) if first_chunk else s.length
                needed += self.tables.prompt_blocks(slots, hit)
            needed -= held
        if self.pool.num_free - needed < self.watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def _admission_blocks(self, length: int, hit: int) -> int:
        """Blocks the admission gate asks free for a prompt of `length` tokens with `hit` blocks hit:
        each group's capped count from the hit on, and the hit blocks its window keeps (vLLM counts those
        of them in the free queue)."""
        total, first_held = -(-length // self.block_size), self.tables.first_held
        return sum(max(min(total, cap), hit) - first_held(g, hit)
                   for g, cap in enumerate(self.admission_caps))

    def can_ever_allocate(self, group: SequenceGroup) -> bool:
        """Whether the group's peak holding fits the pool at all."""
        peak = self._peak_blocks(self._allocation_seqs(group), self.by_chunk(len(group.live_seqs())))
        return peak <= self.num_blocks - self.watermark_blocks

    def _allocation_seqs(self, group: SequenceGroup) -> list[Sequence]:
        seqs = group.live_seqs()
        if not seqs:
            raise AllocationError(f"request {group.request_id}: every sequence has finished")
        return seqs[:1] if len(seqs) > 1 and shares_allocation(seqs) else seqs

    def by_chunk(self, num_seqs: int) -> bool:
        """Whether a prompt of `num_seqs` live sequences is allocated chunk by chunk: one sequence under
        chunked prefill."""
        return self.prefill_chunk is not None and num_seqs == 1

    def _peak_blocks(self, seqs: list[Sequence], by_chunk: bool) -> int:
        """Blocks the sequences hold at most at once: their prompts together (or, `by_chunk`, one prompt's
        widest step), or one at its final length."""
        if by_chunk:
            prompts = self.tables.peak_blocks(seqs[0].length, self.prefill_chunk)
        else:
            prompts = sum(self.tables.prompt_blocks(s.length, 0) for s in seqs)
            prompts -= shared_prompt_blocks(seqs, self.block_size) * self.tables.num_groups * (len(seqs) - 1)
        final = max(self.tables.peak_blocks(max(s.length, s.final_len or 0)) for s in seqs)
        return max(prompts, final)

    def can_append(self, seqs: list[Sequence], num_tokens: int = 1) -> bool:
        """Whether every sequence can grow by `num_tokens` (after its window frees what it skips)."""
        need = 0
        for s in seqs:
            if s.num_tokens + num_tokens > s._limit:
                return False
            need += self.tables.append_need(s, num_tokens)
        return need <= self.pool.num_free

    def can_fork(self, parent: Sequence) -> bool:
        """Forking shares every block, so it always fits."""
        return True

    def breakdown(self, head: SequenceGroup | None = None) -> HybridBreakdown:
        """The taxonomy in layer slots; padding layers count as internal fragmentation (and as `padding`),
        window-released blocks the prefix cache keeps as cached free memory (and as `window_cached`)."""
        bs, width, t = self.block_size, self.layout.group_size, self.tables
        tokens = empty = padding = 0
        for g, spec in enumerate(t.specs):
            filled = t.filled_in[g] + t.quiet_total  # pending decode tokens sit in every group
            tokens += filled * spec.layers
            empty += (t.held_in[g] * bs - filled) * spec.layers
            padding += t.held_in[g] * bs * spec.padding
        internal = min(self.num_internal_slots, empty)
        num_free = self.pool.num_free
        return HybridBreakdown(self.num_blocks * bs * width, tokens, empty - internal, internal + padding, 0,
                               num_free * bs * width, len(self.pool.free_cached) * bs * width,
                               (self.num_blocks - num_free) * bs * width, padding,
                               len(t.window_released) * bs * width)  # all cached free (invariants.py)

    def padding_slots(self) -> int:
        """Layer slots of held blocks that padding layers leave unused."""
        t = self.tables
        return sum(t.held_in[g] * self.block_size * s.padding for g, s in enumerate(t.specs))

    def window_cached_blocks(self) -> int:
        """Free blocks a sliding window handed back that the prefix cache still keeps."""
        kept = self.tables.window_released
        kept.intersection_update(self.pool.free_cached)
        return len(kept)

    # ----------------------------------------------------------------- mutations
    def allocate(self, group: SequenceGroup, num_new_tokens: int | None = None) -> int:
        """Blocks for every token of the group's live sequences in every group; return prefix-hit tokens."""
        seqs = group.live_seqs()
        for s in seqs:
            if s.seq_id in self.seqs or s.seq_id in self.swap.seqs:
                raise AllocationError(f"sequence {s.seq_id} already holds blocks")
        status = self.can_allocate(group, num_new_tokens)
        if status is not AllocStatus.OK:
            raise AllocationError(f"request {group.request_id}: cannot allocate its blocks now "
                                  f"({status.value}); {self.num_free_blocks} free")
        budget = (1 << 62) if num_new_tokens is None else num_new_tokens
        before = hit_counts(self.stats, self.tiers) if group.readmitted else None
        if len(seqs) == 1 or shares_allocation(seqs):
            chunked = num_new_tokens is not None and self.by_chunk(len(seqs))
            hit = self.tables.allocate_one(seqs[0], group.request_id, budget, chunked)
            for s in seqs[1:]:
                self.tables.share_tables(seqs[0], s)
                s.num_cached_tokens = seqs[0].num_cached_tokens
        else:
            hit = 0
            shared = shared_prompt_blocks(seqs, self.block_size)
            for s in seqs:
                if shared and s is not seqs[0]:
                    self.tables.share_prompt(seqs[0], s, shared)
                else:
                    hit += self.tables.allocate_one(s, group.request_id, budget)
                budget = max(0, budget - (s.length - s.num_cached_tokens))
        if before is not None:
            count_apart(self.stats, self.tiers, before)
        self._check()
        return hit

    def cache_blocks(self, group: SequenceGroup, num_left: int) -> None:
        """Publish the full blocks whose tokens are computed once `num_left` prompt tokens are left."""
        if not self.enable_prefix_caching:
            return
        seqs = [s for s in group.live_seqs() if s.seq_id in self.seqs]
        if len(seqs) > 1 and shares_allocation(seqs):
            seqs = seqs[:1]
        bs = self.block_size
        for s in reversed(seqs):
            uncomputed = min(num_left, s.length - s.num_cached_tokens)
            num_left -= uncomputed
            self.tables.publish_range(s, s.num_cached_tokens // bs, (s.length - uncomputed) // bs)

    def append_slot(self, seq: Sequence, num_tokens: int = 1) -> list[tuple[int, int]]:
        """Free what the windows skip, then grow every group's table by `num_tokens`."""
        if seq.seq_id in self.seqs and num_tokens <= seq._limit - seq.num_tokens and not self.debug \
                and self.tables.quiet(seq, num_tokens):
            return self.tables.grow(seq, num_tokens)  # the common decode token: nothing to check
        if seq.seq_id not in self.seqs:
            state = "finished" if seq.status is SequenceStatus.FINISHED else "not allocated (or swapped out)"
            raise AllocationError(f"cannot append to sequence {seq.seq_id}: it is {state}")
        if seq.status is SequenceStatus.FINISHED:
            raise AllocationError(f"cannot append to sequence {seq.seq_id}: it is finished")
        if num_tokens < 0:
            raise AllocationError(f"cannot append a negative number of tokens ({num_tokens})")
        if num_tokens == 0:
            return _NO_COPIES
        if seq.num_tokens + num_tokens > seq._limit:
            raise AllocationError(f"sequence {seq.seq_id} would grow past its final length {seq.final_len}")
        if not self.can_append([seq], num_tokens):
            raise AllocationError(f"out of KV blocks: sequence {seq.seq_id} needs "
                                  f"{self.tables.append_need(seq, num_tokens)} blocks, "
                                  f"{self.num_free_blocks} free")
        copies = self.tables.grow(seq, num_tokens)
        self._check()
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Let `child` share every block of every group of `parent`."""
        if parent.seq_id not in self.seqs:
            raise AllocationError(f"cannot fork sequence {parent.seq_id}: it holds no device blocks")
        if child.seq_id in self.seqs or child.seq_id in self.swap.seqs:
            raise AllocationError(f"cannot fork into sequence {child.seq_id}: it already holds blocks")
        self.tables.share_tables(parent, child)
        self._check()
        return _NO_COPIES

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks in every group."""
        if seq.seq_id in self.seqs:
            self.tables.release_device(seq)
        elif seq.seq_id in self.swap.seqs:
            self.swap.drop(seq)
        else:
            raise AllocationError(f"cannot free sequence {seq.seq_id}: it holds no blocks (freed twice?)")
        self.tables.forget(seq)
        seq.num_tokens = 0
        self._check()

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the CPU pool has room for the group's distinct blocks of every group."""
        return len(self.swap.distinct_blocks(group)) <= len(self.swap.free)

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        """OK, LATER or NEVER for bringing the group's blocks back plus each sequence's next slots."""
        need = self.swap.swap_in_need(group)
        if need > self.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.pool.num_free - need < self.watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's blocks of every group to the CPU pool."""
        if not self.can_swap_out(group):
            raise AllocationError(f"request {group.request_id}: CPU swap pool is full "
                                  f"({len(self.swap.free)} blocks free)")
        copies = self.swap.move_out(group)
        if self.tiers is not None:  # the swapped blocks take their room from the CPU tier
            self.tiers.fit()
        self._check()
        return copies

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Bring the group's blocks back into fresh device blocks."""
        status = self.can_swap_in(group)
        if status is not AllocStatus.OK:
            raise AllocationError(f"request {group.request_id}: cannot swap in now ({status.value}); "
                                  f"{self.pool.num_free} device blocks free")
        copies = self.swap.move_in(group)
        self._check()
        return copies

    def _check(self) -> None:
        if self.debug:
            from simulator.core.invariants import check_invariants

            check_invariants(self)

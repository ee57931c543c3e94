"""What fits, for the BlockManager: the query half of its query/act pairs (nothing here changes state).

A mixin of `BlockManager` (block_manager.py), which owns the state it reads: the free pools `_free`
and `_free_cached`, ref counts `_ref`, `num_blocks`, `watermark_blocks`, and the prefix cache's
`_lookup` (prefix_cache.py).
"""
from __future__ import annotations

from simulator.core.allocator import AllocStatus
from simulator.core.errors import AllocationError
from simulator.core.sequence import Sequence, SequenceGroup, shares_allocation


class BlockQueries:
    """can_allocate / can_ever_allocate / can_append / can_fork."""

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """OK, LATER, or NEVER for the group's prompt (prefix hits on referenced blocks cost nothing)."""
        seqs = self._allocation_seqs(group)
        needed = self._never_needed(seqs)
        if needed < 0:
            return AllocStatus.NEVER
        # Hits on referenced blocks cost nothing; hits on evictable ones use up a free block like a miss.
        if self.enable_prefix_caching:
            ref = self._ref
            for s in seqs:
                for b in self._lookup(s):
                    if ref[b] > 0:
                        needed -= 1
        if len(self._free) + len(self._free_cached) - needed < self.watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def can_ever_allocate(self, group: SequenceGroup) -> bool:
        """Whether `can_allocate` would not answer NEVER: that depends only on the group's lengths."""
        return self._never_needed(self._allocation_seqs(group)) >= 0

    def _allocation_seqs(self, group: SequenceGroup) -> list[Sequence]:
        """The live sequences `allocate` gives blocks to one by one (equal ones share a single table)."""
        seqs = group.live_seqs()
        if not seqs:
            raise AllocationError(f"request {group.request_id}: every sequence has finished")
        if len(seqs) > 1 and shares_allocation(seqs):
            seqs = seqs[:1]
        return seqs

    def _never_needed(self, seqs: list[Sequence]) -> int:
        """Blocks the sequences' tokens need (before prefix hits), or -1 when they could never fit (a
        sequence whose final length can never fit would preempt itself forever: refuse it now)."""
        bs = self.block_size
        needed = final = 0
        for s in seqs:
            n = s.prompt_len + s.num_generated  # s.length
            needed += -(-n // bs)
            f = s.final_len
            m = -(-(f if f is not None and f > n else n) // bs)
            if m > final:
                final = m
        return -1 if max(needed, final) > self.num_blocks - self.watermark_blocks else needed

    def can_append(self, seq: Sequence, num_tokens: int = 1) -> bool:
        """Whether enough free blocks exist to grow `seq` by `num_tokens` (copy-on-write included)."""
        return seq.num_tokens + num_tokens <= seq._limit and \
            self._blocks_needed_to_append(seq, num_tokens) <= self.num_free_blocks

    def can_append_seqs(self, seqs: list[Sequence], num_tokens: int = 1) -> bool:
        """Whether all `seqs` can grow by `num_tokens` each at once."""
        need = 0
        for s in seqs:
            if s.num_tokens + num_tokens > s._limit:
                return False
            need += self._blocks_needed_to_append(s, num_tokens)
        return need <= self.num_free_blocks

    def _blocks_needed_to_append(self, seq: Sequence, k: int) -> int:
        n, bs = seq.num_tokens, self.block_size
        new = self._blocks_for(n + k) - self._blocks_for(n)
        if n % bs and k > 0 and self._ref[seq.block_table[-1]] > 1:
            new += 1  # the shared partial last block must be copied first
        return new

    def can_fork(self, parent: Sequence) -> bool:
        """Forking shares every block, so it always fits."""
        return True

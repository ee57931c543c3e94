"""Swapping for the BlockManager: a CPU pool of blocks that preempted groups move to and come back from.

A mixin of `BlockManager` (block_manager.py), which owns the state: `_cpu_ref`, `_cpu_filled`,
`_cpu_key` and the free list `_cpu_free` of the CPU pool, and `_cpu_seqs`, the sequences swapped out.
"""
from __future__ import annotations

from simulator.core.errors import AllocationError
from simulator.core.sequence import SequenceGroup


class SwapMixin:
    """Device <-> CPU moves of whole sequence groups; blocks shared inside a group stay shared."""

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the CPU pool has room for the group's distinct blocks."""
        blocks = {b for s in group.seqs if s.seq_id in self._seqs for b in s.block_table}
        return len(blocks) <= len(self._cpu_free)

    def can_swap_in(self, group: SequenceGroup) -> bool:
        """Whether the device has room (above the watermark) for the group's distinct CPU blocks, plus one
        block per sequence for the slot each gets right after coming back."""
        seqs = [s for s in group.seqs if s.seq_id in self._cpu_seqs]
        blocks = {b for s in seqs for b in s.cpu_block_table}
        return self.num_free_blocks - len(blocks) - len(seqs) >= self.watermark_blocks

    def _cpu_decref(self, cid: int) -> None:
        self._cpu_ref[cid] -= 1
        if self._cpu_ref[cid] == 0:
            self._cpu_filled[cid] = 0
            self._cpu_key[cid] = None
            self._cpu_free.append(cid)

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's device blocks to the CPU pool; blocks shared inside the group stay shared."""
        seqs = [s for s in group.seqs if s.seq_id in self._seqs]
        if not self.can_swap_out(group):
            raise AllocationError(f"request {group.request_id}: CPU swap pool is full "
                                  f"({len(self._cpu_free)} of {self.num_cpu_blocks} blocks free)")
        mapping: dict[int, int] = {}
        for s in seqs:
            for bid in s.block_table:
                cid = mapping.get(bid)
                if cid is None:
                    cid = mapping[bid] = self._cpu_free.pop()
                    self._cpu_filled[cid] = self._filled[bid]
                    self._cpu_key[cid] = (self._key[bid], self._hash[bid]) if self._key[bid] else None
                self._cpu_ref[cid] += 1
            s.cpu_block_table = [mapping[b] for b in s.block_table]
        for s in seqs:
            self._release_device(s)
            self._cpu_seqs[s.seq_id] = s
        self.stats.swapped_out_blocks += len(mapping)
        if self.debug:
            self.check_invariants()
        return list(mapping.items())

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Bring the group's blocks back from the CPU pool into fresh device blocks."""
        seqs = [s for s in group.seqs if s.seq_id in self._cpu_seqs]
        if not self.can_swap_in(group):
            raise AllocationError(f"request {group.request_id}: not enough free device blocks to swap in")
        mapping: dict[int, int] = {}
        for s in seqs:
            table = []
            for cid in s.cpu_block_table:
                bid = mapping.get(cid)
                if bid is None:
                    bid = mapping[cid] = self._take(group.request_id)
                    self._filled[bid] = self._cpu_filled[cid]
                    self._total_filled += self._cpu_filled[cid]
                    saved = self._cpu_key[cid]
                    if saved is not None:
                        self._key[bid], self._hash[bid] = saved
                        self._cached.setdefault(saved[1], bid)
                else:
                    self._incref(bid, group.request_id)
                table.append(bid)
            s.block_table = table
        for s in seqs:
            del self._cpu_seqs[s.seq_id]
            for cid in s.cpu_block_table:
                self._cpu_decref(cid)
            s.cpu_block_table = []
            self._seqs[s.seq_id] = s
            self._count_internal(s)
        self.stats.swapped_in_blocks += len(mapping)
        if self.debug:
            self.check_invariants()
        return list(mapping.items())

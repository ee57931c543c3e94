"""Swapping for the BlockManager: a CPU pool of blocks that preempted groups move to and come back from.

A mixin of `BlockManager` (block_manager.py), which owns the state: `_cpu_ref`, `_cpu_filled`,
`_cpu_key` and the free list `_cpu_free` of the CPU pool, and `_cpu_seqs`, the sequences swapped out.
"""
from __future__ import annotations

from simulator.core.allocator import AllocStatus
from simulator.core.errors import AllocationError
from simulator.core.sequence import SequenceGroup


class SwapMixin:
    """Device <-> CPU moves of whole sequence groups; blocks shared inside a group stay shared."""

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the CPU pool has room for the group's distinct blocks."""
        blocks = {b for s in group.seqs if s.seq_id in self._seqs for b in s.block_table}
        return len(blocks) <= len(self._cpu_free)

    def _swap_in_plan(self, seqs: list) -> tuple[dict[int, int], int]:
        """CPU blocks of `seqs` still cached on the device (CPU id -> device block), and how many free
        device blocks swapping them in and giving each sequence its next slot takes."""
        bs = self.block_size
        resident: dict[int, int] = {}
        seen: set[int] = set()
        sharers: dict[int, int] = {}  # partly filled last block -> sequences appending to it
        need = 0
        for s in seqs:
            for cid in s.cpu_block_table:
                if cid in seen:
                    continue
                seen.add(cid)
                saved = self._cpu_key[cid]
                bid = self._cached.get(saved[1]) if saved is not None else None
                if bid is not None and self._key[bid] == saved[0]:
                    resident[cid] = bid
                    need += self._ref[bid] == 0  # a cached free block leaves the free pool
                else:
                    need += 1
            if s.num_tokens % bs == 0:
                need += 1  # the next token starts a new block
            else:  # every sequence but the last appending to a shared partial block writes to a copy
                last = s.cpu_block_table[-1]
                sharers[last] = sharers.get(last, 0) + 1
                need += sharers[last] > 1
        return resident, need

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        """OK, LATER, or NEVER for bringing the group back and giving each sequence its next slot: full
        blocks still cached on the device are shared again and cost nothing unless they were free."""
        seqs = [s for s in group.seqs if s.seq_id in self._cpu_seqs]
        if not seqs:
            return AllocStatus.OK
        _, need = self._swap_in_plan(seqs)
        if need > self.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.num_free_blocks - need < self.watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

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
        """Bring the group's blocks back; full blocks still cached on the device are shared again (as
        vLLM's prefix-caching allocator does), the rest are copied into fresh blocks."""
        seqs = [s for s in group.seqs if s.seq_id in self._cpu_seqs]
        status = self.can_swap_in(group)
        if status is not AllocStatus.OK:
            raise AllocationError(f"request {group.request_id}: cannot swap in now ({status.value}); "
                                  f"{self.num_free_blocks} device blocks free")
        rid = group.request_id
        resident, _ = self._swap_in_plan(seqs)
        # Claim the blocks shared again before taking fresh ones, which could otherwise evict them.
        for bid in resident.values():
            self._incref(bid, rid)
        unclaimed = set(resident)
        mapping: dict[int, int] = dict(resident)
        copies: list[tuple[int, int]] = []
        for s in seqs:
            table = []
            for cid in s.cpu_block_table:
                bid = mapping.get(cid)
                if cid in unclaimed:
                    unclaimed.discard(cid)  # its first holder: the reference was taken above
                elif bid is not None:
                    self._incref(bid, rid)
                else:
                    bid = mapping[cid] = self._take(1, rid)[0]
                    self._filled[bid] = self._cpu_filled[cid]
                    self._total_filled += self._cpu_filled[cid]
                    saved = self._cpu_key[cid]
                    if saved is not None:
                        self._key[bid], self._hash[bid] = saved
                        self._cached.setdefault(saved[1], bid)
                    copies.append((cid, bid))
                table.append(bid)
            s.block_table = table
        for s in seqs:
            del self._cpu_seqs[s.seq_id]
            for cid in s.cpu_block_table:
                self._cpu_decref(cid)
            s.cpu_block_table = []
            self._seqs[s.seq_id] = s
            self._count_internal(s)
        self.stats.swapped_in_blocks += len(copies)
        if self.debug:
            self.check_invariants()
        return copies

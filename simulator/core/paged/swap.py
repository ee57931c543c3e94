"""Swapping for the BlockManager: the CPU pool that preempted groups move to and come back from."""
from __future__ import annotations

from collections.abc import Callable

from simulator.core.allocator import AllocStatus
from simulator.core.errors import AllocationError
from simulator.core.paged.block_pool import BlockPool
from simulator.core.sequence import Sequence, SequenceGroup


def next_slot_blocks(num_tokens: int, last: int, block_size: int, sharers: dict[int, int]) -> int:
    """Device blocks a swapped-in sequence of `num_tokens` takes for its next token: a new one where that
    token starts a block; else a copy of its partly filled last block `last`, unless it is the first of
    the sequences appending to it (`sharers` counts them across calls)."""
    if num_tokens % block_size == 0:
        return 1
    sharers[last] = sharers.get(last, 0) + 1
    return sharers[last] > 1


class SwapSpace:
    """`num_blocks` CPU blocks: ref counts, fill levels and saved content keys, and the sequences swapped
    out; moves whole groups between the device pool and here (blocks shared inside a group stay shared).

    `held` are the sequences holding device blocks (the manager's); `release` drops a sequence's device
    blocks, `adopt` gives a sequence back its device accounting once its blocks are back.
    """

    def __init__(self, num_blocks: int, pool: BlockPool, held: dict[int, Sequence],
                 watermark_blocks: int) -> None:
        self.pool, self.held, self.watermark_blocks = pool, held, watermark_blocks
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.filled = [0] * num_blocks
        self.key: list[tuple | None] = [None] * num_blocks  # the device block's (key, hash), if published
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.seqs: dict[int, Sequence] = {}  # sequences swapped out, by id

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the CPU pool has room for the group's distinct device blocks."""
        held = self.held
        blocks = {b for s in group.seqs if s.seq_id in held for b in s.block_table}
        return len(blocks) <= len(self.free)

    def _swap_in_plan(self, seqs: list[Sequence]) -> tuple[dict[int, int], int]:
        """CPU blocks of `seqs` still cached on the device (CPU id -> device block), and how many free
        device blocks swapping them in and giving each sequence its next slot takes."""
        pool = self.pool
        bs = pool.block_size
        resident: dict[int, int] = {}
        seen: set[int] = set()
        sharers: dict[int, int] = {}  # partly filled last block -> sequences appending to it
        need = 0
        for s in seqs:
            for cid in s.cpu_block_table:
                if cid in seen:
                    continue
                seen.add(cid)
                saved = self.key[cid]
                bid = pool.cached.get(saved[1]) if saved is not None else None
                if bid is not None and pool.key[bid] == saved[0]:
                    resident[cid] = bid
                    need += pool.ref[bid] == 0  # a cached free block leaves the free pool
                else:
                    need += 1
            need += next_slot_blocks(s.num_tokens, s.cpu_block_table[-1], bs, sharers)
        return resident, need

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        """OK, LATER, or NEVER for bringing the group back and giving each sequence its next slot: full
        blocks still cached on the device are shared again and cost nothing unless they were free."""
        seqs = [s for s in group.seqs if s.seq_id in self.seqs]
        if not seqs:
            return AllocStatus.OK
        _, need = self._swap_in_plan(seqs)
        if need > self.pool.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.pool.num_free - need < self.watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def _decref(self, cid: int) -> None:
        self.ref[cid] -= 1
        if self.ref[cid] == 0:
            self.filled[cid] = 0
            self.key[cid] = None
            self.free.append(cid)

    def drop(self, seq: Sequence) -> None:
        """Free a swapped-out sequence's CPU blocks."""
        del self.seqs[seq.seq_id]
        for cid in seq.cpu_block_table:
            self._decref(cid)
        seq.cpu_block_table = []

    def swap_out(self, group: SequenceGroup, release: Callable[[Sequence], None]) -> list[tuple[int, int]]:
        """Move the group's device blocks here, then `release` each sequence's device blocks; return the
        (device, CPU) copies."""
        pool = self.pool
        seqs = [s for s in group.seqs if s.seq_id in self.held]
        if not seqs:
            raise AllocationError(f"request {group.request_id}: none of its sequences holds device blocks "
                                  "(not allocated, finished, or swapped out already)")
        if not self.can_swap_out(group):
            raise AllocationError(f"request {group.request_id}: CPU swap pool is full "
                                  f"({len(self.free)} of {self.num_blocks} blocks free)")
        mapping: dict[int, int] = {}
        for s in seqs:
            for bid in s.block_table:
                cid = mapping.get(bid)
                if cid is None:
                    cid = mapping[bid] = self.free.pop()
                    self.filled[cid] = pool.filled[bid]
                    self.key[cid] = (pool.key[bid], pool.hash[bid]) if pool.key[bid] else None
                self.ref[cid] += 1
            s.cpu_block_table = [mapping[b] for b in s.block_table]
        for s in seqs:
            release(s)
            self.seqs[s.seq_id] = s
        pool.stats.swapped_out_blocks += len(mapping)
        return list(mapping.items())

    def swap_in(self, group: SequenceGroup, adopt: Callable[[Sequence], None]) -> list[tuple[int, int]]:
        """Bring the group's blocks back: full blocks still cached on the device are shared again (as
        vLLM's prefix-caching allocator does), the rest are copied into fresh blocks; `adopt` each
        sequence; return the (CPU, device) copies."""
        pool = self.pool
        seqs = [s for s in group.seqs if s.seq_id in self.seqs]
        if not seqs:
            raise AllocationError(f"request {group.request_id}: none of its sequences is swapped out")
        status = self.can_swap_in(group)
        if status is not AllocStatus.OK:
            raise AllocationError(f"request {group.request_id}: cannot swap in now ({status.value}); "
                                  f"{pool.num_free} device blocks free")
        rid = group.request_id
        resident, _ = self._swap_in_plan(seqs)
        # Claim the blocks shared again before taking fresh ones, which could otherwise evict them.
        first_holder: dict[int, int] = {}
        for s in reversed(seqs):
            first_holder.update(dict.fromkeys(s.cpu_block_table, s.seq_id))
        for cid, bid in resident.items():
            pool.incref(bid, rid, first_holder[cid])
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
                    pool.incref(bid, rid, s.seq_id)
                else:
                    bid = mapping[cid] = pool.take(1, rid, s.seq_id)[0]
                    pool.filled[bid] = self.filled[cid]
                    pool.total_filled += self.filled[cid]
                    saved = self.key[cid]
                    if saved is not None:
                        pool.key[bid], pool.hash[bid] = saved
                        pool.cached.setdefault(saved[1], bid)
                    copies.append((cid, bid))
                table.append(bid)
            s.block_table = table
        for s in seqs:
            self.drop(s)
            adopt(s)
        pool.stats.swapped_in_blocks += len(copies)
        return copies

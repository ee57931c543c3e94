"""Swapping for the GroupedBlockManager: a CPU pool that holds a preempted group's blocks of every KV cache
group (holes of sliding windows stay holes) until they are copied back into fresh device blocks."""
from __future__ import annotations

from simulator.core.paged.kv_group_tables import GroupTables
from simulator.core.paged.swap import next_slot_blocks
from simulator.core.sequence import Sequence, SequenceGroup


class GroupSwap:
    """`num_blocks` CPU blocks: ref counts, fill levels, groups, and the swapped-out sequences' tables."""

    def __init__(self, num_blocks: int, tables: GroupTables) -> None:
        self.tables = tables
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self.ref = [0] * num_blocks
        self.filled = [0] * num_blocks
        self.group = [0] * num_blocks
        self.cpu_tables: dict[int, list[list[int | None]]] = {}
        self.starts: dict[int, list[int]] = {}  # each group's first block held, as on the device
        self.seqs: dict[int, Sequence] = {}  # sequences swapped out, by id

    def distinct_blocks(self, group: SequenceGroup) -> set[int]:
        """The device blocks the group's held sequences hold, in every KV cache group."""
        tables, held = self.tables.tables, self.tables.seqs
        return {b for s in group.seqs if s.seq_id in held
                for t in tables[s.seq_id] for b in t if b is not None}

    def swap_in_need(self, group: SequenceGroup) -> int:
        """Device blocks bringing the group back and giving each sequence its next slot take: its distinct
        CPU blocks and, in every KV cache group, `next_slot_blocks` (what the windows will free is not
        counted)."""
        bs = self.tables.block_size
        distinct: set[int] = set()
        sharers: dict[int, int] = {}  # partly filled last block -> sequences appending to it
        need = 0
        for s in group.seqs:
            for row in self.cpu_tables.get(s.seq_id, ()):
                distinct.update(c for c in row if c is not None)
                need += next_slot_blocks(s.num_tokens, row[-1], bs, sharers)
        return len(distinct) + need

    def move_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Copy the group's blocks here and release them on the device; return the (device, CPU) pairs."""
        t = self.tables
        pool = t.pool
        seqs = [s for s in group.seqs if s.seq_id in t.seqs]
        mapping: dict[int, int] = {}
        for s in seqs:
            t.settle(s.seq_id)
            self.starts[s.seq_id] = t.starts[s.seq_id]
            cpu = []
            for table in t.tables[s.seq_id]:
                row: list[int | None] = []
                for bid in table:
                    if bid is None:
                        row.append(None)
                        continue
                    cid = mapping.get(bid)
                    if cid is None:
                        cid = mapping[bid] = self.free.pop()
                        self.filled[cid], self.group[cid] = pool.filled[bid], t.group_of[bid]
                    self.ref[cid] += 1
                    row.append(cid)
                cpu.append(row)
            self.cpu_tables[s.seq_id] = cpu
        for s in seqs:
            t.release_device(s)
            self.seqs[s.seq_id] = s
        pool.stats.swapped_out_blocks += len(mapping)
        return list(mapping.items())

    def move_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Copy the group's CPU blocks into fresh device blocks (shared ones stay shared); return the
        (CPU, device) pairs."""
        t = self.tables
        seqs = [s for s in group.seqs if s.seq_id in self.seqs]
        rid = group.request_id
        mapping: dict[int, int] = {}
        for s in seqs:
            tables = []
            for row in self.cpu_tables[s.seq_id]:
                table: list[int | None] = []
                for cid in row:
                    if cid is None:
                        table.append(None)
                        continue
                    bid = mapping.get(cid)
                    if bid is None:
                        bid = mapping[cid] = t.take(self.group[cid], 1, rid, s.seq_id, [self.filled[cid]])[0]
                    else:
                        t.incref(bid, rid, s.seq_id)
                    table.append(bid)
                tables.append(table)
            t.tables[s.seq_id] = tables
            t.starts[s.seq_id] = list(self.starts[s.seq_id])
            t.next_removal(s.seq_id)
            t.pending[s.seq_id] = 0
            t.seqs[s.seq_id] = s
            t.count_internal(s)
        for s in seqs:
            t.mark_exclusive(s.seq_id)
            self.drop(s)
        t.pool.stats.swapped_in_blocks += len(mapping)
        return list(mapping.items())

    def drop(self, seq: Sequence) -> None:
        """Free a swapped-out sequence's CPU blocks."""
        del self.seqs[seq.seq_id]
        del self.starts[seq.seq_id]
        for row in self.cpu_tables.pop(seq.seq_id):
            for cid in row:
                if cid is None:
                    continue
                self.ref[cid] -= 1
                if self.ref[cid] == 0:
                    self.filled[cid] = 0
                    self.free.append(cid)

"""The decode batch (decode.py) over a pool of several KV cache groups (paged/kv_groups.py).

Every group shares the block size, so a plain decode token is one slot in each group's own last block
(GroupTables counts it as pending, `quiet`) except at a few predictable token counts n of the sequence:

- n % block_size == 0: every group takes a fresh block (the block boundary);
- n % block_size == (window - 1) % block_size for a sliding group: a block leaves that window and goes back
  to the pool (once n reaches the tables' `remove_at`, the first such count; earlier ones hand back nothing);
- (n + 1) % block_size == 0 for a sequence with real tokens: the block it fills is published.

So, as the one-group batch buckets sequences by the residue of their boundary, this batch files each
sequence under every residue of the phase at which one of those counts comes up, and visits only the
sequences of the current residue, in running order, with the same `GroupTables.grow` an exact step calls;
every other member's token is counted in bulk. Token counts, generated counts and pending decode tokens
live here until a sequence is settled (`settle`).
"""
from __future__ import annotations

from collections.abc import Mapping

from simulator.core.decode import DecodeBatch
from simulator.core.invariants import check_invariants
from simulator.core.sequence import Sequence, SequenceGroup, SequenceStatus


class GroupedDecodeBatch(DecodeBatch):
    """The running plain decodes of a GroupedBlockManager, advanced one step in O(sequences visited)."""

    grouped = True

    def __init__(self, alloc, prefill_left: Mapping[int, int], output_len: Mapping[int, int]):
        self.tables = alloc.tables
        super().__init__(alloc, prefill_left, output_len)
        self.block_size = alloc.block_size
        # Residues (of n, mod block_size) at which a sequence's window hands a block back.
        t = self.tables
        self.window_residues = sorted({(t.specs[g].window - 1) % self.block_size for g in t.windowed})
        self._reset()

    def _count_tokens(self, num_tokens: int) -> None:
        self.tables.quiet_total += num_tokens

    def _reset(self) -> None:
        super()._reset()
        self.pend: dict[Sequence, int] = {}  # pending decode tokens - phase (GroupTables.pending, lazily)
        self.residues: dict[Sequence, tuple[int, ...]] = {}  # the buckets each member is filed under

    # ----------------------------------------------------------------- membership
    def _joinable(self, g: SequenceGroup) -> bool:
        if g.beam_width > 1 or len(g.seqs) != 1 or g.request_id in self.prefill_left:
            return False
        s = g.seqs[0]
        out = self.output_len.get(g.request_id)
        if s.status is not SequenceStatus.RUNNING or out is None or s.final_len is None:
            return False
        left = out - s.num_generated
        if left < 1 or s.num_tokens + left > s.final_len:
            return False
        t, sid = self.tables, s.seq_id
        # A window that is already behind (a prompt longer than it, just prefilled), or a last block that
        # may be shared, is handled by an exact step's append first.
        return sid in t.seqs and t.exclusive[sid] and s.num_tokens < t.remove_at[sid]

    def _add(self, g: SequenceGroup) -> None:
        super()._add(g)
        s = g.seqs[0]
        d, bs = self.phase, self.block_size
        o = s.num_tokens - d
        self.pend[s] = self.tables.pending[s.seq_id] - d
        due = {-o % bs}
        due.update((r - o) % bs for r in self.window_residues)
        if s.token_ids is not None and self.tables.enabled:
            due.add((-o - 1) % bs)
        res = tuple(sorted(due))
        self.residues[s] = res
        for r in res:
            self.buckets[r].append(s)

    def _drop(self, s: Sequence) -> None:
        for r in self.residues.pop(s):
            self.buckets[r].remove(s)
        del self.pend[s]

    def settle(self, s: Sequence) -> None:
        """Write the sequence's token, generated and pending counts back to it and to the tables."""
        d = self.phase
        o, og = self.offsets[s]
        s.num_tokens = d + o
        s.num_generated = d + og
        self.tables.pending[s.seq_id] = d + self.pend[s]

    def remove(self, groups: list[SequenceGroup]) -> None:
        """Settle and drop members finished before their output length (see DecodeBatch.remove)."""
        super().remove(groups)
        for g in groups:
            self._drop(g.seqs[0])

    def pop_finished(self) -> list[SequenceGroup]:
        """Groups whose last token came out in the step just run, settled and removed."""
        done = super().pop_finished()
        for g in done:
            self._drop(g.seqs[0])
        return done

    # ----------------------------------------------------------------- advancing
    def _fits(self, due: list[Sequence]) -> bool:
        """Whether each of `due`, in order, finds the free blocks its append needs (the exact step's
        `can_append`, after the appends before it): each takes a block per group at a boundary and
        hands back the window blocks it alone holds."""
        t, d, bs = self.tables, self.phase, self.block_size
        free = self.alloc.pool.num_free
        takes = sum(1 for s in due if not (d + self.offsets[s][0]) % bs) * t.num_groups
        if takes <= free:
            return True  # even without what the windows hand back
        ref = self.alloc.pool.ref
        dropped: dict[int, int] = {}  # holders that earlier appends of this step let go of
        for s in due:
            n = d + self.offsets[s][0]
            need = 0 if n % bs else t.num_groups
            sid = s.seq_id
            if n >= t.remove_at[sid]:
                tables, starts = t.tables[sid], t.starts[sid]
                for g in t.windowed:
                    for i in range(starts[g], t.skipped(g, n)):
                        bid = tables[g][i]
                        left = ref[bid] - dropped.get(bid, 0)
                        if left == 1:
                            need -= 1
                        dropped[bid] = dropped.get(bid, 0) + 1
            if need > free:
                return False
            free -= need
        return True

    def advance_one(self) -> bool:
        """One decode step's appends, if the free blocks cover them (else False, and nothing happened)."""
        d = self.phase
        due = self.buckets[d % self.block_size]
        if due:
            if not self._fits(due):
                return False
            t, offsets, pend = self.tables, self.offsets, self.pend
            pending, grow = t.pending, t.grow
            for s in due:
                s.num_tokens = d + offsets[s][0]
                pending[s.seq_id] = d + pend[s]
                grow(s, 1)
                pend[s] = pending[s.seq_id] - d - 1
        self._count_tokens(self.size - len(due))
        self.phase = d + 1
        if self.eager:
            self.settle_all()
            check_invariants(self.alloc)
            for s in self.pend:  # the check settled every pending token
                self.pend[s] = self.tables.pending[s.seq_id] - self.phase
        return True

    def advance(self, k: int, times: list[float] | None = None) -> list[Sequence]:
        """One decode step (a grouped pool takes no spans); return nothing (blocks are logged as taken)."""
        if k != 1 or not self.advance_one():
            raise ValueError("a grouped decode batch advances one step at a time, with free blocks for it")
        return []

"""Block tables kept across steps: a step appends the blocks a sequence gained, it does not rebuild them.

Each sequence holding paged KV owns one row of a persistent [rows, max_blocks] int64 array. A decode
step adds at most one block per sequence every block_size steps, so per step the store copies a few
new block ids instead of every table; the step's [B, max_blocks] tables are one fancy-index gather.
What may rewrite a table in place rather than append to it: copy-on-write replaces the last block
(caught by comparing it), swap-in and re-admission after a preemption replace all of them (the
engine calls `forget` for those groups), a beam fork creates a new sequence (a new row).
"""
from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as SeqLike

import numpy as np


class BlockTableStore:
    """Persistent per-sequence block-table rows (the paged half of the engine's input batch)."""

    def __init__(self, max_blocks: int, rows: int = 64):
        self.table = np.zeros((rows, max(max_blocks, 1)), dtype=np.int64)
        self.lens = np.zeros(rows, dtype=np.int64)
        self.rows: dict[int, int] = {}
        self._free = list(range(rows - 1, -1, -1))

    def row(self, seq_id: int, blocks: SeqLike[int]) -> int:
        """The row of `seq_id`, brought up to date with `blocks` (appending only what is new)."""
        r = self.rows.get(seq_id)
        n = len(blocks)
        if r is None:
            r = self._take(seq_id)
            self.table[r, :n] = blocks
        else:
            have = int(self.lens[r])
            if n > have and (have == 0 or blocks[have - 1] == self.table[r, have - 1]):
                self.table[r, have:n] = blocks[have:]  # appended blocks only
            elif n != have or (n and blocks[-1] != self.table[r, n - 1]):
                self.table[r, :n] = blocks  # shrunk or last block replaced (copy-on-write)
        self.lens[r] = n
        return r

    def gather(self, rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """([B, width] tables of `rows`, their lengths); width = the longest of them (>= 1)."""
        idx = np.asarray(rows, dtype=np.int64)
        lens = self.lens[idx]
        width = max(int(lens.max()), 1) if len(idx) else 1
        return self.table[idx, :width], lens

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Drop rows whose blocks were replaced or freed (preempted, swapped in, finished)."""
        for seq_id in seq_ids:
            r = self.rows.pop(seq_id, None)
            if r is not None:
                self._free.append(r)

    def retain(self, live: set[int]) -> None:
        """Drop every row whose sequence is not in `live` (rows of finished beams, say)."""
        self.forget([s for s in self.rows if s not in live])

    def _take(self, seq_id: int) -> int:
        if not self._free:  # double the rows
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        r = self._free.pop()
        self.rows[seq_id] = r
        return r

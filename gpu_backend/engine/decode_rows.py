"""The decode batch's sequences as rows of persistent arrays: what a decode step reads and writes.

While the scheduler's decode batch (simulator/core/decode.py) holds the running requests, each of them is
a row here: its last token, the position and cache slot of the token it computes next, its sampling
settings and its draw count, and a block-table row (InputBuffers.table). A step advances every row with a
few vector operations; only rows that start a new block (one in block_size) or that join or leave are
visited one by one. Rows are kept dense: a leaving row's place goes to the last row (as vLLM v1 condenses
its input batch), so the forward's order is the rows' order, not the admission order; `rank` keeps the
admission order, in which finished requests are freed (as the exact step frees them).
"""
from __future__ import annotations

from collections import deque

import numpy as np

from gpu_backend.engine.input_buffers import InputBuffers
from gpu_backend.engine.requests import RequestState
from simulator.core.sequence import Sequence, SequenceGroup

_NONE = np.zeros(0, dtype=np.int64)


class DecodeRows:
    """Per-row state of the decode batch, in the forward's order."""

    def __init__(self, capacity: int, block_size: int, contiguous: bool, buffers: InputBuffers):
        self.capacity = capacity
        self.block_size = block_size
        self.contiguous = contiguous
        self.buffers = buffers
        self.n = 0
        self.seqs: list[Sequence] = []
        self.groups: list[SequenceGroup] = []
        self.token_lists: list[list[int]] = []  # each row's token_ids, appended in place
        self.row_of: dict[int, int] = {}  # seq id -> row
        self.next_rank = 0
        self.random = 0  # rows sampled with temperature > 0
        self.stopping = 0  # rows that stop at EOS
        self.last = np.zeros(capacity, dtype=np.int64)  # the token each row feeds next
        # Advanced together, one vector operation a step: the position the token is computed at, its
        # cache slot (unless it starts a block), and the tokens the row has drawn (its seeded stream).
        self.counters = np.zeros((3, capacity), dtype=np.int64)
        self.pos, self.slot, self.draw = self.counters
        self.rank = np.zeros(capacity, dtype=np.int64)  # admission order
        self.temp = np.zeros(capacity, dtype=np.float64)
        self.top_p = np.ones(capacity, dtype=np.float64)
        self.top_k = np.zeros(capacity, dtype=np.int64)
        self.seed = np.full(capacity, -1, dtype=np.int64)
        self.stops = np.zeros(capacity, dtype=bool)  # EOS ends the row (ignore_eos unset)
        self._arrays = (self.last, self.pos, self.slot, self.draw, self.rank, self.temp, self.top_p,
                        self.top_k, self.seed, self.stops)

    # ----------------------------------------------------------------- membership
    def add(self, group: SequenceGroup, state: RequestState) -> None:
        """A settled one-sequence group joins as the last row (its token has no slot yet)."""
        r = self.n
        if r >= self.capacity:
            raise RuntimeError(f"the decode batch holds more than {self.capacity} rows")
        s = group.seqs[0]
        params = state.params
        pos = s.num_tokens
        self.last[r] = s.token_ids[-1]
        self.pos[r] = pos
        self.draw[r] = s.num_generated
        self.rank[r] = self.next_rank
        self.next_rank += 1
        self.temp[r] = params.temperature
        self.top_p[r] = params.top_p
        self.top_k[r] = params.top_k
        self.seed[r] = state.seeds[s.seq_id]
        self.stops[r] = not params.ignore_eos
        self.random += params.temperature > 0
        self.stopping += not params.ignore_eos
        bs = self.block_size
        if self.contiguous:
            start = s.region[0]
            self.buffers.set_cell(r, 0, start)
            self.slot[r] = start + pos
        else:
            self.buffers.set_row(r, s.block_table)
            self.slot[r] = s.block_table[pos // bs] * bs + pos % bs if pos % bs else 0
        self.seqs.append(s)
        self.groups.append(group)
        self.token_lists.append(s.token_ids)
        self.row_of[s.seq_id] = r
        self.n = r + 1

    def remove(self, rows: list[int]) -> None:
        """Drop rows; the last row moves into each hole."""
        for r in sorted(rows, reverse=True):
            last = self.n - 1
            s = self.seqs[r]
            del self.row_of[s.seq_id]
            self.random -= int(self.temp[r] > 0)
            self.stopping -= int(self.stops[r])
            if r != last:
                for a in self._arrays:
                    a[r] = a[last]
                moved = self.seqs[last]
                self.seqs[r], self.groups[r] = moved, self.groups[last]
                self.token_lists[r] = self.token_lists[last]
                self.row_of[moved.seq_id] = r
                if self.contiguous:
                    self.buffers.set_cell(r, 0, moved.region[0])
                else:
                    self.buffers.set_row(r, moved.block_table)
            self.seqs.pop()
            self.groups.pop()
            self.token_lists.pop()
            self.n = last

    def clear(self) -> list[Sequence]:
        """Forget every row; return their sequences."""
        seqs = self.seqs
        self.seqs, self.groups, self.token_lists = [], [], []
        self.row_of.clear()
        self.n = self.random = self.stopping = 0
        return seqs

    # ----------------------------------------------------------------- one step
    def write_inputs(self, ids: np.ndarray, pos: np.ndarray, slots: np.ndarray, ctx: np.ndarray) -> int:
        """Fill the first n entries of the step's sections (after the scheduler appended the slots);
        return the longest context. Rows whose token starts a block read it from their block table."""
        n = self.n
        p = self.pos[:n]
        if not self.contiguous:
            bs = self.block_size
            starts = np.flatnonzero(p % bs == 0)
            if starts.size:
                seqs, slot, set_cell = self.seqs, self.slot, self.buffers.set_cell
                for r, k in zip(starts.tolist(), (p[starts] // bs).tolist(), strict=True):
                    bid = seqs[r].block_table[k]
                    set_cell(r, k, bid)
                    slot[r] = bid * bs
        ids[:n] = self.last[:n]
        pos[:n] = p
        slots[:n] = self.slot[:n]
        np.add(p, 1, out=ctx[:n])
        return int(ctx[:n].max())

    def advance(self, tokens: np.ndarray) -> None:
        """Record the step's sampled tokens (one per row): the next step feeds them one position on."""
        n = self.n
        deque(map(list.append, self.token_lists, tokens.tolist()), maxlen=0)
        self.last[:n] = tokens
        self.counters[:, :n] += 1

    def stopped(self, tokens: np.ndarray, eos: np.ndarray) -> np.ndarray:
        """Rows whose sampled token is an end-of-sequence id they stop at."""
        if not self.stopping or not eos.size:
            return _NONE
        hit = tokens == eos[0] if eos.size == 1 else np.isin(tokens, eos)
        return np.flatnonzero(hit & self.stops[:self.n])

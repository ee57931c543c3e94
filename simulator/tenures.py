"""Pairing acquisitions with releases into tenures, in batches, with numpy.

`OpenTenures` holds the tenures not yet handed to the sink, as columns sorted by acquisition number
(`row`). Each flush appends the acquisitions recorded since the last one, scatters the releases and
shares into place (`searchsorted` finds each row), and hands the sink every tenure released strictly
before the flush time, sorted by (release time, acquisition). A release at the flush time itself waits
for the next flush, so a later release at that same time still sorts among them: the concatenation of
all batches is then sorted by (t_end_s, acquisition) whatever the flush times were. What stays open is
bounded by the pool (one open tenure per held block), so memory does not grow with the run.
"""
from __future__ import annotations

import numpy as np

from simulator.sinks import EVENT_DTYPES, EventSink

_INT32_MAX = np.iinfo(np.int32).max
_COLUMNS = ("request_id", "start", "size", "t_start_s", "t_end_s", "max_ref_count", "filled")


class OpenTenures:
    """Tenures acquired but not yet written, with their release (NaN: still held) and share data."""

    def __init__(self) -> None:
        self.row = np.zeros(0, np.int64)
        self.cols = {c: np.zeros(0, EVENT_DTYPES[c]) for c in _COLUMNS}

    def __len__(self) -> int:
        return len(self.row)

    def add(self, first_row: int, request_id: np.ndarray, start: np.ndarray, size: np.ndarray,
            t_start: np.ndarray) -> None:
        """Append acquisitions numbered first_row, first_row + 1, ... (still held, one owner)."""
        n = len(start)
        if n == 0:
            return
        if start.max() + size.max() > _INT32_MAX or request_id.max() > _INT32_MAX:
            raise ValueError("pool offsets and request ids must fit in int32 for the events table")
        new = {"request_id": request_id, "start": start, "size": size, "t_start_s": t_start,
               "t_end_s": np.full(n, np.nan), "max_ref_count": np.ones(n), "filled": np.zeros(n)}
        self.row = np.concatenate([self.row, np.arange(first_row, first_row + n, dtype=np.int64)])
        self.cols = {c: np.concatenate([self.cols[c], new[c].astype(EVENT_DTYPES[c], copy=False)])
                     for c in _COLUMNS}

    def release(self, rows: np.ndarray, t_end: np.ndarray, filled: np.ndarray) -> None:
        """Mark the tenures of acquisition numbers `rows` released at `t_end` holding `filled` tokens."""
        if len(rows):
            pos = np.searchsorted(self.row, rows)
            self.cols["t_end_s"][pos] = t_end
            self.cols["filled"][pos] = filled

    def share(self, rows: np.ndarray, ref_counts: np.ndarray) -> None:
        """Raise the peak owner count of the tenures `rows`."""
        if len(rows):
            pos = np.searchsorted(self.row, rows)
            np.maximum.at(self.cols["max_ref_count"], pos, ref_counts.astype(np.int32))

    def flush(self, sink: EventSink, before: float | None, end_s: float = 0.0) -> None:
        """Hand `sink` the tenures released before `before`, or all of them (held ones end at `end_s`)
        when `before` is None; keep the rest."""
        t_end = self.cols["t_end_s"]
        if before is None:
            t_end[np.isnan(t_end)] = end_s
            done = np.ones(len(t_end), bool)
        else:
            done = t_end < before  # NaN (held) compares False
        if not done.any():
            return
        # Positions ascend with acquisition numbers, so a stable sort on t_end keeps acquisition order
        # among equal ends (the same as a lexsort on both, for less).
        order = np.flatnonzero(done)
        order = order[np.argsort(t_end[order], kind="stable")]
        sink.write({c: self.cols[c][order] for c in _COLUMNS})
        keep = ~done
        self.row = self.row[keep]
        self.cols = {c: v[keep] for c, v in self.cols.items()}

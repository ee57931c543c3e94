"""The events table: pool tenures (who held which region of the pool, from when to when), paired with numpy.

An allocator logs raw events (simulator/core/allocator.py `EventLog`); the output drains them in batches
(`RawEvents`) and a `TenurePairer` turns each batch into tenures: `OpenRows` tells which tenure each release
or share acts on, `OpenTenures` holds the tenures not yet handed to the sink.

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
import pyarrow as pa

from pagelab.run_format import EVENT_COLUMNS, REFCOUNT_COLUMNS
from pagelab.table_sinks import TableSink, numpy_dtypes
from simulator.core.allocator import ACQUIRE, PER_EVENT_RID, PER_EVENT_TIME, RELEASE, SHARE, RawEvents

# Compact types: pool offsets, sizes, request ids and counts all fit in int32 (`OpenTenures.add` checks).
EVENT_SCHEMA = pa.schema([(c, pa.type_for_alias(t)) for c, t in EVENT_COLUMNS.items()])
EVENT_DTYPES = numpy_dtypes(EVENT_SCHEMA)
# Dictionaries on the block offsets, sizes, reference counts and fills (few distinct values a row
# group), plain + zstd for request ids and times: the smallest file of the encodings tried, and a time's
# dictionary costs more than it saves.
EVENT_ENCODING: dict = {"use_dictionary": ["start", "size", "max_ref_count", "filled", "prefix_key"]}
_INT32_MAX = np.iinfo(np.int32).max
_COLUMNS = tuple(EVENT_COLUMNS)


class OpenTenures:
    """Tenures acquired but not yet written, with their release (NaN: still held) and share data.

    The rows sit in buffers that grow by doubling; a written row only leaves `live` until written rows
    outnumber the live ones, when the live rows move down together. So a batch copies its own rows, not
    every open tenure again (about the pool's size: the 2^14-acquisition batches would copy it each time).
    """

    def __init__(self) -> None:
        self.num = 0  # rows in the buffers, written or not
        self.num_live = 0
        self.row = np.zeros(0, np.int64)  # acquisition numbers, ascending
        self.live = np.zeros(0, bool)
        self.cols = {c: np.zeros(0, EVENT_DTYPES[c]) for c in _COLUMNS}

    def __len__(self) -> int:
        return self.num_live

    def add(self, first_row: int, request_id: np.ndarray, start: np.ndarray, size: np.ndarray,
            t_start: np.ndarray, seq_id: np.ndarray) -> None:
        """Append acquisitions numbered first_row, first_row + 1, ... (still held, one owner: the sequence
        `seq_id`)."""
        n = len(start)
        if n == 0:
            return
        if start.max() + size.max() > _INT32_MAX or request_id.max() > _INT32_MAX:
            raise ValueError("pool offsets and request ids must fit in int32 for the events table")
        lo, hi = self.num, self.num + n
        if hi > len(self.row):
            self._resize(max(hi, 2 * len(self.row)))
        self.row[lo:hi] = np.arange(first_row, first_row + n, dtype=np.int64)
        self.live[lo:hi] = True
        cols = self.cols
        for c, v in (("request_id", request_id), ("start", start), ("size", size), ("t_start_s", t_start),
                     ("seq_id", seq_id)):
            cols[c][lo:hi] = v
        cols["t_end_s"][lo:hi] = np.nan
        cols["max_ref_count"][lo:hi] = 1
        cols["filled"][lo:hi] = 0
        cols["prefix_key"][lo:hi] = 0
        self.num, self.num_live = hi, self.num_live + n

    def _resize(self, capacity: int) -> None:
        """Buffers of `capacity` rows holding the first `num`."""
        def grown(a: np.ndarray) -> np.ndarray:
            out = np.empty(capacity, a.dtype)
            out[:self.num] = a[:self.num]
            return out
        self.row, self.live = grown(self.row), grown(self.live)
        self.cols = {c: grown(v) for c, v in self.cols.items()}

    def _positions(self, rows: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.row[:self.num], rows)

    def release(self, rows: np.ndarray, t_end: np.ndarray, filled: np.ndarray,
                prefix_keys: np.ndarray | None = None) -> None:
        """Mark the tenures of acquisition numbers `rows` released at `t_end` holding `filled` tokens (and
        `prefix_keys`, when given)."""
        if len(rows):
            pos = self._positions(rows)
            self.cols["t_end_s"][pos] = t_end
            self.cols["filled"][pos] = filled
            if prefix_keys is not None:
                self.cols["prefix_key"][pos] = prefix_keys

    def share(self, rows: np.ndarray, ref_counts: np.ndarray) -> None:
        """Raise the peak owner count of the tenures `rows`."""
        if len(rows):
            pos = self._positions(rows)
            np.maximum.at(self.cols["max_ref_count"], pos, ref_counts.astype(np.int32))

    def flush(self, sink: TableSink, before: float | None, end_s: float = 0.0) -> None:
        """Hand `sink` the tenures released before `before`, or all of them (held ones end at `end_s`)
        when `before` is None; keep the rest."""
        n = self.num
        t_end, live = self.cols["t_end_s"][:n], self.live[:n]
        if before is None:
            t_end[np.isnan(t_end) & live] = end_s
            done = live.copy()
        else:
            done = t_end < before  # NaN (held) compares False
            done &= live
        order = np.flatnonzero(done)
        if not len(order):
            return
        # Positions ascend with acquisition numbers, so a stable sort on t_end keeps acquisition order
        # among equal ends (the same as a lexsort on both, for less).
        order = order[np.argsort(t_end[order], kind="stable")]
        sink.write({c: self.cols[c][order] for c in _COLUMNS})
        live[done] = False
        self.num_live -= len(order)
        if n - self.num_live > self.num_live:
            self._compact()

    def _compact(self) -> None:
        """Move the live rows to the front of the buffers, in order."""
        keep = np.flatnonzero(self.live[:self.num])
        k = len(keep)
        for a in (self.row, *self.cols.values()):
            a[:k] = a[keep]
        self.live[:k] = True
        self.num = k


def _per_event(per_run: np.ndarray, counts: np.ndarray, flagged: np.ndarray, listed: list, dtype
               ) -> np.ndarray:
    """Per-event values from one value per run, with the flagged runs' values listed one per event."""
    out = np.repeat(per_run, counts)
    if len(listed):
        out[np.repeat(flagged, counts)] = np.asarray(listed, dtype)
    return out


class TenurePairer:
    """Turns batches of raw events into tenures and hands the finished ones to a sink (in order)."""

    def __init__(self, sink: TableSink) -> None:
        self.sink = sink
        self.open_rows = OpenRows()
        self.tenures = OpenTenures()

    def process(self, raw: RawEvents, first_row: int, before: float | None, end_s: float = 0.0) -> None:
        """Pair the batch (its acquisitions numbered from `first_row`), then hand the sink the tenures
        released before `before` (all of them, held ones ending at `end_s`, when it is None)."""
        if len(raw.e_n):
            counts = np.asarray(raw.e_n, np.int64)
            run_kind = np.asarray(raw.e_kind, np.int8)
            keys = np.asarray(raw.e_keys, np.int64)
            run_unit = np.asarray(raw.e_unit, np.int64)
            kinds = np.repeat(run_kind, counts)
            rows = self.open_rows.resolve(keys, run_unit, counts, kinds, first_row)
            acq_runs = run_kind == ACQUIRE
            if acq_runs.any():
                acq = kinds == ACQUIRE
                a_counts = counts[acq_runs]
                flags = np.asarray(raw.a_flags, np.int8)
                start = keys[acq] * np.repeat(run_unit[acq_runs], a_counts)
                self.tenures.add(first_row,
                                 _per_event(np.asarray(raw.a_rid, np.int64), a_counts,
                                            (flags & PER_EVENT_RID) != 0, raw.a_rids, np.int64),
                                 start, np.repeat(np.asarray(raw.a_size, np.int64), a_counts),
                                 _per_event(np.asarray(raw.a_t, np.float64), a_counts,
                                            (flags & PER_EVENT_TIME) != 0, raw.a_times, np.float64),
                                 _per_event(np.asarray(raw.a_sid, np.int64), a_counts,
                                            (flags & PER_EVENT_RID) != 0, raw.a_sids, np.int64))
            if len(raw.r_t):
                r_counts = counts[run_kind == RELEASE]
                t_end = np.repeat(np.asarray(raw.r_t, np.float64), r_counts)
                keys = None
                if len(raw.r_keys):
                    keys = _per_event(np.zeros(len(r_counts), np.int64), r_counts,
                                      np.asarray(raw.r_flags, np.int8) != 0, raw.r_keys, np.int64)
                self.tenures.release(rows[kinds == RELEASE], t_end, np.asarray(raw.r_filled, np.int64), keys)
            if len(raw.s_ref):
                self.tenures.share(rows[kinds == SHARE], np.asarray(raw.s_ref, np.int64))
        self.tenures.flush(self.sink, before, end_s)


class OpenRows:
    """Which tenure each key (a pool region, named by unit and key) holds open, resolved in batches.

    The allocator logs raw events in order (acquire / release / share, each naming a key) without looking
    anything up; `resolve` then gives every event its tenure number in numpy: an acquisition starts the
    next number, a release or share acts on the latest acquisition of its key before it (in this batch,
    else the one still open from earlier batches, kept here sorted by key).
    """

    def __init__(self) -> None:
        self.keys = np.zeros(0, np.int64)  # composite keys of open tenures (sorted)
        self.rows = np.zeros(0, np.int64)
        self._units: list[int] = []  # unit index -> unit (keys of different units never alias)

    def _composite(self, keys: np.ndarray, run_unit: np.ndarray, counts: np.ndarray) -> np.ndarray:
        for u in np.unique(run_unit).tolist():
            if u not in self._units:
                self._units.append(u)
        if len(self._units) == 1:
            return keys
        index = np.zeros(len(run_unit), np.int64)
        for i, u in enumerate(self._units):
            index[run_unit == u] = i
        return np.repeat(index, counts) << 32 | keys

    def resolve(self, keys: np.ndarray, run_unit: np.ndarray, counts: np.ndarray, kinds: np.ndarray,
                first_row: int) -> np.ndarray:
        """Tenure number of each event (`keys` and `kinds` per event, in the order they happened, the unit
        per run of `counts` events); acquisitions are numbered from `first_row`. Raises KeyError for a
        release or share of a key that holds no open tenure."""
        n = len(keys)
        rows = np.full(n, -1, np.int64)
        if n == 0:
            return rows
        if int(keys.min()) < 0 or int(keys.max()) >= 1 << 32:
            raise ValueError("region keys must be in [0, 2^32)")
        comp = self._composite(keys, run_unit, counts)
        is_acq = kinds == ACQUIRE
        rows[is_acq] = np.arange(first_row, first_row + int(is_acq.sum()), dtype=np.int64)
        top = int(comp.max())
        small = np.uint16 if top < 1 << 16 else np.uint32 if top < 1 << 32 else np.int64
        order = np.argsort(comp.astype(small), kind="stable")  # by key, then by time (radix sort when small)
        sk, sacq = comp[order], is_acq[order]
        new_key = np.empty(n, bool)
        new_key[0] = True
        np.not_equal(sk[1:], sk[:-1], out=new_key[1:])
        srows = rows[order]
        if not (kinds == SHARE).any():
            # A key's events alternate acquire, release: each release ends the acquisition just before it
            # (if that is of the same key; else the tenure open since an earlier batch).
            follows = np.flatnonzero(~sacq[1:] & ~new_key[1:]) + 1
            srows[follows] = srows[follows - 1]
            outside = ~sacq & new_key
        else:
            pos = np.arange(n)
            last = np.maximum.accumulate(np.where(sacq, pos, -1))  # latest acquisition at or before
            group_start = np.maximum.accumulate(np.where(new_key, pos, 0))
            inside = ~sacq & (last >= group_start)
            srows[inside] = srows[last[inside]]
            outside = ~sacq & (last < group_start)
        if outside.any():
            want = sk[outside]
            at = np.searchsorted(self.keys, want)
            found = at < len(self.keys)
            found[found] = self.keys[at[found]] == want[found]
            if not found.all():
                raise KeyError(f"region key {int(want[~found][0]) & 0xFFFFFFFF} holds no open tenure")
            srows[outside] = self.rows[at]
        rows[order] = srows
        # The keys' state after the batch: the last acquisition or release of each decides (shares keep it).
        changes = np.flatnonzero(kinds[order] != SHARE)
        ck = sk[changes]
        last_of_key = np.empty(len(ck), bool)
        if len(ck):
            last_of_key[-1] = True
            np.not_equal(ck[1:], ck[:-1], out=last_of_key[:-1])
        final = changes[last_of_key]
        touched = sk[final]
        still_open = sacq[final]
        keep = ~np.isin(self.keys, touched, assume_unique=True)
        keys_new = np.concatenate([self.keys[keep], touched[still_open]])
        rows_new = np.concatenate([self.rows[keep], srows[final][still_open]])
        by_key = np.argsort(keys_new, kind="stable")
        self.keys, self.rows = keys_new[by_key], rows_new[by_key]
        return rows


REFCOUNT_SCHEMA = pa.schema([(c, pa.type_for_alias(t)) for c, t in REFCOUNT_COLUMNS.items()])
REFCOUNT_DTYPES = numpy_dtypes(REFCOUNT_SCHEMA)


class RefCountRows:
    """The reference-count changes of held blocks (EventLog.take_ref_changes), handed to `sink` every
    `batch_rows` rows; `end` closes the table."""

    def __init__(self, sink: TableSink, batch_rows: int) -> None:
        self.sink = sink
        self.batch_rows = batch_rows
        self._cols: tuple[list, list, list] = ([], [], [])

    def extend(self, starts: list[int], times: list[float], ref_counts: list[int]) -> None:
        """Add changes: the block at slot starts[i] has ref_counts[i] owners from times[i] on."""
        for held, new in zip(self._cols, (starts, times, ref_counts), strict=True):
            held.extend(new)
        if len(self._cols[0]) >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        """Hand the rows collected so far to the sink."""
        if self._cols[0]:
            pairs = zip(REFCOUNT_COLUMNS, self._cols, strict=True)
            self.sink.write({c: np.asarray(v, REFCOUNT_DTYPES[c]) for c, v in pairs})
            self._cols = ([], [], [])

    def end(self) -> None:
        """Write what is left and close the table."""
        self.flush()
        self.sink.close()

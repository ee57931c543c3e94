"""Rasterize pool tenures (events.parquet) into an owner matrix: pool position bins x time bins.

A cell is free (-1) when more than half of its area (slots x seconds) is uncovered; otherwise it goes to
the request covering the largest share of it. (Letting "free" compete with each owner instead would
whiten busy cells whenever many short tenures pass through one coarse cell, under-drawing usage.)

Everything is vectorized. A tenure covering whole rows owns its completely covered cells outright, so
those are painted with start/end markers and a forward fill along time; only its partly covered first
and last time bins, and every cell of a tenure covering part of a row, are "contested": their areas
are summed per (cell, owner) with one sort. Tenures are processed in chunks to bound memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

_UNSET = -2
CHUNK_TENURES = 1 << 18


@dataclass(frozen=True)
class OwnerRaster:
    """Largest owner per cell (-1 when mostly free) and its largest ref count in the cell (0 free)."""

    owner: np.ndarray       # (num_rows, num_bins) int64 request_id
    ref_count: np.ndarray   # (num_rows, num_bins) int64
    pos_edges: np.ndarray   # (num_rows + 1,) slot positions
    time_edges: np.ndarray  # (num_bins + 1,) seconds
    unfilled: np.ndarray | None = None  # (num_rows, num_bins) bool: the holder never fills these slots


@dataclass(frozen=True)
class _Tenures:
    """Clipped tenure columns as arrays."""

    start: np.ndarray
    end: np.ndarray
    ts: np.ndarray
    te: np.ndarray
    rid: np.ndarray
    ref: np.ndarray


def decode_split(raster: OwnerRaster) -> OwnerRaster:
    """Turn a raster of split keys (2 * request_id + never-filled flag) into ids plus the `unfilled` mask."""
    held = raster.owner >= 0
    owner = np.where(held, raster.owner // 2, -1)
    return OwnerRaster(owner, raster.ref_count, raster.pos_edges, raster.time_edges,
                       held & (raster.owner % 2 == 1))


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For items with `counts` repeats: the item index and the 0-based repeat number of every copy."""
    item = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts
    return item, np.arange(len(item)) - first[item]


def _tenures(events: pd.DataFrame, capacity: int, t0: float, t1: float, split: bool) -> _Tenures:
    """Tenures clipped to the pool and the time span, empty ones dropped, adjacent blocks merged.

    With `split`, owners become 2 * request_id and each never-filled tail [start + filled, end)
    becomes its own region owned by 2 * request_id + 1 (decode with `decode_split`).
    """
    start = events["start"].to_numpy(np.int64)
    end = start + events["size"].to_numpy(np.int64)
    ts = np.clip(events["t_start_s"].to_numpy(float), t0, t1)
    te = np.clip(events["t_end_s"].to_numpy(float), t0, t1)
    rid = events["request_id"].to_numpy(np.int64)
    ref = events["max_ref_count"].to_numpy(np.int64)
    filled = np.clip(events["filled"].to_numpy(np.int64), 0, end - start)
    start, end, ts, te, rid, ref, filled = _merge_adjacent(start, end, ts, te, rid, ref, filled)
    if split:
        cut = start + filled
        tail = cut < end
        start = np.concatenate([start, cut[tail]])
        end = np.concatenate([cut, end[tail]])
        ts, te = np.concatenate([ts, ts[tail]]), np.concatenate([te, te[tail]])
        rid = np.concatenate([2 * rid, 2 * rid[tail] + 1])
        ref = np.concatenate([ref, ref[tail]])
    end = np.minimum(end, capacity)
    keep = (end > start) & (start >= 0) & (te > ts)
    return _Tenures(start[keep], end[keep], ts[keep], te[keep], rid[keep], ref[keep])


def _merge_adjacent(start, end, ts, te, rid, ref, filled) -> tuple[np.ndarray, ...]:
    """Merge runs of consecutive rows that are one request's touching blocks with the same lifetime.

    A paged request's prompt blocks are typically written one after another with equal times; drawn
    as one region they give the same picture at a fraction of the cost. Blocks below the last one
    must be full, so the merged region's never-filled tail stays at its end.
    """
    if len(start) < 2:
        return start, end, ts, te, rid, ref, filled
    same = (rid[1:] == rid[:-1]) & (ts[1:] == ts[:-1]) & (te[1:] == te[:-1]) & (ref[1:] == ref[:-1])
    full = filled == end - start
    up = same & (start[1:] == end[:-1]) & full[:-1]      # ascending slots, previous block full
    down = same & (end[1:] == start[:-1]) & full[1:]     # descending slots, this block full
    join = up | down
    # A run must keep one direction; where it turns, start a new run.
    direction = np.where(up, 1, np.where(down, -1, 0))
    turn = join[1:] & join[:-1] & (direction[1:] != direction[:-1])
    join[1:] &= ~turn
    if not join.any():
        return start, end, ts, te, rid, ref, filled
    first = np.flatnonzero(np.concatenate([[True], ~join]))
    return (np.minimum.reduceat(start, first), np.maximum.reduceat(end, first), ts[first], te[first],
            rid[first], ref[first], np.add.reduceat(filled, first))


def rasterize_owners(events: pd.DataFrame, capacity: int, time_edges: np.ndarray, row_slots: int,
                     split_unfilled: bool = False) -> OwnerRaster:
    """Owner matrix of the pool: rows of `row_slots` slots (the last may be shorter) x time bins.

    With `split_unfilled`, a tenure's filled part and its never-filled tail compete as separate
    regions and the result carries the `unfilled` mask (internal fragmentation).
    """
    edges = np.asarray(time_edges, dtype=float)
    num_bins = len(edges) - 1
    num_rows = -(-int(capacity) // int(row_slots))
    pos_edges = np.minimum(np.arange(num_rows + 1, dtype=np.int64) * row_slots, capacity)
    owner = np.full((num_rows, num_bins), -1, dtype=np.int64)
    ref = np.zeros((num_rows, num_bins), dtype=np.int64)
    ten = _tenures(events, capacity, edges[0], edges[-1], split_unfilled)
    if len(ten.start) == 0 or num_bins == 0:
        unfilled = np.zeros(owner.shape, dtype=bool) if split_unfilled else None
        return OwnerRaster(owner, ref, pos_edges, edges, unfilled)
    starts = np.full((num_rows, num_bins + 1), _UNSET, dtype=np.int64)
    ends = np.zeros((num_rows, num_bins + 1), dtype=bool)
    contested = [_chunk(ten, lo, lo + CHUNK_TENURES, row_slots, pos_edges, edges, starts, ends)
                 for lo in range(0, len(ten.start), CHUNK_TENURES)]
    # Forward-fill along time: each cell takes the latest marker at or before it (start beats end).
    marks = np.where(starts != _UNSET, starts, np.where(ends, -1, _UNSET))
    last = np.where(marks != _UNSET, np.arange(num_bins + 1), 0)
    np.maximum.accumulate(last, axis=1, out=last)
    painted = np.take_along_axis(marks, last, axis=1)[:, :num_bins]
    held = painted >= 0
    owner[held] = ten.rid[painted[held]]
    ref[held] = ten.ref[painted[held]]
    cell, who, area, refc = (np.concatenate(parts) for parts in zip(*contested, strict=True))
    if len(cell):
        _resolve(owner, ref, pos_edges, edges, cell, who, area, refc)
    raster = OwnerRaster(owner, ref, pos_edges, edges)
    return decode_split(raster) if split_unfilled else raster


def _chunk(ten: _Tenures, lo: int, hi: int, row_slots: int, pos_edges: np.ndarray, edges: np.ndarray,
           starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, ...]:
    """Paint the outright-owned cells of tenures lo..hi; return their contested (cell, owner, area, ref)."""
    num_bins = len(edges) - 1
    start, end, ts, te = ten.start[lo:hi], ten.end[lo:hi], ten.ts[lo:hi], ten.te[lo:hi]
    r0, r1 = start // row_slots, (end - 1) // row_slots
    p, k = _expand(r1 - r0 + 1)          # one pair per (tenure, row it touches)
    row = r0[p] + k
    ov_pos = np.minimum(end[p], pos_edges[row + 1]) - np.maximum(start[p], pos_edges[row])
    full = ov_pos == pos_edges[row + 1] - pos_edges[row]
    c0 = np.clip(np.searchsorted(edges, ts, side="right") - 1, 0, num_bins - 1)[p]
    c1 = np.clip(np.searchsorted(edges, te, side="left") - 1, 0, num_bins - 1)[p]
    f0 = np.where(ts[p] <= edges[c0], c0, c0 + 1)        # first time bin covered completely
    f1 = np.where(te[p] >= edges[c1 + 1], c1, c1 - 1)    # last time bin covered completely
    inner = full & (f0 <= f1)
    ends[row[inner], f1[inner] + 1] = True
    starts[row[inner], f0[inner]] = p[inner] + lo
    first_part = full & (f0 > c0)
    last_part = full & (f1 < c1) & ~(first_part & (c1 == c0))
    q, j = _expand(np.where(full, 0, c1 - c0 + 1))
    pair = np.concatenate([np.flatnonzero(first_part), np.flatnonzero(last_part), q])
    col = np.concatenate([c0[first_part], c1[last_part], c0[q] + j])
    tenure = p[pair]
    ov_t = np.minimum(te[tenure], edges[col + 1]) - np.maximum(ts[tenure], edges[col])
    area = (ov_pos[pair] * np.maximum(ov_t, 0.0)).astype(np.float32)  # only compared, never summed long
    return row[pair] * num_bins + col, ten.rid[lo:hi][tenure], area, ten.ref[lo:hi][tenure].astype(np.int32)


def _resolve(owner, ref, pos_edges, edges, cell, who, area, refc) -> None:
    """Give each contested cell to the owner with the largest summed area, or free if mostly uncovered."""
    num_bins = owner.shape[1]
    rmin = int(who.min())
    span = int(who.max()) - rmin + 1
    key = cell * span + (who - rmin)
    order = np.argsort(key)
    key = key[order]
    change = np.empty(len(key), dtype=bool)
    change[0] = True
    np.not_equal(key[1:], key[:-1], out=change[1:])
    group = np.flatnonzero(change)
    keys = key[group]
    gsum = np.add.reduceat(area[order], group, dtype=np.float64)
    gref = np.maximum.reduceat(refc[order], group)
    gcell = keys // span
    first = np.flatnonzero(np.concatenate([[True], gcell[1:] != gcell[:-1]]))
    best = np.maximum.reduceat(gsum, first)
    covered = np.add.reduceat(gsum, first)
    group_cell = np.repeat(np.arange(len(first)), np.diff(np.append(first, len(keys))))
    candidates = np.where(gsum >= best[group_cell], np.arange(len(keys)), len(keys))
    win = np.minimum.reduceat(candidates, first)   # ties: the smallest request id wins
    cells = gcell[first]
    rows, cols = cells // num_bins, cells % num_bins
    cell_area = (pos_edges[rows + 1] - pos_edges[rows]) * (edges[cols + 1] - edges[cols])
    mostly_free = cell_area - covered > cell_area * (0.5 + 1e-9)
    owner.reshape(-1)[cells] = np.where(mostly_free, -1, keys[win] % span + rmin)
    ref.reshape(-1)[cells] = np.where(mostly_free, 0, gref[win])

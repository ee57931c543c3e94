"""What a run records as it goes: pool-region tenures (for block maps) and per-step memory rows.

Both are append-only logs built for speed: the simulator records millions of block tenures, so the
recorder keeps flat lists of raw acquire / release / share events (whole runs of blocks at a time) and
pairs them into tenures with numpy once, at the end.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence as SeqLike
from itertools import chain
from operator import itemgetter

import numpy as np
import pandas as pd

from simulator.core.allocator import MemoryBreakdown, RegionRecorder

MEMORY_COLUMNS = ("step", "num_steps", "t_s", "dt_s", "token_states", "reservation",
                  "internal_fragmentation", "external_fragmentation", "free", "cached_free",
                  "token_occupancy", "block_occupancy", "num_running", "num_waiting", "num_swapped",
                  "num_batched_tokens", "blocks_used")
_INT_COLUMNS = ("step", "num_steps", "num_running", "num_waiting", "num_swapped", "num_batched_tokens",
                "blocks_used")
EVENT_COLUMNS = (("request_id", "int64"), ("start", "int64"), ("size", "int64"), ("t_start_s", "float64"),
                 ("t_end_s", "float64"), ("max_ref_count", "int64"), ("filled", "int64"))


def _expand(values: list, counts: list[int], has_lists: bool, dtype) -> np.ndarray:
    """Per-event array from per-run entries that are one value for the run or a tuple of one per event."""
    if not has_lists:
        return np.repeat(np.asarray(values, dtype=dtype), counts)
    is_list = [isinstance(v, tuple) for v in values]
    out = np.repeat(np.asarray([0 if il else v for v, il in zip(values, is_list, strict=True)], dtype=dtype),
                    counts)
    lists = [v for v, il in zip(values, is_list, strict=True) if il]
    mask = np.repeat(np.asarray(is_list), counts)
    out[mask] = np.fromiter(chain.from_iterable(lists), dtype, int(mask.sum()))
    return out


class EventRecorder(RegionRecorder):
    """Collects pool-region tenures: who held which region of the pool, from when to when.

    `now` is the simulated clock (the simulator sets it). Events come in runs: the bulk calls
    (`acquire_blocks`, `release_blocks`, `share_block`) log paged blocks, named by block id with unit =
    block size, a whole run per call; the per-region calls of the RegionRecorder interface log one region,
    named by its first slot (unit 1). Bulk calls pair with bulk calls, per-region calls with per-region
    calls. Each tenure is a row, numbered in acquisition order; the row of each open tenure is kept per
    unit in a list indexed by key, so a release finds its row in C (`itemgetter`) and `to_frame` only
    scatters the release times into place.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.num_acquired = 0  # tenures started so far (the next row)
        self._open: dict[int, list[int]] = {}  # unit -> row of the open tenure of each key
        # Runs are stored as tuples of numbers, which the garbage collector stops tracking: millions of
        # retained events then cost nothing in its full collections (lists would be traversed each time).
        # Acquisition runs: keys, unit, region size, request id(s), time(s).
        self._a_keys: list[tuple[int, ...]] = []
        self._a_unit: list[int] = []
        self._a_size: list[int] = []
        self._a_rid: list = []
        self._a_t: list = []
        self._a_lists = [False, False]  # whether any run carries per-event request ids / times
        # Release runs: rows ended, time, filled slots (one per row).
        self._r_rows: list[tuple[int, ...]] = []
        self._r_t: list[float] = []
        self._r_filled: list[tuple[int, ...]] = []
        # Shares, one by one (rare): row, new ref count.
        self._s_row: list[int] = []
        self._s_ref: list[int] = []

    def _rows(self, unit: int, max_key: int) -> list[int]:
        rows = self._open.get(unit)
        if rows is None:
            rows = self._open[unit] = []
        if len(rows) <= max_key:
            rows.extend([-1] * (max(max_key + 1, 2 * len(rows)) - len(rows)))
        return rows

    # ----------------------------------------------------------------- per-region API
    def acquire(self, start: int, size: int, request_id: int) -> None:
        """A region was taken."""
        self._rows(1, start)[start] = self.num_acquired
        self._a_keys.append((start,))
        self._a_unit.append(1)
        self._a_size.append(size)
        self._a_rid.append(request_id)
        self._a_t.append(self.now)
        self.num_acquired += 1

    def share(self, start: int, ref_count: int) -> None:
        """A region gained another owner."""
        self._s_row.append(self._open[1][start])
        self._s_ref.append(ref_count)

    def release(self, start: int, filled: int) -> None:
        """A region was given back."""
        self._r_rows.append((self._open[1][start],))
        self._r_t.append(self.now)
        self._r_filled.append((filled,))

    # ----------------------------------------------------------------- bulk block API
    def acquire_blocks(self, block_ids: SeqLike[int], block_size: int, request_id: int | SeqLike[int],
                       times: SeqLike[float] | None = None) -> None:
        """Blocks were taken, by one request or one request per block, now or at `times` (one per block)."""
        if not block_ids:
            return
        rows = self._rows(block_size, max(block_ids))
        row = self.num_acquired
        for bid in block_ids:
            rows[bid] = row
            row += 1
        self.num_acquired = row
        self._a_keys.append(tuple(block_ids))
        self._a_unit.append(block_size)
        self._a_size.append(block_size)
        if isinstance(request_id, int):
            self._a_rid.append(request_id)
        else:
            self._a_rid.append(tuple(request_id))
            self._a_lists[0] = True
        if times is None:
            self._a_t.append(self.now)
        else:
            self._a_t.append(tuple(times))
            self._a_lists[1] = True

    def share_block(self, block_id: int, block_size: int, ref_count: int) -> None:
        """A block gained another owner."""
        self._s_row.append(self._open[block_size][block_id])
        self._s_ref.append(ref_count)

    def release_blocks(self, block_ids: SeqLike[int], block_size: int, filled: SeqLike[int]) -> None:
        """Blocks were given back now, holding `filled` tokens each."""
        if not block_ids:
            return
        rows = self._open[block_size]
        self._r_rows.append(itemgetter(*block_ids)(rows) if len(block_ids) > 1 else (rows[block_ids[0]],))
        self._r_t.append(self.now)
        self._r_filled.append(tuple(filled))

    # ----------------------------------------------------------------- result
    def to_frame(self, end_s: float) -> pd.DataFrame:
        """The tenures as a table, one row per acquisition in order (regions still held end at `end_s`)."""
        num = self.num_acquired
        if num == 0:
            return pd.DataFrame({c: pd.Series(dtype=t) for c, t in EVENT_COLUMNS})
        counts = [len(k) for k in self._a_keys]
        start = np.fromiter(chain.from_iterable(self._a_keys), np.int64, num)
        start *= np.repeat(np.asarray(self._a_unit, dtype=np.int64), counts)
        t_end = np.full(num, end_s)
        filled = np.zeros(num, np.int64)
        if self._r_rows:
            rcounts = [len(r) for r in self._r_rows]
            num_r = sum(rcounts)
            rows = np.fromiter(chain.from_iterable(self._r_rows), np.int64, num_r)
            t_end[rows] = np.repeat(np.asarray(self._r_t, dtype=np.float64), rcounts)
            filled[rows] = np.fromiter(chain.from_iterable(self._r_filled), np.int64, num_r)
        max_ref = np.ones(num, np.int64)
        if self._s_row:
            np.maximum.at(max_ref, np.asarray(self._s_row, dtype=np.int64),
                          np.asarray(self._s_ref, dtype=np.int64))
        return pd.DataFrame({
            "request_id": _expand(self._a_rid, counts, self._a_lists[0], np.int64),
            "start": start,
            "size": np.repeat(np.asarray(self._a_size, dtype=np.int64), counts),
            "t_start_s": _expand(self._a_t, counts, self._a_lists[1], np.float64),
            "t_end_s": t_end,
            "max_ref_count": max_ref,
            "filled": filled,
        }, copy=False)  # fresh arrays: pandas' default copy of 1.6M-row columns costs more than all the rest


class MemoryLog:
    """Per-step (or per-span) memory rows, kept in one flat float array (8 bytes a value)."""

    def __init__(self) -> None:
        self._values = array("d")

    def __len__(self) -> int:
        return len(self._values) // len(MEMORY_COLUMNS)

    def add(self, step: int, num_steps: int, t_s: float, dt_s: float, fractions: dict[str, float],
            cached_free: float, block_occupancy: float, counts: tuple[int, int, int],
            num_batched_tokens: int, blocks_used: int) -> None:
        """Append one row; `fractions` holds the five taxonomy states."""
        f = fractions
        self._values.extend((step, num_steps, t_s, dt_s, f["token_states"], f["reservation"],
                             f["internal_fragmentation"], f["external_fragmentation"], f["free"], cached_free,
                             f["token_states"], block_occupancy, counts[0], counts[1], counts[2],
                             num_batched_tokens, blocks_used))

    def add_row(self, step: int, num_steps: int, t_s: float, dt_s: float, token_states: float,
                reservation: float, internal: float, external: float, free: float, cached_free: float,
                block_occupancy: float, counts: tuple[int, int, int], num_batched_tokens: int,
                blocks_used: int) -> None:
        """Append one row from fractions of capacity already computed (a span's time-weighted means)."""
        self._values.extend((step, num_steps, t_s, dt_s, token_states, reservation, internal, external, free,
                             cached_free, token_states, block_occupancy, counts[0], counts[1], counts[2],
                             num_batched_tokens, blocks_used))

    def add_slots(self, step: int, num_steps: int, t_s: float, dt_s: float, slots: tuple,
                  counts: tuple[int, int, int], num_batched_tokens: int, block_size: int) -> None:
        """Append one row from a breakdown given as (capacity, token_states, reservation, internal, external,
        free, cached_free, allocated) slots (the allocators' `breakdown_slots`)."""
        cap, tokens, resv, internal, external, free, cached, allocated = slots
        self._values.extend((step, num_steps, t_s, dt_s, tokens / cap, resv / cap, internal / cap,
                             external / cap, free / cap, cached / cap, tokens / cap, allocated / cap,
                             counts[0], counts[1], counts[2], num_batched_tokens, allocated // block_size))

    def add_breakdown(self, step: int, t_s: float, dt_s: float, b: MemoryBreakdown,
                      counts: tuple[int, int, int], num_batched_tokens: int, block_size: int,
                      num_steps: int = 1) -> None:
        """Append a row from an instantaneous breakdown."""
        slots = (b.capacity, b.token_states, b.reservation, b.internal_fragmentation,
                 b.external_fragmentation, b.free, b.cached_free, b.allocated)
        self.add_slots(step, num_steps, t_s, dt_s, slots, counts, num_batched_tokens, block_size)

    def to_frame(self) -> pd.DataFrame:
        """The rows as a table with the documented dtypes."""
        width = len(MEMORY_COLUMNS)
        values = np.frombuffer(self._values, dtype=np.float64).reshape(-1, width) if self._values else \
            np.zeros((0, width))
        ints = set(_INT_COLUMNS)
        return pd.DataFrame({name: values[:, j].astype(np.int64 if name in ints else np.float64)
                             for j, name in enumerate(MEMORY_COLUMNS)}, copy=False)

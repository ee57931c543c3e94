"""The memory table: one row per step (or span of steps, or idle gap) with the pool's memory taxonomy.

A row is appended every loop iteration, so rows are packed bytes (`_ROW`, 104 bytes), not Python objects.
`MemoryRows` packs them and hands them to its writer in batches; the writer (`MemoryTable` for a file, or
`MemoryFrame` in memory) turns them into columns. A file's writer keeps only the time-weighted sums the
summary needs, so a long run's memory does not grow with its steps.
"""
from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.recfunctions import structured_to_unstructured

from pagelab.column_stats import weighted_sum
from pagelab.run_format import HYBRID_MEMORY_COLUMNS, HYBRID_STATES, MEMORY_STATES
from pagelab.run_format import MEMORY_COLUMNS as MEMORY_TYPES

if TYPE_CHECKING:  # the process that writes a long run's tables imports neither pandas nor the core's users
    import pandas as pd

    from pagelab.table_sinks import TableSink
    from simulator.core.allocator import HybridBreakdown, MemoryBreakdown

MEMORY_COLUMNS = tuple(MEMORY_TYPES)
MEMORY_DTYPES = {c: np.dtype(t) for c, t in MEMORY_TYPES.items()}
# A packed row: the step, the fractions, then the counts as int32 (a step's counts never reach 2^31;
# `struct` raises if one did). `token_occupancy` equals `token_states` and is not packed twice.
_PACKED_FLOATS = ("t_s", "dt_s", *MEMORY_STATES, "cached_free", "block_occupancy")
_PACKED_COUNTS = ("num_steps", "num_running", "num_waiting", "num_swapped", "num_batched_tokens",
                  "blocks_used")
_ROW = struct.Struct(f"=q{len(_PACKED_FLOATS)}d{len(_PACKED_COUNTS)}i")
_pack_row = _ROW.pack
_ROW_DTYPE = np.dtype([("step", "=i8"), *((c, "=f8") for c in _PACKED_FLOATS),
                       *((c, "=i4") for c in _PACKED_COUNTS)])
_PACKED_DTYPES = {c: MEMORY_DTYPES[c] for c in _ROW_DTYPE.names}
_DT = _PACKED_FLOATS.index("dt_s")
ROW_BYTES = _ROW.size

# A run with KV cache groups packs HYBRID_STATES after the other floats (pagelab/run_format.py).
HYBRID_COLUMNS = tuple(HYBRID_MEMORY_COLUMNS)
HYBRID_DTYPES = {c: np.dtype(t) for c, t in HYBRID_MEMORY_COLUMNS.items()}
_HYBRID_FLOATS = (*_PACKED_FLOATS, *HYBRID_STATES)
_HYBRID_ROW = struct.Struct(f"=q{len(_HYBRID_FLOATS)}d{len(_PACKED_COUNTS)}i")
_HYBRID_ROW_DTYPE = np.dtype([("step", "=i8"), *((c, "=f8") for c in _HYBRID_FLOATS),
                              *((c, "=i4") for c in _PACKED_COUNTS)])
_HYBRID_PACKED_DTYPES = {c: HYBRID_DTYPES[c] for c in _HYBRID_ROW_DTYPE.names}
# Per layout (False: one group, True: KV cache groups): packed row, its columns, the float columns.
_LAYOUTS = {False: (_ROW_DTYPE, _PACKED_DTYPES, MEMORY_COLUMNS, _PACKED_FLOATS),
            True: (_HYBRID_ROW_DTYPE, _HYBRID_PACKED_DTYPES, HYBRID_COLUMNS, _HYBRID_FLOATS)}


def columns_of_batches(batches: list, row_dtype: np.dtype, dtypes: dict[str, np.dtype],
                       each: Callable[[np.ndarray], None] | None = None) -> dict[str, np.ndarray]:
    """The columns `dtypes` of the packed rows (`row_dtype` each) in `batches`, which it empties: a batch
    goes as soon as its rows are copied, so the packed rows and the columns are never resident together.
    `each`, if given, sees every batch's rows first."""
    num = sum(memoryview(b).nbytes for b in batches) // row_dtype.itemsize
    columns = {c: np.empty(num, t) for c, t in dtypes.items()}
    start = 0
    while batches:
        rows = np.frombuffer(batches[0], row_dtype)
        end = start + len(rows)
        if each is not None:
            each(rows)
        for c in dtypes:
            columns[c][start:end] = rows[c]
        del rows
        batches.pop(0)  # the last reference: its rows go before the next batch's are copied
        start = end
    return columns


def memory_columns(batches: list, each: Callable[[np.ndarray], None] | None = None,
                   hybrid: bool = False) -> dict[str, np.ndarray]:
    """The memory table's columns, in MEMORY_COLUMNS order (HYBRID_COLUMNS with `hybrid`), of packed
    rows (it empties `batches`)."""
    row_dtype, dtypes, columns, _ = _LAYOUTS[hybrid]
    packed = columns_of_batches(batches, row_dtype, dtypes, each)
    packed["token_occupancy"] = packed["token_states"]
    return {c: packed[c] for c in columns}


class MemoryTable:
    """A file's writing end: each row group's columns go to `sink`; `close` returns the sums of value *
    dt_s per packed float column and of dt_s (what `weighted_means` reads). `hybrid`: the rows carry
    HYBRID_STATES (a run with KV cache groups)."""

    def __init__(self, sink: TableSink, hybrid: bool = False) -> None:
        self.sink = sink
        self.hybrid = hybrid
        self.row_bytes = _LAYOUTS[hybrid][0].itemsize
        self._floats = list(_LAYOUTS[hybrid][3])
        self._batches: list = []
        self._wsum = np.zeros(len(self._floats))
        self._dt = 0.0

    def add_batch(self, batch: bytes | bytearray) -> None:
        """Keep one batch of packed rows of the current row group."""
        self._batches.append(batch)

    def end_group(self) -> None:
        """Write the row group (if it has rows)."""
        if self._batches:
            self.sink.write(memory_columns(self._batches, self._add_sums, self.hybrid))

    def _add_sums(self, rows: np.ndarray) -> None:
        floats = structured_to_unstructured(rows[self._floats], copy=False)  # a view: no copy
        self._wsum += weighted_sum(floats[:, _DT], floats)
        self._dt += float(floats[:, _DT].sum())

    def close(self) -> tuple[np.ndarray, float]:
        """Write the last row group, close the sink and return the sums."""
        self.end_group()
        self.sink.close()
        return self._wsum, self._dt


class MemoryFrame:
    """The in-memory writing end: keeps every batch; `frame` is the whole table (with HYBRID_STATES when
    `hybrid`)."""

    def __init__(self, hybrid: bool = False) -> None:
        self.hybrid = hybrid
        self.row_bytes = _LAYOUTS[hybrid][0].itemsize
        self._batches: list = []

    def add_batch(self, batch: bytes | bytearray) -> None:
        """Keep one batch of packed rows."""
        self._batches.append(batch)

    def end_group(self) -> None:
        """Nothing to write: the rows stay here."""

    def close(self) -> None:
        """Nothing to close (the summary reads the frame)."""

    def frame(self) -> pd.DataFrame:
        """The rows as a table with the documented dtypes."""
        columns = memory_columns(self._batches, hybrid=self.hybrid)
        columns["token_occupancy"] = columns["token_occupancy"].copy()  # a column of its own in a frame
        import pandas as pd

        return pd.DataFrame(columns, copy=False)


def _shares(hybrid: bool) -> tuple[str, ...]:
    """The summary's memory shares: the states, cached_free, and HYBRID_STATES where the rows carry them."""
    return (*MEMORY_STATES, "cached_free", *(HYBRID_STATES if hybrid else ()))


def weighted_means(sums: tuple[np.ndarray, float]) -> tuple[dict, float, float]:
    """The summary's time-weighted means (states, cached_free and HYBRID_STATES where present; token and
    block occupancy) from a file writer's sums."""
    wsum, dt = sums
    floats = _HYBRID_FLOATS if len(wsum) == len(_HYBRID_FLOATS) else _PACKED_FLOATS
    shares = _shares(floats is _HYBRID_FLOATS)
    if dt <= 0:
        nan = float("nan")
        return dict.fromkeys(shares, nan), nan, nan
    m = {c: float(v / dt) for c, v in zip(floats, wsum, strict=True)}
    return {s: m[s] for s in shares}, m["token_states"], m["block_occupancy"]


def frame_means(memory: pd.DataFrame) -> tuple[dict, float, float]:
    """`weighted_means` of a memory table in memory."""
    w = memory["dt_s"].to_numpy()
    total = w.sum()
    shares = _shares(HYBRID_STATES[0] in memory.columns)
    if total <= 0:
        nan = float("nan")
        return dict.fromkeys(shares, nan), nan, nan
    mean = {s: float(weighted_sum(w, memory[s].to_numpy()) / total) for s in shares}
    return (mean, float(weighted_sum(w, memory["token_occupancy"].to_numpy()) / total),
            float(weighted_sum(w, memory["block_occupancy"].to_numpy()) / total))


class MemoryRows:
    """The run's memory rows, packed as they come and handed to `writer` in batches of `batch_rows`.

    A row group ends every `group_rows` rows, or sooner at `flush` (a simulation flushes halfway through
    each row group of its request table, so the two tables' buffers keep one phase).
    """

    row_bytes = ROW_BYTES

    def __init__(self, writer, batch_rows: int, group_rows: int) -> None:
        self.writer = writer
        self._packed = bytearray()  # the rows not yet handed on
        self._batch_bytes = batch_rows * self.row_bytes
        self._group_bytes = group_rows * self.row_bytes
        self._limit = min(self._batch_bytes, self._group_bytes)  # packed bytes that end the current batch
        self._held = 0  # bytes of the current row group handed on as batches
        self._num_flushed = 0  # rows of the row groups ended so far

    def __len__(self) -> int:
        return self._num_flushed + (self._held + len(self._packed)) // self.row_bytes

    def add_row(self, step: int, num_steps: int, t_s: float, dt_s: float, token_states: float,
                reservation: float, internal: float, external: float, free: float, cached_free: float,
                block_occupancy: float, counts: tuple[int, int, int], num_batched_tokens: int,
                blocks_used: int) -> None:
        """Append one row from fractions of capacity already computed (a span's time-weighted means)."""
        packed = self._packed
        packed += _pack_row(step, t_s, dt_s, token_states, reservation, internal, external, free, cached_free,
                            block_occupancy, num_steps, counts[0], counts[1], counts[2], num_batched_tokens,
                            blocks_used)
        if len(packed) >= self._limit:  # inline: one call less per row
            self._next_batch()

    def add_breakdown(self, step: int, num_steps: int, t_s: float, dt_s: float, b: MemoryBreakdown,
                      counts: tuple[int, int, int], num_batched_tokens: int, block_size: int) -> None:
        """Append one row from an instantaneous breakdown (in slots)."""
        cap, tokens, resv, internal, external, free, cached, allocated = b
        packed = self._packed
        packed += _pack_row(step, t_s, dt_s, tokens / cap, resv / cap, internal / cap, external / cap,
                            free / cap, cached / cap, allocated / cap, num_steps, counts[0], counts[1],
                            counts[2], num_batched_tokens, allocated // block_size)
        if len(packed) >= self._limit:  # inline: one call less per row
            self._next_batch()

    def _next_batch(self) -> None:
        """The rows so far go on as a batch; the row group ends once it holds `group_rows` rows (its last
        batch may be shorter; `flush` ends a row group sooner)."""
        batch, self._packed = self._packed, bytearray()
        self._held += len(batch)
        self.writer.add_batch(batch)
        if self._held >= self._group_bytes:
            self.flush()  # which starts the next row group's limit
        else:
            self._limit = min(self._batch_bytes, self._group_bytes - self._held)

    def flush(self) -> None:
        """Hand the rows kept so far on and end the row group."""
        if self._packed:
            self._held += len(self._packed)
            self.writer.add_batch(self._packed)
            self._packed = bytearray()
        self._limit = min(self._batch_bytes, self._group_bytes)  # a row group starts here, whoever flushed
        if self._held:
            self.writer.end_group()
            self._num_flushed += self._held // self.row_bytes
            self._held = 0

    def end(self):
        """Hand on the last rows and close the writer; return what its `close` returns."""
        self.flush()
        return self.writer.close()


class HybridMemoryRows(MemoryRows):
    """The memory rows of a run with KV cache groups: each row also carries HYBRID_STATES (its writer
    was made with `hybrid=True`)."""

    row_bytes = _HYBRID_ROW.size

    def add_row(self, step: int, num_steps: int, t_s: float, dt_s: float, token_states: float,
                reservation: float, internal: float, external: float, free: float, cached_free: float,
                block_occupancy: float, counts: tuple[int, int, int], num_batched_tokens: int,
                blocks_used: int, *, padding: float, window_cached: float) -> None:
        """Append one row from fractions of capacity already computed (a span's time-weighted means);
        `padding` and `window_cached` are required: a span must say what it wasted."""
        self._packed += _HYBRID_ROW.pack(
            step, t_s, dt_s, token_states, reservation, internal, external, free, cached_free,
            block_occupancy, padding, window_cached, num_steps, counts[0], counts[1], counts[2],
            num_batched_tokens, blocks_used)
        if len(self._packed) >= self._limit:
            self._next_batch()

    def add_breakdown(self, step: int, num_steps: int, t_s: float, dt_s: float, b: HybridBreakdown,
                      counts: tuple[int, int, int], num_batched_tokens: int, block_size: int) -> None:
        """Append one row from an instantaneous breakdown (in slots), its padding and window parts too."""
        cap, tokens, resv, internal, external, free, cached, allocated, padding, window = b
        self._packed += _HYBRID_ROW.pack(
            step, t_s, dt_s, tokens / cap, resv / cap, internal / cap, external / cap, free / cap,
            cached / cap, allocated / cap, padding / cap, window / cap, num_steps, counts[0], counts[1],
            counts[2], num_batched_tokens, allocated // block_size)
        if len(self._packed) >= self._limit:
            self._next_batch()

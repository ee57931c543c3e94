"""Per-step memory rows: packed as the run goes, handed to a sink in batches (or kept for a table in memory).

The memory table is the run's per-step (or per-span) breakdown in the DESIGN.md taxonomy. A row is appended
every loop iteration, so rows are packed bytes (`_ROW`), not Python objects; with a sink the log hands
them on a chunk at a time to its writing end (`MemoryBatches`: here, or in the events process for a run
folder's table) and keeps only the time-weighted sums the summary needs.
"""
from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.recfunctions import structured_to_unstructured

from simulator.sinks import Batches, TableSink, columns_of_chunks

if TYPE_CHECKING:  # the events process writes memory batches without the core or pandas
    import pandas as pd

    from simulator.core.allocator import MemoryBreakdown

MEMORY_COLUMNS = ("step", "num_steps", "t_s", "dt_s", "token_states", "reservation",
                  "internal_fragmentation", "external_fragmentation", "free", "cached_free",
                  "token_occupancy", "block_occupancy", "num_running", "num_waiting", "num_swapped",
                  "num_batched_tokens", "blocks_used")
_INT_COLUMNS = ("step", "num_steps", "num_running", "num_waiting", "num_swapped", "num_batched_tokens",
                "blocks_used")
MEMORY_DTYPES = {c: np.dtype(np.int64 if c in _INT_COLUMNS else np.float64) for c in MEMORY_COLUMNS}
# One memory row packed: the step, then the floats, then the counts as int32 (a step's counts and blocks
# never reach 2^31; `struct` raises if one did). `token_occupancy` is `token_states` and is not packed
# twice. 104 bytes instead of 17 float64 values (136): a batch of these (~2^14 rows) is held until it is
# written (docs/simulator-performance.md, twentieth sitting). Appending a packed row costs a third of
# `array.extend` with the tuple, which converts and grows the array value by value (one row a step).
_PACKED_FLOATS = ("t_s", "dt_s", "token_states", "reservation", "internal_fragmentation",
                  "external_fragmentation", "free", "cached_free", "block_occupancy")
_PACKED_COUNTS = ("num_steps", "num_running", "num_waiting", "num_swapped", "num_batched_tokens",
                  "blocks_used")
_ROW = struct.Struct(f"=q{len(_PACKED_FLOATS)}d{len(_PACKED_COUNTS)}i")
_pack_row = _ROW.pack
_ROW_DTYPE = np.dtype([("step", "=i8"), *((c, "=f8") for c in _PACKED_FLOATS),
                       *((c, "=i4") for c in _PACKED_COUNTS)])
_PACKED_DTYPES = {c: MEMORY_DTYPES[c] for c in _ROW_DTYPE.names}
_DT = _PACKED_FLOATS.index("dt_s")


def _columns(chunks: list, each: Callable[[np.ndarray], None] | None = None) -> dict[str, np.ndarray]:
    """The table's columns, in MEMORY_COLUMNS order, of the packed rows in `chunks` (which it empties)."""
    packed = columns_of_chunks(chunks, _ROW_DTYPE, _PACKED_DTYPES, each)
    packed["token_occupancy"] = packed["token_states"]
    return {c: packed[c] for c in MEMORY_COLUMNS}


class MemoryBatches(Batches):
    """A MemoryLog's writing end (simulator/sinks.py, Batches): the columns, and their time-weighted sums."""

    row_bytes = _ROW.size  # of one packed row

    def __init__(self, sink: TableSink) -> None:
        super().__init__(sink)
        self._wsum = np.zeros(len(_PACKED_FLOATS))  # sum of value * dt_s over the rows written
        self._dt = 0.0

    def columns(self, chunks: list) -> dict[str, np.ndarray]:
        """A batch's columns (its rows added to the sums)."""
        return _columns(chunks, self._add_sums)

    def _add_sums(self, rows: np.ndarray) -> None:
        """Add a chunk's rows to the time-weighted sums."""
        floats = structured_to_unstructured(rows[list(_PACKED_FLOATS)], copy=False)  # a view: no copy
        self._wsum += floats[:, _DT] @ floats
        self._dt += float(floats[:, _DT].sum())

    def sums(self) -> tuple[np.ndarray, float]:
        """The sums of value * dt_s per float column, and of dt_s."""
        return self._wsum, self._dt


class MemoryLog:
    """Per-step (or per-span) memory rows, kept packed (104 bytes a row, `_ROW`).

    With a `sink` (a run folder's memory table), the rows go to it as a batch at every `flush` (the
    simulation flushes halfway through each request batch) and at the latest every `sink.batch_rows` rows,
    a chunk of `sink.chunk_rows` rows at a time to their writing end (`MemoryBatches`, wherever the sink
    has it: `TableSink.open_batches`), and the log keeps only the time-weighted sums the summary needs
    (`weighted_means`), so a long run's memory does not grow with its steps.
    """

    def __init__(self, sink: TableSink | None = None, chunk_rows: int | None = None) -> None:
        self._packed = bytearray()  # the rows not yet handed on
        self.sink = sink
        self._batches = sink.open_batches(MemoryBatches) if sink is not None else None
        # `_limit`: the packed bytes that end the current chunk (or the batch).
        if sink is not None:
            self._chunk_bytes = (chunk_rows or sink.chunk_rows) * _ROW.size
            self._batch_bytes = sink.batch_rows * _ROW.size
            self._limit = min(self._chunk_bytes, self._batch_bytes)
        else:
            self._limit = float("inf")  # every row stays here (`to_frame`)
        self._held = 0  # bytes of the current batch handed on as chunks
        self._num_flushed = 0  # rows of the batches ended so far
        self._sums: tuple[np.ndarray, float] | None = None  # MemoryBatches.close's, after `finish`

    def __len__(self) -> int:
        return self._num_flushed + (self._held + len(self._packed)) // _ROW.size

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
            self._next_chunk()

    def add_slots(self, step: int, num_steps: int, t_s: float, dt_s: float, slots: tuple,
                  counts: tuple[int, int, int], num_batched_tokens: int, block_size: int) -> None:
        """Append one row from a breakdown given as (capacity, token_states, reservation, internal, external,
        free, cached_free, allocated) slots (the allocators' `breakdown_slots`)."""
        cap, tokens, resv, internal, external, free, cached, allocated = slots
        packed = self._packed
        packed += _pack_row(step, t_s, dt_s, tokens / cap, resv / cap, internal / cap, external / cap,
                            free / cap, cached / cap, allocated / cap, num_steps, counts[0], counts[1],
                            counts[2], num_batched_tokens, allocated // block_size)
        if len(packed) >= self._limit:  # inline: one call less per row
            self._next_chunk()

    def add_breakdown(self, step: int, t_s: float, dt_s: float, b: MemoryBreakdown,
                      counts: tuple[int, int, int], num_batched_tokens: int, block_size: int,
                      num_steps: int = 1) -> None:
        """Append a row from an instantaneous breakdown."""
        slots = (b.capacity, b.token_states, b.reservation, b.internal_fragmentation,
                 b.external_fragmentation, b.free, b.cached_free, b.allocated)
        self.add_slots(step, num_steps, t_s, dt_s, slots, counts, num_batched_tokens, block_size)

    def _next_chunk(self) -> None:
        """The rows so far go on as a chunk; the batch ends once it holds the sink's `batch_rows` (a batch's
        last chunk may be shorter; `flush` ends a batch sooner)."""
        chunk, self._packed = self._packed, bytearray()
        self._held += len(chunk)
        self._batches.add_chunk(chunk)
        if self._held >= self._batch_bytes:
            self.flush()  # which starts the next batch's limit
        else:
            self._limit = min(self._chunk_bytes, self._batch_bytes - self._held)

    def flush(self) -> None:
        """Hand the rows kept so far to the sink (keeping their time-weighted sums)."""
        if self.sink is None:
            return
        if self._packed:
            self._held += len(self._packed)
            self._batches.add_chunk(self._packed)
            self._packed = bytearray()
        self._limit = min(self._chunk_bytes, self._batch_bytes)  # a batch starts here, whoever flushed
        if self._held:
            self._batches.end_batch()
            self._num_flushed += self._held // _ROW.size
            self._held = 0

    def finish(self) -> None:
        """Hand the sink the last rows and close it (nothing to do without a sink)."""
        if self.sink is not None:
            self.flush()
            self._sums = self._batches.close()

    def weighted_means(self) -> tuple[dict, float, float] | None:
        """With a sink (after `finish`): what `simulator.results.memory_summary` computes, from the sums."""
        if self.sink is None:
            return None
        from simulator.core.allocator import MemoryBreakdown

        wsum, dt = self._sums
        if dt <= 0:
            nan = float("nan")
            return {**{s: nan for s in MemoryBreakdown.STATES}, "cached_free": nan}, nan, nan
        m = {c: float(v / dt) for c, v in zip(_PACKED_FLOATS, wsum, strict=True)}
        mean = {s: m[s] for s in (*MemoryBreakdown.STATES, "cached_free")}
        return mean, m["token_states"], m["block_occupancy"]

    def to_frame(self) -> pd.DataFrame | None:
        """The rows as a table with the documented dtypes (None when they went to a sink)."""
        if self.sink is not None:
            return None
        columns = _columns([self._packed] if self._packed else [])
        columns["token_occupancy"] = columns["token_occupancy"].copy()  # a column of its own in a frame
        import pandas as pd

        return pd.DataFrame(columns, copy=False)

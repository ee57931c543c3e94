"""One Parquet row group's columns, allocated once, that a sink copies its batches into.

The events table's row groups (2^18 tenures, ~9.4 MB of columns) used to be gathered from the pairing's
batches by reference: ~16 batches of 64-128 KB a column, freed when the group was written, so the events
process's RSS rose and fell by ~10 MB every group, and since the last batch could overshoot, a group held
262-279 k rows (a 1M-request run). Everything else that process does (encoding a memory or request
batch, pairing the next raw batch) met a gathering at whatever fill the workload's phase gave it, and a
longer run met more of those phases. One block, filled in place: a group holds exactly `rows` rows, its
memory is the same at every moment after the first group, and the pairing's temporaries keep the heap
to themselves (a 1M-request run: heap 25-28 MB instead of 33-38; docs/simulator-performance.md,
twenty-third sitting).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa


def numpy_dtypes(schema: pa.Schema) -> dict[str, np.dtype]:
    """The numpy dtype of each column of `schema` (fixed-width types)."""
    return {f.name: np.dtype(f.type.to_pandas_dtype()) for f in schema}


def arrow_table(columns: dict[str, np.ndarray], schema: pa.Schema) -> pa.Table:
    """Numpy columns as an Arrow table of `schema` (no copy where the types already match)."""
    return pa.Table.from_arrays([pa.array(columns[f.name], f.type) for f in schema], schema=schema)


class GroupBuffer:
    """Columns of `rows` rows for `schema` (fixed-width types), in one block of memory made once."""

    def __init__(self, schema: pa.Schema, rows: int) -> None:
        if rows < 1:
            raise ValueError(f"a row group buffer needs at least one row, got {rows}")
        self.schema = schema
        self.rows = rows
        self.num_rows = 0
        dtypes = numpy_dtypes(schema)
        # One allocation (past the mmap threshold: a mapping of its own, not heap space). Widest columns
        # first, so every column starts at a multiple of its item size.
        block = np.empty(rows * sum(t.itemsize for t in dtypes.values()), np.uint8)
        self.columns: dict[str, np.ndarray] = {}
        offset = 0
        for name, dtype in sorted(dtypes.items(), key=lambda item: -item[1].itemsize):
            size = rows * dtype.itemsize
            self.columns[name] = block[offset:offset + size].view(dtype)
            offset += size

    @property
    def full(self) -> bool:
        """Whether the group has all its rows."""
        return self.num_rows == self.rows

    def take(self, columns: dict[str, np.ndarray], start: int) -> int:
        """Copy the batch's rows from `start` on until the group is full; return how many it took."""
        n = min(len(next(iter(columns.values()))) - start, self.rows - self.num_rows)
        end = self.num_rows + n
        for name, column in self.columns.items():
            column[self.num_rows:end] = columns[name][start:start + n]
        self.num_rows = end
        return n

    def table(self) -> pa.Table:
        """The rows so far as an Arrow table over the buffer (no copy: write it before the next `take`)."""
        return arrow_table({c: v[:self.num_rows] for c, v in self.columns.items()}, self.schema)

    def clear(self) -> None:
        """Start the next group in the same memory."""
        self.num_rows = 0

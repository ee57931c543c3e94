"""Where a table's rows go as they are made: kept in memory, or written to Parquet or CSV as it grows.

A sink takes batches of numpy columns (`write`) in the table's schema order and dtypes, and `close` ends
the table. A file sink keeps at most one row group in memory, so a long run's memory does not grow with
its rows. Parquet tables are written in parts (see pagelab/parquet_parts.py for why and for reading):
NAME.parquet is one file, or a directory of part files in row order once it outgrows its first part.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from pagelab.writes import open_out

if TYPE_CHECKING:
    import pandas as pd

PART_GROUPS = 64  # row groups per part file (events: 2^24 tenures, ~0.4 MB of footer held at most)


def part_name(index: int) -> str:
    """File name of part `index` (zero-padded: name order is row order)."""
    return f"part-{index:05d}.parquet"


def numpy_dtypes(schema: pa.Schema) -> dict[str, np.dtype]:
    """The numpy dtype of each column of `schema` (fixed-width types)."""
    return {f.name: np.dtype(f.type.to_pandas_dtype()) for f in schema}


def arrow_schema(dtypes: dict[str, np.dtype]) -> pa.Schema:
    """The Arrow schema of columns with these numpy dtypes."""
    return pa.schema([(c, pa.from_numpy_dtype(t)) for c, t in dtypes.items()])


def arrow_table(columns: dict[str, np.ndarray], schema: pa.Schema) -> pa.Table:
    """Numpy columns as an Arrow table of `schema` (no copy where the types already match)."""
    return pa.Table.from_arrays([pa.array(columns[f.name], f.type) for f in schema], schema=schema)


def empty_frame(dtypes: dict[str, np.dtype]) -> pd.DataFrame:
    """A table with no rows and the given dtypes."""
    import pandas as pd  # here: the process that writes a long run's tables never imports pandas

    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in dtypes.items()})


class TableSink:
    """Receives batches of columns; `close` ends the table (no batch comes after it)."""

    num_rows: int = 0
    path: Path | None = None

    def write(self, columns: dict[str, np.ndarray]) -> None:
        """Take one batch."""
        raise NotImplementedError

    def close(self) -> None:
        """No more batches."""


class FrameSink(TableSink):
    """Keeps the batches in memory and concatenates them into one DataFrame (`frame`)."""

    def __init__(self, dtypes: dict[str, np.dtype]) -> None:
        self.num_rows = 0
        self.dtypes = dtypes
        self._batches: list[dict[str, np.ndarray]] = []

    def write(self, columns: dict[str, np.ndarray]) -> None:
        """Keep the batch."""
        self._batches.append(columns)
        self.num_rows += len(next(iter(columns.values())))

    def frame(self) -> pd.DataFrame:
        """All batches so far as one table."""
        if not self._batches:
            return empty_frame(self.dtypes)
        if len(self._batches) > 1:
            self._batches = [{c: np.concatenate([b[c] for b in self._batches]) for c in self.dtypes}]
        import pandas as pd

        return pd.DataFrame(self._batches[0], copy=False)


class GroupBuffer:
    """Columns of `rows` rows for `schema` (fixed-width types), in one block of memory made once.

    A sink with exact row groups copies its batches in here and writes the group when it is full: the
    group's memory is the same at every moment after the first, where gathering batches by reference
    made memory rise and fall by a group at a time.
    """

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


class ParquetSink(TableSink):
    """Writes batches to Parquet as they come: each as (at least) one row group, or gathered into row
    groups of at least `group_rows` rows (with `exact_groups`, copied into groups of exactly `group_rows`,
    the last one shorter); a new part file every `part_groups` row groups (a table that ends within its
    first part is a single file at `path`)."""

    def __init__(self, path: str | Path, schema: pa.Schema, group_rows: int = 0,
                 part_groups: int = PART_GROUPS, exact_groups: bool = False, **options) -> None:
        if part_groups < 1:
            raise ValueError(f"part_groups must be >= 1, got {part_groups}")
        if exact_groups and group_rows < 1:
            raise ValueError(f"exact row groups need group_rows >= 1, got {group_rows}")
        self.path = Path(path)
        self.schema = schema
        self.num_rows = 0
        # Batches are gathered (by reference: no copy) into row groups of at least `group_rows` rows. The
        # writer keeps each row group's footer entry until its part closes: parts bound that memory.
        self.group_rows = group_rows
        self.part_groups = part_groups
        self._options = options
        self._exact = exact_groups
        self._buffer: GroupBuffer | None = None  # made at the first batch: an empty table allocates nothing
        self._gathered: list[pa.Table] = []
        self._num_gathered = 0
        self._num_parts = 0
        self._groups_in_part = 0
        self._file = None  # the open part's file (pagelab/writes.py: a full disk is reported there)
        if self.path.is_file():
            self.path.unlink()  # a file of an earlier run; a directory of parts is never removed
        self.path.mkdir()
        self._open_part()  # now: an empty table still gets a file with its schema

    def _open_part(self) -> None:
        # The part's path as a str: as a Path each new file name would take a slot of the interpreter's
        # interned-string table, which then grows with the run.
        self._file = open_out(os.path.join(self.path, part_name(self._num_parts)))
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(
            self._file, self.schema, compression="zstd", compression_level=1, **self._options)
        self._num_parts += 1
        self._groups_in_part = 0

    def write(self, columns: dict[str, np.ndarray]) -> None:
        """Append the batch to the file (or to the row group being gathered)."""
        n = len(next(iter(columns.values())))
        if n and self._exact:
            if self._buffer is None:
                self._buffer = GroupBuffer(self.schema, self.group_rows)
            start = 0
            while start < n:
                start += self._buffer.take(columns, start)
                if self._buffer.full:
                    self._write_buffer()
            self.num_rows += n
        elif n:
            self._gathered.append(arrow_table(columns, self.schema))
            self._num_gathered += n
            self.num_rows += n
            if self._num_gathered >= self.group_rows:
                self._write_gathered()

    def _write_gathered(self) -> None:
        if self._gathered:
            self._write_group(pa.concat_tables(self._gathered))  # chunked: the batches are not copied
            self._gathered, self._num_gathered = [], 0

    def _write_buffer(self) -> None:
        if self._buffer is not None and self._buffer.num_rows:
            self._write_group(self._buffer.table())  # written before the buffer is refilled
            self._buffer.clear()

    def _write_group(self, table: pa.Table) -> None:
        """Write `table` as one row group (in a new part if the last one is full)."""
        if self._writer is None:
            self._open_part()
        self._writer.write_table(table, row_group_size=max(len(table), 1 << 20))
        self._groups_in_part += 1
        if self._groups_in_part >= self.part_groups:
            self._close_part()  # its footer entries go with it

    def _close_part(self) -> None:
        self._writer.close()
        self._writer = None
        self._file.close()
        self._file = None

    def close(self) -> None:
        """Write the last footer (an empty table still gets its schema); one part becomes the file."""
        if self._num_parts == 0:
            return  # closed already
        self._write_gathered()
        self._write_buffer()
        self._buffer = None
        if self._writer is not None:
            self._close_part()
        if self._num_parts == 1:
            single = self.path.with_name(f".{self.path.name}.part")
            os.rename(os.path.join(self.path, part_name(0)), single)  # a str: see _open_part
            self.path.rmdir()
            single.rename(self.path)
        self._num_parts = 0


class CsvSink(TableSink):
    """Appends each batch to a CSV file (`--table-format csv`)."""

    def __init__(self, path: str | Path, schema: pa.Schema) -> None:
        self.path = Path(path)
        self.schema = schema
        self.num_rows = 0
        self._file = open_out(self.path)
        self._writer = pa_csv.CSVWriter(self._file, schema)

    def write(self, columns: dict[str, np.ndarray]) -> None:
        """Append the batch's rows."""
        n = len(next(iter(columns.values())))
        if n:
            self._writer.write_table(arrow_table(columns, self.schema))
            self.num_rows += n

    def close(self) -> None:
        """Flush the file (a table without rows leaves just the header)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self._file.close()


def open_table_sink(path_stem: str | Path, schema: pa.Schema, table_format: str = "parquet", *,
                    group_rows: int = 0, part_groups: int = PART_GROUPS, exact_groups: bool = False,
                    **options) -> TableSink:
    """A file sink for a table of `schema`: PATH_STEM.parquet (row groups of at least `group_rows`, see
    ParquetSink) or PATH_STEM.csv."""
    stem = Path(path_stem)
    if table_format == "csv":
        return CsvSink(stem.with_suffix(".csv"), schema)
    return ParquetSink(stem.with_suffix(".parquet"), schema, group_rows, part_groups, exact_groups, **options)

"""Where a run's big tables go as it records them: memory, or a file written as it grows.

The EventRecorder hands its sink one batch of finished tenures at a time, in the documented row order
(by release time, then acquisition; tenures still held when the run ends come last, ending at the
run's end); the MemoryLog hands its sink batches of per-step rows in time order. Batches are numpy
columns in schema order and dtypes. A file sink keeps at most one batch in memory, so a run's peak
memory does not grow with its number of tenures or steps.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from pagelab.parquet_parts import PART_GROUPS, part_name
from simulator.group_buffer import GroupBuffer, arrow_table, numpy_dtypes

if TYPE_CHECKING:
    import pandas as pd

# Compact types: pool offsets, sizes, request ids and counts all fit in int32 (the recorder checks).
EVENT_SCHEMA = pa.schema([("request_id", pa.int32()), ("start", pa.int32()), ("size", pa.int32()),
                          ("t_start_s", pa.float64()), ("t_end_s", pa.float64()),
                          ("max_ref_count", pa.int32()), ("filled", pa.int32())])
EVENT_DTYPES = numpy_dtypes(EVENT_SCHEMA)
# Dictionaries on the block offsets, sizes, reference counts and fills (few distinct values a group),
# plain + zstd for request ids and times. Re-encoding a 1M-request run's first 10.5 M tenures in 2^18-row
# groups: 38.0 MB, against 40.5 MB with dictionaries on every column (Parquet's default, used until the
# twenty-second sitting: a time's dictionary costs more than it saves) and 41.6 MB with none; one
# group's write rises 1.5 MiB (median) / 1.7 (maximum), against 1.6 / 2.3 (every column) and 0.5 / 0.8
# (none). These writes set the events process's peaks (docs/simulator-performance.md, that sitting).
# Earlier: byte-stream-split times and delta / plain ints took 23 MB per 4.2 M rows against 15.9.
_EVENT_ENCODING: dict = {"use_dictionary": ["start", "size", "max_ref_count", "filled"]}
EVENT_GROUP_ROWS = 1 << 18  # tenures per row group, exactly (filled in place: simulator/group_buffer.py)
# The memory and request tables are the opposite: mostly distinct times and fractions, so dictionaries
# are built only to be dropped. Plain + zstd, measured on the 1M-request run's tables (16 row groups
# each): memory 45.6 MB instead of 48.5, requests 61.6 instead of 78.9, writes 9-40% faster, and a
# request batch's write takes ~7 MB instead of ~35 MB at once (a peak of a long run's RSS).
# Table sinks ask for 2^14-row batches and write each as a row group (the MemoryLog takes its batch size
# from its sink, the RequestLog batches TABLE_BATCH_ROWS): a 17-column batch is ~2.2 MB as numpy columns
# and as Arrow arrays, 1.7 MB as packed rows. With 2^16-row batches a flush was the largest allocation on
# the 1M-request run's path (docs/simulator-performance.md); 2^14-row batches gathered into 2^16-row groups
# held up to 8.9 MB of Arrow arrays per table between two writes, and when both tables' gatherings
# topped out together the loop's RSS did too: a longer run meets that more often, so a 10M run peaked
# higher than a 1M run (twelfth sitting). One group per batch: the files take ~4x the row groups.
TABLE_BATCH_ROWS = 1 << 14
TABLE_GROUP_ROWS = TABLE_BATCH_ROWS
# A simulation keeps its two logs' buffers in one phase (simulator/sim_state.py): the memory rows go when
# the request log holds half of its batch (RequestLog.midway). A memory row group therefore holds the steps
# of ~2^14 requests (1.0-1.12 rows a request on the traces), and a run's memory sink caps a batch
# at twice that, for runs with many steps a request. With a batch of its own, the memory log's phase
# drifted against the request log's: the loop's peaks were flushes that met the other log nearly full,
# and a longer run met that more often. Flushed together (the nineteenth sitting), every flush met the
# other log's whole batch; half a batch apart, each meets half of it (docs/simulator-performance.md,
# nineteenth and twentieth sittings). The event recorder's raw lists keep a phase of their own: handing
# them on at each table flush too made the events process's batches irregular, and its heap crept.
MEMORY_BATCH_ROWS = 1 << 15
# Row groups of at least this: a batch cut short by the request log's phase is written as it is, unless it
# is smaller (a run with many requests a step), which waits to be gathered with the next.
MEMORY_GROUP_ROWS = 1 << 12
# A Parquet writer keeps each row group's footer entry (a ~12 KB block and a few dozen small ones for these
# tables) until its part closes. Allocated a group at a time among the loop's objects, 64 groups a part grew
# the heap by ~2.4 MB over a 1M run's first part and left it in holes when the part closed, a point a 1M
# run never reached and a 10M run passed every million requests (its loop sat 1-3 MiB higher). 16 groups
# (262,144 rows) a part: over requests 0.1M-1M the heap grew 0.3 MiB instead of 2.4 (a glibc heap walk),
# and a 1M run meets the parts' cycle as a 10M run does (docs/simulator-performance.md, eighteenth sitting).
TABLE_PART_GROUPS = 16
# The two logs keep a batch's packed rows in chunks, and a flush frees each chunk as soon as its rows are
# in the batch's columns (allocated lazily: a column's pages become resident as they are written). With
# one flat buffer, the packed rows and their columns were resident together (1.5 MB each for a request
# batch, 2.2 MB each for a memory batch): the loop's largest rises of RSS, on top of whatever the other
# log held at the time (docs/simulator-performance.md, seventeenth sitting). Where the events process
# writes a long run's tables (simulator/hosted_tables.py), the logs hand it their rows in
# smaller chunks as they fill, and the simulation's process holds no batch at all (twenty-first sitting).
TABLE_CHUNK_ROWS = 1 << 12


class Batches:
    """The writing end of a log that packs rows (RequestLog, MemoryLog): it keeps a batch's packed rows
    (`row_bytes` each) as they come a chunk at a time, writes the batch's `columns` at `end_batch`, and
    `close` returns the log's `sums` of what it wrote. It runs in the simulation's process, or in the events
    process for a run folder's table (simulator/hosted_tables.py)."""

    row_bytes: int

    def __init__(self, sink: TableSink) -> None:
        self.sink = sink
        self._chunks: list = []

    def add_chunk(self, chunk: bytes | bytearray) -> None:
        """Keep one chunk of packed rows of the current batch."""
        self._chunks.append(chunk)

    def end_batch(self) -> None:
        """Write the batch as columns (if it has rows)."""
        chunks, self._chunks = self._chunks, []
        if chunks:
            self.sink.write(self.columns(chunks))

    def close(self) -> object:
        """Write the last batch, close the sink and return the sums."""
        self.end_batch()
        self.sink.close()
        return self.sums()

    def columns(self, chunks: list) -> dict[str, np.ndarray]:
        """A batch's columns from its chunks (which it empties), adding the rows to the sums."""
        raise NotImplementedError

    def sums(self) -> object:
        """What the log sums over the rows written."""
        raise NotImplementedError


def columns_of_chunks(chunks: list, row_dtype: np.dtype, dtypes: dict[str, np.dtype],
                      each: Callable[[np.ndarray], None] | None = None) -> dict[str, np.ndarray]:
    """The columns `dtypes` of the packed rows (`row_dtype` each) in `chunks`, which it empties: a chunk
    goes as soon as its rows are copied, so the packed rows and the columns are never resident together
    (the columns' pages become resident as they fill). `each`, if given, sees every chunk's rows first."""
    num = sum(memoryview(c).nbytes for c in chunks) // row_dtype.itemsize
    columns = {c: np.empty(num, t) for c, t in dtypes.items()}
    start = 0
    while chunks:
        rows = np.frombuffer(chunks[0], row_dtype)
        end = start + len(rows)
        if each is not None:
            each(rows)
        for c in dtypes:
            columns[c][start:end] = rows[c]
        del rows
        chunks.pop(0)  # the last reference: its rows go before the next chunk's are copied
        start = end
    return columns


def empty_table(dtypes: dict[str, np.dtype]) -> pd.DataFrame:
    """A table with no rows and the given dtypes."""
    import pandas as pd  # here: the events process (simulator/event_process.py) never needs pandas

    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in dtypes.items()})


def empty_events() -> pd.DataFrame:
    """An events table with no rows and the documented dtypes."""
    return empty_table(EVENT_DTYPES)


def _schema(dtypes: dict[str, np.dtype]) -> pa.Schema:
    return pa.schema([(c, pa.from_numpy_dtype(t)) for c, t in dtypes.items()])


class TableSink:
    """Receives batches of rows; `close` ends the table (no batch comes after it).

    `batch_rows` is how many rows the producer gathers per batch: the memory-versus-overhead knob
    (the recorder's raw events are flat typed arrays, ~20 bytes an event; pairing costs a few sorts).
    """

    num_rows: int = 0
    batch_rows: int = 1 << 20
    chunk_rows: int = TABLE_CHUNK_ROWS  # packed rows a log hands its batches at a time (open_batches)

    def write(self, columns: dict[str, np.ndarray]) -> None:
        """Take one batch."""
        raise NotImplementedError

    def open_batches(self, make: Callable[[TableSink], Batches]) -> Batches:
        """Where a log (RequestLog, MemoryLog) hands its packed rows: `make(self)`, the log's writing end,
        here (a HostedTable makes it in the events process instead: simulator/hosted_tables.py)."""
        return make(self)

    def close(self) -> None:
        """No more batches."""


EventSink = TableSink  # the sink simulate(..., events=) takes


class FrameSink(TableSink):
    """Keeps the batches in memory and concatenates them into one DataFrame (`frame`)."""

    def __init__(self, batch_rows: int = 1 << 20, dtypes: dict[str, np.dtype] | None = None) -> None:
        self.num_rows = 0
        self.batch_rows = batch_rows
        self.dtypes = dtypes or EVENT_DTYPES
        self._batches: list[dict[str, np.ndarray]] = []

    def write(self, columns: dict[str, np.ndarray]) -> None:
        """Keep the batch."""
        self._batches.append(columns)
        self.num_rows += len(next(iter(columns.values())))

    def frame(self) -> pd.DataFrame:
        """All batches so far as one table."""
        if not self._batches:
            return empty_table(self.dtypes)
        if len(self._batches) > 1:
            self._batches = [{c: np.concatenate([b[c] for b in self._batches]) for c in self.dtypes}]
        import pandas as pd

        return pd.DataFrame(self._batches[0], copy=False)


class ParquetSink(TableSink):
    """Writes batches to Parquet as they come, each as (at least) one row group, or gathered into row
    groups of at least `group_rows` rows (with `exact_groups`, copied into groups of exactly `group_rows`,
    the last one shorter); a new part file every `part_groups` row groups
    (pagelab/parquet_parts.py: a table that ends within its first part is a single file at `path`).

    Event row groups follow release time, so their min/max statistics on t_start_s / t_end_s let a
    reader load only the tenures of a time window (viz does).
    """

    def __init__(self, path: str | Path, schema: pa.Schema, batch_rows: int = 1 << 20, group_rows: int = 0,
                 part_groups: int = PART_GROUPS, exact_groups: bool = False, **options) -> None:
        if part_groups < 1:
            raise ValueError(f"part_groups must be >= 1, got {part_groups}")
        if exact_groups and group_rows < 1:
            raise ValueError(f"exact row groups need group_rows >= 1, got {group_rows}")
        self.path = Path(path)
        self.schema = schema
        self.num_rows = 0
        self.batch_rows = batch_rows
        # Batches are gathered (by reference: no copy) into row groups of at least `group_rows` rows. The
        # writer keeps ~6 KB per row group until it closes: 2^16-row groups of a 10M run's 316M tenures
        # would hold ~30 MB by the end, memory that grows with the run; parts bound it.
        self.group_rows = group_rows
        self.part_groups = part_groups
        self._options = options
        # exact_groups: batches are copied into one buffer of `group_rows` rows, written when full
        # (simulator/group_buffer.py); made at the first batch, so an empty table allocates nothing.
        self._exact = exact_groups
        self._buffer: GroupBuffer | None = None
        self._gathered: list[pa.Table] = []
        self._num_gathered = 0
        self._num_parts = 0
        self._groups_in_part = 0
        if self.path.is_file():
            self.path.unlink()  # ParquetWriter replaced a file; a directory of parts is never removed
        self.path.mkdir()
        self._open_part()  # now: an empty table still gets a file with its schema

    def _open_part(self) -> None:
        # The part's path as a str: as a Path each new file name would take a slot of the interned-string
        # table (simulator/hosted_tables.py, `_spool_path`).
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(
            os.path.join(self.path, part_name(self._num_parts)), self.schema, compression="zstd",
            compression_level=1, **self._options)
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
            self._writer.close()  # its footer entries go with it
            self._writer = None

    def close(self) -> None:
        """Write the last footer (an empty table still gets its schema); one part becomes the file."""
        if self._num_parts == 0:
            return  # closed already
        self._write_gathered()
        self._write_buffer()
        self._buffer = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._num_parts == 1:
            single = self.path.with_name(f".{self.path.name}.part")
            (self.path / part_name(0)).rename(single)
            self.path.rmdir()
            single.rename(self.path)
        self._num_parts = 0


class CsvSink(TableSink):
    """Appends each batch to a CSV file (`--table-format csv`)."""

    def __init__(self, path: str | Path, schema: pa.Schema, batch_rows: int = 1 << 20) -> None:
        self.path = Path(path)
        self.schema = schema
        self.num_rows = 0
        self.batch_rows = batch_rows
        self._writer = pa_csv.CSVWriter(str(self.path), schema)

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


def ParquetEventSink(path: str | Path, batch_rows: int = 1 << 20,  # noqa: N802 - a sink type
                     group_rows: int = EVENT_GROUP_ROWS, part_groups: int = PART_GROUPS) -> ParquetSink:
    """A Parquet sink with the events table's schema and encodings."""
    return ParquetSink(path, EVENT_SCHEMA, batch_rows, group_rows=group_rows, part_groups=part_groups,
                       exact_groups=group_rows > 0, **_EVENT_ENCODING)


def open_event_sink(path_stem: str | Path, table_format: str = "parquet", batch_rows: int = 1 << 20,
                    group_rows: int = EVENT_GROUP_ROWS, part_groups: int = PART_GROUPS) -> TableSink:
    """A file sink for the run folder's events table: PATH_STEM.parquet or PATH_STEM.csv (Parquet row
    groups of at least `group_rows` tenures)."""
    stem = Path(path_stem)
    if table_format == "csv":
        return CsvSink(stem.with_suffix(".csv"), EVENT_SCHEMA, batch_rows)
    return ParquetEventSink(stem.with_suffix(".parquet"), batch_rows, group_rows, part_groups)


def open_table_sink(path_stem: str | Path, dtypes: dict[str, np.dtype], table_format: str = "parquet",
                    batch_rows: int = TABLE_BATCH_ROWS, group_rows: int = TABLE_GROUP_ROWS,
                    part_groups: int = TABLE_PART_GROUPS) -> TableSink:
    """A file sink for a run folder's table of these dtypes (memory rows, request rows): batches of
    `batch_rows` rows asked for, Parquet row groups of at least `group_rows`."""
    stem = Path(path_stem)
    if table_format == "csv":
        return CsvSink(stem.with_suffix(".csv"), _schema(dtypes), batch_rows)
    return ParquetSink(stem.with_suffix(".parquet"), _schema(dtypes), batch_rows, group_rows=group_rows,
                       part_groups=part_groups, use_dictionary=False)


def open_memory_sink(path_stem: str | Path, dtypes: dict[str, np.dtype],
                     table_format: str = "parquet") -> TableSink:
    """A file sink for a run folder's memory table (`dtypes`: memory_log.MEMORY_DTYPES): batches of at most
    MEMORY_BATCH_ROWS rows (the simulation flushes halfway through each request batch), row groups of at
    least MEMORY_GROUP_ROWS."""
    return open_table_sink(path_stem, dtypes, table_format, batch_rows=MEMORY_BATCH_ROWS,
                           group_rows=MEMORY_GROUP_ROWS)

"""A long run's memory and request tables, written by the events process (simulator/event_process.py).

The logs (simulator/memory_log.py, simulator/request_log.py) append their packed rows to a spool file a
small chunk at a time; at the end of each batch the events process reads the file back, makes the columns
and encodes the Parquet row group, and deletes the file. The simulation's process then holds at most one
chunk of each log's rows, and no batch of columns or encoder buffers: those were the highest points of its
RSS, met at moments set by the workload, so a longer run met higher ones. A batch waits in the page cache,
not in either process's memory (docs/simulator-performance.md, twenty-first sitting).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from simulator.event_process import PROCESS_MIN_REQUESTS, ProcessEventSink, open_events_sink

if TYPE_CHECKING:
    from simulator.sinks import Batches, TableSink

# Rows a log appends to a hosted table's spool file at a time: what the simulation's process holds of each
# log's rows (a request chunk is ~96 KB, a memory chunk ~104 KB).
HOSTED_CHUNK_ROWS = 1 << 10


def host(events: ProcessEventSink, open_sink: Callable[[], TableSink], batch_rows: int,
         spool: Path) -> HostedTable:
    """A table that the events process of `events` writes (`open_sink` makes its sink there; it must
    pickle), fed by a log's packed rows in batches of `batch_rows` rows through spool files named after
    `spool`."""
    table = HostedTable(events, len(events.tables), open_sink, batch_rows, spool)
    events.tables.append(table)  # its spool files are discarded if the run is aborted
    return table


class HostedTable:
    """A run folder's table (memory rows, request rows) that a ProcessEventSink's child writes: a TableSink
    to its log, which hands the rows over with `open_batches`; `num_rows` and `path` are set when the log
    closes it. The rows of the batch in progress wait in a spool file (`spool` with a batch number and
    `.rows` appended), which the child reads and deletes when the batch ends."""

    chunk_rows = HOSTED_CHUNK_ROWS

    def __init__(self, events: ProcessEventSink, key: int, open_sink: Callable[[], TableSink],
                 batch_rows: int, spool: Path) -> None:
        self.events, self.key, self.open_sink = events, key, open_sink
        self.batch_rows = batch_rows
        self.spool = Path(spool)
        self.num_rows = 0
        self.path: Path | None = None
        self._batches: HostedBatches | None = None

    def open_batches(self, make: Callable[[TableSink], Batches]) -> HostedBatches:
        """The log's writing end, `make(sink)`, made in the child around the sink `open_sink` makes there."""
        if self._batches is not None:
            raise RuntimeError("a hosted table takes one log")
        self.events.post(("open_table", self.key, make, self.open_sink))
        self._batches = HostedBatches(self)
        return self._batches

    def write(self, columns) -> None:
        """Not for columns: a log hands this table packed rows (`open_batches`)."""
        raise TypeError("a HostedTable takes a log's packed rows (open_batches), not columns")

    def close(self) -> None:
        """Nothing to do here: the log closes the table through its batches (or the run was aborted)."""

    def discard_spools(self) -> None:
        """Delete the spool files the child did not get to (the run was aborted)."""
        if self._batches is not None:
            self._batches.drop()
        for path in self.spool.parent.glob(f"{self.spool.name}.*.rows"):
            path.unlink(missing_ok=True)


class HostedBatches:
    """The log's side of a HostedTable: a batch's chunks go to a spool file, the batch's end and the close
    to the child, in order."""

    def __init__(self, table: HostedTable) -> None:
        self.table = table
        self._num_batches = 0
        self._file = None

    def add_chunk(self, chunk: bytes | bytearray) -> None:
        """Append one chunk of packed rows to the batch's spool file."""
        if self._file is None:
            self._file = open(self._spool_path(), "wb", buffering=0)  # noqa: SIM115 - open until end_batch
        self._file.write(chunk)

    def _spool_path(self) -> str:
        # A str, not a Path: pathlib (3.11) interns each new part of a path, and each new interned string
        # takes a slot of the interpreter's interned table until the table grows: a 10M run's ~1,400 batch
        # names made it double at ~6.4M requests (+0.9 MiB to the end of the run).
        return f"{self.table.spool}.{self._num_batches}.rows"

    def end_batch(self) -> None:
        """The child writes the batch from its spool file (and deletes the file)."""
        if self._file is None:
            return
        self.drop()
        self.table.events.post(("end_batch", self.table.key, self._spool_path()))
        self._num_batches += 1

    def drop(self) -> None:
        """Close the batch's spool file without handing it on (so far: `end_batch` hands it on)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> object:
        """The child writes the last batch and closes the sink; what its batches' `close` returned."""
        self.end_batch()
        table = self.table
        _, _, table.num_rows, path, result = table.events.ask(("close_table", table.key), "table_closed")
        table.path = Path(path) if path is not None else None
        return result


def open_run_sinks(folder: Path, table_format: str, num_requests: int, record_events: bool,
                   min_requests: int = PROCESS_MIN_REQUESTS) -> dict:
    """The sinks of one run folder's tables, as `simulate(..., **sinks)` takes them: memory, requests and
    (with `record_events`) events. A run long enough to pair its tenures in a child process
    (`open_events_sink`) has the child write the memory and request tables too (`host`)."""
    from functools import partial

    from simulator.memory_log import MEMORY_DTYPES
    from simulator.request_log import REQUEST_DTYPES
    from simulator.sinks import MEMORY_BATCH_ROWS, TABLE_BATCH_ROWS, open_memory_sink, open_table_sink

    folder = Path(folder)
    memory = partial(open_memory_sink, folder / "memory", MEMORY_DTYPES, table_format)
    requests = partial(open_table_sink, folder / "requests", REQUEST_DTYPES, table_format)
    events = open_events_sink(folder / "events", table_format, num_requests, min_requests) \
        if record_events else None
    if isinstance(events, ProcessEventSink):
        return {"memory": host(events, memory, MEMORY_BATCH_ROWS, folder / ".memory"),
                "requests": host(events, requests, TABLE_BATCH_ROWS, folder / ".requests"), "events": events}
    sinks = {"memory": memory(), "requests": requests()}
    return sinks | ({"events": events} if events is not None else {})

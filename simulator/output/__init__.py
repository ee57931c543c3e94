"""Where a run's tables go: kept in memory (`InMemory`, the default), or written into a run folder as the
run goes (`RunFolder`). The loop sees one interface, `RunOutput`:

    simulator/loop ──▶ memory_rows(): MemoryRows ─┬──▶ InMemory: DataFrames          (memory_rows.py)
                  ──▶ request_rows(): RequestRows ─┤                                  (request_rows.py)
    allocator.events ─ drained ─▶ tenures(raw) ───┴──▶ RunFolder: Parquet or CSV files
                                                       paired and written here, or by
                                                       a child process for long runs   (child.py)

`transition_rows()` (preemptions and swaps, request_rows.py) and `ref_count_rows()` (shared blocks' owner
counts, tenures.py) need no pairing: this process writes them even when a child writes the rest.
`close` returns what was kept (`Kept`).

The modules one paged `simulate(trace, config, output=RunFolder(...))` runs, in the order it first enters
them (tests/test_shape.py traces it and compares):

    simulator.loop.simulate -> simulator.config -> simulator.core.models -> simulator.core.config ->
    simulator.core.scheduler -> simulator.presets -> simulator.core.kv_layout ->
    simulator.core.paged.block_manager -> simulator.core.paged.block_pool -> simulator.core.allocator ->
    simulator.core.paged.prefix_cache -> simulator.core.paged.swap -> simulator.timing.step_latency ->
    simulator.core.sequence -> simulator.core.decode -> simulator.loop.state -> simulator.output ->
    pagelab.table_sinks -> pagelab.writes -> simulator.output.memory_rows -> simulator.output.request_rows
    -> simulator.output.tenures -> pagelab.column_stats -> traces.batches -> simulator.loop.step ->
    simulator.metrics -> pagelab.malloc -> pagelab.parquet_parts
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from pagelab.table_sinks import FrameSink, arrow_schema, open_table_sink
from simulator.output.memory_rows import (
    HYBRID_DTYPES,
    MEMORY_DTYPES,
    HybridMemoryRows,
    MemoryFrame,
    MemoryRows,
    MemoryTable,
)
from simulator.output.request_rows import (
    REQUEST_DTYPES,
    TRANSITION_DTYPES,
    TRANSITION_SCHEMA,
    RequestColumns,
    RequestRows,
    RequestTable,
    TransitionRows,
)
from simulator.output.tenures import (
    EVENT_DTYPES,
    EVENT_ENCODING,
    EVENT_SCHEMA,
    REFCOUNT_DTYPES,
    REFCOUNT_SCHEMA,
    RefCountRows,
    TenurePairer,
)

if TYPE_CHECKING:
    import pandas as pd

    from simulator.core.allocator import RawEvents

UNBOUNDED = 1 << 62


@dataclass(frozen=True)
class Sizes:
    """Batch and row-group sizes of a run's tables: they keep a long run's memory flat and its files
    compact (docs/design.md); tests make them small to cross every boundary."""

    tenure_batch: int = 1 << 14  # allocation events drained and paired at a time (acquisitions)
    batch_rows: int = 1 << 12  # packed rows a table hands its writer at a time
    spool_batch_rows: int = 1 << 10  # ... to a spool file: what this process holds of each table
    memory_group_rows: int = 1 << 15  # memory rows per row group, at most
    memory_min_group_rows: int = 1 << 12  # a shorter memory row group (cut at `flush`) waits for the next
    request_group_rows: int = 1 << 14  # request rows per row group, exactly: what the statistics read at once
    event_group_rows: int = 1 << 18  # tenures per row group, exactly
    table_part_groups: int = 16  # row groups per part file of the memory and request tables
    event_part_groups: int = 64  # ... of the events table
    child_min_requests: int = 100_000  # a shorter run is over before a child process pays for its start


@dataclass
class Kept:
    """What a closed output kept: tables in memory (None when they went to files), the request table's
    columns (in memory or read from its file), the memory table's time-weighted sums (files), and the
    number of tenures."""

    memory: pd.DataFrame | None
    memory_sums: tuple | None
    requests: RequestColumns
    events: pd.DataFrame | None
    num_events: int
    transitions: pd.DataFrame | None = None
    refcounts: pd.DataFrame | None = None


class RunOutput(abc.ABC):
    """Receives a run's rows as it makes them (see the module docstring)."""

    sizes: Sizes

    def __init__(self) -> None:
        self._memory: MemoryRows | None = None
        self._requests: RequestRows | None = None
        self._transitions: TransitionRows | None = None
        self._refcounts: RefCountRows | None = None

    def memory_rows(self, hybrid: bool = False) -> MemoryRows:
        """The memory table's rows (made on the first call); `hybrid`: a pool split into KV cache groups,
        whose rows carry the run format's HYBRID_STATES too."""
        if self._memory is None:
            self._memory = self._open_memory(hybrid)
        return self._memory

    def request_rows(self) -> RequestRows:
        """The request table's rows (made on the first call)."""
        if self._requests is None:
            self._requests = self._open_requests()
        return self._requests

    def transition_rows(self) -> TransitionRows:
        """The transitions table's rows (made on the first call)."""
        if self._transitions is None:
            self._transitions = self._open_transitions()
        return self._transitions

    def _open_transitions(self) -> TransitionRows:
        """The transitions table's rows, kept in memory (a run folder writes them)."""
        return TransitionRows(FrameSink(TRANSITION_DTYPES), self.sizes.batch_rows)

    def ref_count_rows(self) -> RefCountRows:
        """The reference-count changes' rows (made on the first call)."""
        if self._refcounts is None:
            self._refcounts = self._open_refcounts()
        return self._refcounts

    def _open_refcounts(self) -> RefCountRows:
        """The reference-count changes, kept in memory (a run folder writes them)."""
        return RefCountRows(FrameSink(REFCOUNT_DTYPES), self.sizes.batch_rows)

    @abc.abstractmethod
    def _open_memory(self, hybrid: bool) -> MemoryRows:
        """The memory table's rows and their writer."""

    @abc.abstractmethod
    def _open_requests(self) -> RequestRows:
        """The request table's rows and their writer."""

    @abc.abstractmethod
    def tenures(self, raw: RawEvents, first_row: int, before: float | None, end_s: float = 0.0) -> None:
        """Pair a batch of allocation events; hand on the tenures released before `before` (all of them,
        those still held ending at `end_s`, when it is None)."""

    @abc.abstractmethod
    def close(self) -> Kept:
        """End every table (requests, memory, then events) and return what was kept."""

    def abort(self) -> None:  # noqa: B027 - most outputs have nothing to stop
        """The run failed: stop writing (what was written is thrown away with the run folder)."""

    @property
    def num_memory_rows(self) -> int:
        """Rows of the memory table so far."""
        return len(self._memory) if self._memory is not None else 0


class InMemory(RunOutput):
    """Keeps every table in memory and returns them as DataFrames."""

    def __init__(self, sizes: Sizes = Sizes()) -> None:
        super().__init__()
        self.sizes = sizes
        self._events = FrameSink(EVENT_DTYPES)
        self._pairer = TenurePairer(self._events)

    def _open_memory(self, hybrid: bool) -> MemoryRows:
        return (HybridMemoryRows if hybrid else MemoryRows)(MemoryFrame(hybrid), UNBOUNDED, UNBOUNDED)

    def _open_requests(self) -> RequestRows:
        return RequestRows(RequestTable(FrameSink(REQUEST_DTYPES)), self.sizes.batch_rows,
                           self.sizes.request_group_rows)

    def tenures(self, raw: RawEvents, first_row: int, before: float | None, end_s: float = 0.0) -> None:
        """Pair the batch here."""
        self._pairer.process(raw, first_row, before, end_s)

    def close(self) -> Kept:
        """The tables as DataFrames."""
        requests = self.request_rows()
        requests.end()
        frame = requests.writer.sink.frame()
        memory = self.memory_rows()
        memory.end()
        transitions, refcounts = self.transition_rows(), self.ref_count_rows()
        transitions.end()
        refcounts.end()
        return Kept(memory.writer.frame(), None, RequestColumns(requests.totals, frame=frame),
                    self._events.frame(), self._events.num_rows, transitions.sink.frame(),
                    refcounts.sink.frame())


def _memory_sink(folder: Path, table_format: str, sizes: Sizes, hybrid: bool = False):
    return open_table_sink(folder / "memory", arrow_schema(HYBRID_DTYPES if hybrid else MEMORY_DTYPES),
                           table_format,
                           group_rows=sizes.memory_min_group_rows, part_groups=sizes.table_part_groups,
                           use_dictionary=False)


def _request_sink(folder: Path, table_format: str, sizes: Sizes):
    return open_table_sink(folder / "requests", arrow_schema(REQUEST_DTYPES), table_format,
                           group_rows=sizes.request_group_rows, part_groups=sizes.table_part_groups,
                           use_dictionary=False)


def _events_sink(folder: Path, table_format: str, sizes: Sizes):
    return open_table_sink(folder / "events", EVENT_SCHEMA, table_format, group_rows=sizes.event_group_rows,
                           part_groups=sizes.event_part_groups, exact_groups=True, **EVENT_ENCODING)


def _transitions_sink(folder: Path, table_format: str, sizes: Sizes):
    return open_table_sink(folder / "transitions", TRANSITION_SCHEMA, table_format,
                           group_rows=sizes.request_group_rows, part_groups=sizes.table_part_groups,
                           use_dictionary=["kind"])


def _refcounts_sink(folder: Path, table_format: str, sizes: Sizes):
    return open_table_sink(folder / "refcounts", REFCOUNT_SCHEMA, table_format,
                           group_rows=sizes.request_group_rows, part_groups=sizes.table_part_groups,
                           use_dictionary=["ref_count"])


class RunFolder(RunOutput):
    """Writes the tables into `folder` (memory, requests and, with `record_events`, events; Parquet or
    CSV) as the run goes. A run of at least `sizes.child_min_requests` requests has a child process pair
    its tenures and write the tables (child.py); a shorter one writes them here."""

    def __init__(self, folder: str | Path, table_format: str = "parquet", *, num_requests: int = 0,
                 record_events: bool = True, sizes: Sizes = Sizes()) -> None:
        super().__init__()
        if table_format not in ("parquet", "csv"):
            raise ValueError(f"table_format must be 'parquet' or 'csv', got {table_format!r}")
        self.folder = Path(folder)
        self.table_format = table_format
        self.record_events = record_events
        self.sizes = sizes
        self._child = None
        self._pairer = None
        if num_requests >= sizes.child_min_requests and record_events:
            from simulator.output.child import ChildTables

            self._child = ChildTables(partial(_events_sink, self.folder, table_format, sizes))
        elif record_events:
            self._pairer = TenurePairer(_events_sink(self.folder, table_format, sizes))

    @property
    def in_child(self) -> bool:
        """Whether a child process writes the tables."""
        return self._child is not None

    def _open_memory(self, hybrid: bool) -> MemoryRows:
        sizes, args = self.sizes, (self.folder, self.table_format, self.sizes, hybrid)
        rows = HybridMemoryRows if hybrid else MemoryRows
        if self._child is not None:
            writer = self._child.table(partial(MemoryTable, hybrid=hybrid), partial(_memory_sink, *args),
                                       self.folder / ".memory")
            return rows(writer, sizes.spool_batch_rows, sizes.memory_group_rows)
        return rows(MemoryTable(_memory_sink(*args), hybrid), sizes.batch_rows, sizes.memory_group_rows)

    def _open_requests(self) -> RequestRows:
        from pagelab.malloc import release_free_memory

        sizes, args = self.sizes, (self.folder, self.table_format, self.sizes)
        if self._child is not None:
            writer = self._child.table(RequestTable, partial(_request_sink, *args), self.folder / ".requests")
            return RequestRows(writer, sizes.spool_batch_rows, sizes.request_group_rows,
                               trim=release_free_memory)
        return RequestRows(RequestTable(_request_sink(*args)), sizes.batch_rows, sizes.request_group_rows,
                           trim=release_free_memory)

    def _open_transitions(self) -> TransitionRows:
        # Written by this process even when a child writes the other tables: transitions are few.
        sink = _transitions_sink(self.folder, self.table_format, self.sizes)
        return TransitionRows(sink, self.sizes.batch_rows)

    def _open_refcounts(self) -> RefCountRows:
        # Written by this process, like the transitions: they need no pairing.
        sink = _refcounts_sink(self.folder, self.table_format, self.sizes)
        return RefCountRows(sink, self.sizes.batch_rows)

    def tenures(self, raw: RawEvents, first_row: int, before: float | None, end_s: float = 0.0) -> None:
        """Pair the batch here, or send it to the child."""
        if self._child is not None:
            self._child.tenures(raw, first_row, before, end_s)
        elif self._pairer is not None:
            self._pairer.process(raw, first_row, before, end_s)

    def close(self) -> Kept:
        """Finish every file (the tables first, the events last: the child writes all three)."""
        requests = self.request_rows()
        requests.end()
        path = requests.writer.path if self._child is not None else requests.writer.sink.path
        memory = self.memory_rows()
        sums = memory.end()
        self.transition_rows().end()
        self.ref_count_rows().end()
        num_events = 0
        if self._child is not None:
            self._child.close()
            num_events = self._child.num_events
        elif self._pairer is not None:
            self._pairer.sink.close()
            num_events = self._pairer.sink.num_rows
        return Kept(None, sums, RequestColumns(requests.totals, path=path), None, num_events)

    def abort(self) -> None:
        """Stop the child (if any) and drop its spool files."""
        if self._child is not None:
            self._child.abort()

    @property
    def child_peak_rss_mib(self) -> float | None:
        """The child process's own peak resident memory (None without a child, or before `close`)."""
        return self._child.peak_rss_mib if self._child is not None else None

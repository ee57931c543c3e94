"""Read run folders (docs/run-format.md) into dataclasses of DataFrames, checking every column we use."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from pagelab.parquet_parts import PartedFile, table_exists
from viz.errors import TableError, VizError
from viz.palette import PART_STATES, STATE_ORDER, allocator_sort_key
from viz.tables import (
    EVENT_COLUMNS,
    check_columns,
    check_schema,
    read_table,
    table_problem,
    table_rows,
    unreadable,
)

WINDOW_READ_ROWS = 2_000_000  # events tables larger than this are read by time window, not whole


def read_json(path: Path) -> dict:
    """Read a JSON object, turning absence and syntax errors into VizError naming the file."""
    if not path.is_file():
        raise VizError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise VizError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise VizError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _sorted_groups(meta, column: str) -> list[tuple[float, float, int]] | None:
    """(min, max, rows) of `column` per row group, from the footer's statistics; None when a group has no
    statistics or starts below the previous group's max (the file is not sorted by that column)."""
    names = meta.schema.to_arrow_schema().names
    if column not in names:
        return None
    col = names.index(column)
    groups, prev = [], -np.inf
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(col).statistics
        if stats is None or not stats.has_min_max or stats.min < prev:
            return None
        groups.append((stats.min, stats.max, meta.row_group(g).num_rows))
        prev = stats.max
    return groups


@dataclass
class AllocatorRun:
    """One allocator's results inside a run folder; tables are read on first use."""

    name: str
    path: Path
    config: dict
    summary: dict
    _problems: dict = field(default_factory=dict, repr=False)  # table -> TableError or None, once checked

    @cached_property
    def requests(self) -> pd.DataFrame:
        """requests.parquet: one row per request."""
        return self._all_requests(read_table(self.path, "requests"))

    @cached_property
    def memory(self) -> pd.DataFrame:
        """memory.parquet: one row per step or span of steps, sorted by time."""
        df = read_table(self.path, "memory")
        return df.sort_values("t_s", kind="stable", ignore_index=True)

    @cached_property
    def _memory_file(self) -> PartedFile | None:
        """The memory table's Parquet file(s) when read in row groups (time-ordered, not yet loaded)."""
        path = self.path / "memory.parquet"
        if "memory" in self.__dict__ or not table_exists(path):
            return None
        try:
            f = PartedFile(path, pre_buffer=False)
        except (OSError, ValueError) as exc:
            raise unreadable(self.path, "memory", exc) from None
        if f.metadata.num_rows == 0 or _sorted_groups(f.metadata, "t_s") is None:
            return None  # empty, or not in time order (or no statistics): load it whole and sort
        return f

    @cached_property
    def num_memory_rows(self) -> int:
        """Rows of the memory table (from the Parquet footer when it is streamed)."""
        f = self._memory_file
        return f.metadata.num_rows if f is not None else len(self.memory)

    def memory_chunks(self, columns: tuple[str, ...]) -> Iterator[pd.DataFrame]:
        """The memory table's `columns`, in time order, a row group at a time (a 10M-request run's table
        is ~13M rows: the figures bin it as it is read); one chunk when it is small or in memory."""
        if not self.num_memory_rows:  # a run writes at least its last row: none means the table lost them
            raise VizError(f"{self.path}: the memory table has no rows")
        f = self._memory_file
        if f is None:
            yield self.memory[list(columns)]
            return
        path = self.path / "memory.parquet"
        check_schema(f.schema_arrow, columns, path)
        for g in range(f.metadata.num_row_groups):
            try:
                df = f.read_row_group(g, columns=list(columns)).to_pandas()
            except (OSError, ValueError, KeyError) as exc:
                raise unreadable(self.path, "memory", exc) from None
            check_columns(df, columns, str(path))
            yield df

    def memory_span(self) -> tuple[float, float]:
        """Start of the first memory row and end of the last one."""
        f = self._memory_file
        if f is None:
            mem = self.memory
            return (float(mem["t_s"].iloc[0]), float(mem["t_s"].iloc[-1] + mem["dt_s"].iloc[-1])) if len(
                mem) else (0.0, 0.0)
        first = f.read_row_group(0, columns=["t_s"]).column(0)
        last = f.read_row_group(f.metadata.num_row_groups - 1, columns=["t_s", "dt_s"])
        return (float(first[0].as_py()),
                float(last.column(0)[-1].as_py()) + float(last.column(1)[-1].as_py()))

    def request_columns(self, columns: tuple[str, ...]) -> pd.DataFrame:
        """Only these columns of the request table (all of it when already loaded)."""
        if "requests" in self.__dict__:
            return self.requests[list(columns)]
        return self._all_requests(read_table(self.path, "requests", columns))

    def _all_requests(self, df: pd.DataFrame) -> pd.DataFrame:
        """`df`, the request table read, when it has a row for every request summary.json counts."""
        problem = self._short_of_requests(len(df))
        if problem is not None:
            raise problem
        return df

    def _short_of_requests(self, rows: int) -> TableError | None:
        """The error naming a request table of `rows` rows, fewer than summary.json's num_requests (a table
        cut short, or a part of it gone), or None."""
        expected = self.summary.get("num_requests")
        if not isinstance(expected, int) or isinstance(expected, bool) or rows >= expected:
            return None
        path = self.path / "requests.parquet"
        path = path if table_exists(path) else self.path / "requests.csv"
        return TableError(f"{path}: {rows:,} rows, but {self.path / 'summary.json'} counts {expected:,} "
                          "requests (the table is cut short)", path, "requests")

    @cached_property
    def events(self) -> pd.DataFrame:
        """events.parquet: one row per tenure of a pool region."""
        return read_table(self.path, "events")

    @cached_property
    def num_events(self) -> int:
        """Rows of the events table (from the Parquet footer: nothing else is read)."""
        meta = self._events_metadata()
        return meta.num_rows if meta is not None else len(self.events)

    def _events_metadata(self):
        path = self.path / "events.parquet"
        if "events" in self.__dict__ or not table_exists(path):
            return None
        try:
            with PartedFile(path) as f:
                return f.metadata
        except (OSError, ValueError) as exc:
            raise unreadable(self.path, "events", exc) from None

    def events_between(self, t0: float, t1: float) -> pd.DataFrame:
        """The tenures with t_start_s <= t1 and t_end_s > t0 (held at some time of [t0, t1]).

        A big Parquet table is read a row group at a time, skipping the groups whose statistics rule
        them out: simulate writes groups in release order, so a window costs about its own rows.
        """
        meta = self._events_metadata()
        if meta is None or meta.num_rows <= WINDOW_READ_ROWS:
            ev = self.events
            return ev[(ev["t_start_s"].to_numpy(float) <= t1) & (ev["t_end_s"].to_numpy(float) > t0)]
        path = self.path / "events.parquet"
        try:
            df = pq.read_table(path, filters=[("t_start_s", "<=", t1), ("t_end_s", ">", t0)]).to_pandas()
        except (OSError, ValueError) as exc:
            raise unreadable(self.path, "events", exc) from None
        check_columns(df, EVENT_COLUMNS, str(path))
        return df

    def early_events_end(self, max_rows: int) -> float | None:
        """A time T such that about `max_rows` tenures (plus those held at T) start before T, from the
        Parquet row-group statistics alone; None when the file is not in release order (or small)."""
        meta = self._events_metadata()
        if meta is None or meta.num_rows <= max_rows:
            return None
        rows = 0
        for _, high, num_rows in _sorted_groups(meta, "t_end_s") or ():  # None: not in release order
            rows += num_rows
            if rows >= max_rows:
                return float(high)
        return None

    def summary_value(self, *keys: str):
        """A (nested) key of summary.json, or VizError naming the file and the key path."""
        node = self.summary
        for depth, key in enumerate(keys):
            if not isinstance(node, dict) or key not in node or node[key] is None:
                dotted = ".".join(keys[: depth + 1])
                raise VizError(f"{self.path / 'summary.json'}: missing key '{dotted}'")
            node = node[key]
        return node

    def memory_fractions(self) -> dict[str, float]:
        """The five time-weighted memory fractions from summary.json."""
        return {s: float(self.summary_value("memory", s)) for s in STATE_ORDER}

    @property
    def parts(self) -> tuple[str, ...]:
        """The PART_STATES this run carries (a pool split into KV cache groups: its summary's memory
        shares and its memory table have them); () for other runs."""
        memory = self.summary.get("memory")
        return tuple(p for p in PART_STATES if isinstance(memory, dict) and p in memory)

    def part_fractions(self) -> dict[str, float]:
        """The time-weighted shares of `parts` from summary.json (empty when the run has none)."""
        return {p: float(self.summary_value("memory", p)) for p in self.parts}

    @property
    def capacity_slots(self) -> int:
        """Token slots the pool's blocks span, as the block map draws them (summary.json's capacity_slots;
        its capacity_tokens, else config.json's, where a run has no separate slot count)."""
        value = self.summary.get("capacity_slots",
                                 self.summary.get("capacity_tokens", self.config.get("capacity_tokens")))
        if value is None:
            raise VizError(f"{self.path / 'summary.json'}: missing key 'capacity_tokens'")
        return int(value)

    @property
    def block_size(self) -> int:
        """Block size in tokens (summary.json, else config.json)."""
        value = self.summary.get("block_size", self.config.get("block_size"))
        if value is None:
            raise VizError(f"{self.path / 'summary.json'}: missing key 'block_size'")
        return int(value)

    @property
    def incomplete(self) -> dict | None:
        """Where and why the run stopped early (a replay out of device memory), or None."""
        return self.summary.get("incomplete")

    def table_problems(self, names) -> list[TableError]:
        """The tables among `names` that cannot be read (pagelab plot draws without them)."""
        for name in names:
            if name not in self._problems:
                problem = table_problem(self.path, name)
                if problem is None and name == "requests":
                    problem = self._short_of_requests(table_rows(self.path, name))
                self._problems[name] = problem
        return [self._problems[n] for n in names if self._problems[n] is not None]

    @property
    def is_paged(self) -> bool:
        """Whether the allocator hands out fixed-size blocks."""
        return str(self.config.get("allocator", self.name)).startswith("paged")


@dataclass
class Run:
    """One run folder: the trace description and each allocator's results, keyed by allocator name."""

    path: Path
    label: str
    trace: dict
    allocators: dict[str, AllocatorRun] = field(default_factory=dict)
    incomplete: dict | None = None  # run.json's: where and why the run stopped early


def load_allocator(folder: Path, name: str | None = None) -> AllocatorRun:
    """Read one allocator folder's config.json and summary.json (tables stay lazy)."""
    if not folder.is_dir():
        raise VizError(f"{folder}: allocator folder not found")
    config = read_json(folder / "config.json")
    summary = read_json(folder / "summary.json")
    return AllocatorRun(name or str(config.get("allocator", folder.name)), folder, config, summary)


def load_run(path: Path, label: str | None = None) -> Run:
    """Read a run folder; a single allocator folder (with config.json) is accepted too."""
    path = Path(path)
    if not path.is_dir():
        raise VizError(f"{path} is a file, not a run folder" if path.is_file() else
                       f"{path}: run folder not found")
    if (path / "config.json").is_file():
        alloc = load_allocator(path, path.name)
        return Run(path, label or path.name, {}, {alloc.name: alloc})
    sweep = (path / "points").is_dir() or (path / "sweep.parquet").is_file()
    if not sweep and not (path / "summary.json").is_file() and \
            not any((p / "config.json").is_file() for p in path.iterdir()):
        raise VizError(f"{path} is not a pagelab run folder: it has no summary.json and no allocator folder "
                       "(a folder holding config.json)")
    top = read_json(path / "summary.json")
    names = list(top.get("allocators") or {})
    if not names:
        names = [p.name for p in path.iterdir() if (p / "config.json").is_file()]
    if not names and sweep:
        raise VizError(f"{path} is a sweep folder (pagelab sweep), not a run folder: `pagelab sweep ... "
                       f"--plot` draws its figures; its runs are under {path / 'points'}/*")
    if not names:
        raise VizError(f"{path / 'summary.json'}: key 'allocators' is empty and no allocator folders exist")
    names.sort(key=allocator_sort_key)
    trace = top.get("trace") if isinstance(top.get("trace"), dict) else {}
    marker = read_json(path / "run.json").get("incomplete") if (path / "run.json").is_file() else None
    return Run(path, label or path.name, trace, {n: load_allocator(path / n, n) for n in names}, marker)


def load_runs(paths: list[Path]) -> list[Run]:
    """Read several run folders, giving each a short label that is unique among them."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise VizError("no run folder given")
    labels = [p.resolve().name for p in paths]
    if len(set(labels)) < len(labels):
        labels = [f"{p.resolve().parent.name}/{p.resolve().name}" for p in paths]
    if len(set(labels)) < len(labels):
        labels = [f"{lab}#{i}" for i, lab in enumerate(labels)]
    return [load_run(p, lab) for p, lab in zip(paths, labels, strict=True)]


def series_label(run: Run, alloc: AllocatorRun, multi_run: bool) -> str:
    """Legend text for one allocator of one run: "run/allocator" when several runs are shown."""
    return run_allocator(run, alloc) if multi_run else alloc.name


def run_allocator(run: Run, alloc: AllocatorRun) -> str:
    """"run/allocator", or the run's label alone when the run is that allocator's folder (its label names
    the allocator already)."""
    return run.label if alloc.path == run.path else f"{run.label}/{alloc.name}"

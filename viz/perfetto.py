"""A run folder as Chrome trace-event JSON, the format Perfetto (ui.perfetto.dev) and chrome://tracing open.

One process per allocator, one thread per request (tid: its row in the request table; named by the trace's
id) whose phases (waiting, prefill, decode) are slices, with its preemptions and swaps as instants (when the
run folder records their times); counter tracks for every memory state (share of the pool; padding and
window_cached too where a run carries them), the running batch, the waiting and swapped queues and the
batched tokens.

The file is written as the tables are read, a row group at a time, so a run of a million requests never
holds its whole JSON (or its whole request table) in memory. Times are in microseconds, as the format wants.
"""
from __future__ import annotations

import io
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from pagelab.atomic import atomic_write
from pagelab.parquet_parts import table_exists
from pagelab.writes import open_out
from viz.errors import TableError
from viz.load import AllocatorRun, Run, load_run
from viz.palette import STATE_ORDER
from viz.tables import check_table, parquet_batches

PHASES = ("waiting", "prefill", "decode")  # a request's slices, in the order they happen
QUEUE_COUNTERS = {"num_running": "running", "num_waiting": "waiting", "num_swapped": "swapped",
                  "num_batched_tokens": "batched tokens"}
EXPORTED_REQUEST_COLUMNS = ("request_id", "arrival_s", "admitted_s", "first_token_s", "finish_s", "rejected")
REQUEST_READ_ROWS = 65_536
_US = 1e6
_WRITE_BUFFER = 1 << 20


def _us(t: float) -> str:
    """Seconds as microseconds with nanosecond precision (the JSON number of `ts` and `dur`)."""
    return f"{t * _US:.3f}"


def _meta(pid: int, tid: int | None, kind: str, value) -> str:
    key = "name" if kind.endswith("_name") else "sort_index"
    tid_part = "" if tid is None else f',"tid":{tid}'
    return f'{{"ph":"M","pid":{pid}{tid_part},"name":"{kind}","args":{{"{key}":{json.dumps(value)}}}}}'


def request_phases(arrival: float, admitted: float, first_token: float, finish: float, end_s: float
                   ) -> list[tuple[str, float, float]]:
    """(phase, start, end) of one request: waiting until first admitted, prefill until its first token,
    decode until its last; a phase still under way at the end of the run ends there."""
    edges = [arrival, admitted, first_token, finish]
    out = []
    for i, phase in enumerate(PHASES):
        start, end = edges[i], edges[i + 1]
        if math.isnan(start):
            break
        if math.isnan(end):
            out.append((phase, start, max(start, end_s)))
            break
        out.append((phase, start, end))
    return out


def _request_batches(alloc: AllocatorRun) -> Iterator[dict[str, np.ndarray]]:
    """The request table's columns the trace needs, a batch of rows at a time."""
    cols = list(EXPORTED_REQUEST_COLUMNS)
    path = alloc.path / "requests.parquet"
    if table_exists(path):
        for batch in parquet_batches(alloc.path, "requests", cols, REQUEST_READ_ROWS):
            yield {c: batch.column(i).to_numpy(zero_copy_only=False) for i, c in enumerate(cols)}
    else:
        df = alloc.request_columns(EXPORTED_REQUEST_COLUMNS)
        yield {c: df[c].to_numpy() for c in cols}


def _request_events(pid: int, alloc: AllocatorRun, end_s: float) -> Iterator[str]:
    """A thread per request, named by the trace's id; its tid is the request's row, the request_id the
    transitions table gives its instants."""
    tid = 0
    for b in _request_batches(alloc):
        columns = (b[c].tolist() for c in ("request_id", "arrival_s", "admitted_s", "first_token_s",
                                           "finish_s", "rejected"))
        for rid, arr, adm, first, fin, rej in zip(*columns, strict=True):
            yield _meta(pid, tid, "thread_name", f"request {rid}")
            if rej:
                yield (f'{{"ph":"i","s":"t","pid":{pid},"tid":{tid},"name":"rejected",'
                       f'"ts":{_us(arr)}}}')
            else:
                for phase, start, end in request_phases(arr, adm, first, fin, end_s):
                    yield (f'{{"ph":"X","pid":{pid},"tid":{tid},"name":"{phase}","cat":"request",'
                           f'"ts":{_us(start)},"dur":{_us(end - start)}}}')
            tid += 1


def _instant_events(pid: int, alloc: AllocatorRun) -> Iterator[str]:
    """Preemptions and swaps at their times, from the transitions table when the run folder has one."""
    from viz.transitions import read_transitions  # the table is optional: older runs lack it

    for df in read_transitions(alloc):
        for rid, t, kind in zip(df["request_id"].tolist(), df["t_s"].tolist(), df["kind_name"].tolist(),
                                strict=True):
            yield f'{{"ph":"i","s":"t","pid":{pid},"tid":{rid},"name":"{kind}","ts":{_us(t)}}}'


def _memory_columns(alloc: AllocatorRun) -> tuple[str, ...]:
    """The memory table's columns the counters read (the parts of states a run with KV cache groups
    carries too)."""
    return ("t_s", *STATE_ORDER, *alloc.parts, *QUEUE_COUNTERS)


def _counter_events(pid: int, alloc: AllocatorRun) -> Iterator[str]:
    """Each counter at the rows where its value changes (a counter track holds its value until the next)."""
    states = (*STATE_ORDER, *alloc.parts)
    columns = _memory_columns(alloc)
    names = {**{s: (s, "share") for s in states}, **{c: (n, "count") for c, n in QUEUE_COUNTERS.items()}}
    last: dict[str, object] = {}
    for df in alloc.memory_chunks(columns):
        t = df["t_s"].to_numpy(float).tolist()
        values = {c: df[c].to_numpy().tolist() for c in columns[1:]}
        for i, ts in enumerate(t):
            stamp = _us(ts)
            for col, (name, unit) in names.items():
                value = values[col][i]
                if last.get(col) != value:
                    last[col] = value
                    yield _counter(pid, name, stamp, unit, value)
    if not _all_done(alloc):
        return
    # A memory row holds from its time to the next; after the last one every request is done: nothing
    # runs or waits and no memory is held (what the prefix cache keeps of free memory stays as it was).
    stamp = _us(run_end(alloc))
    for col, (name, unit) in names.items():
        if col in ("cached_free", "window_cached") or col not in last:
            continue
        value = 1.0 if col == "free" else 0
        if last[col] != value:
            yield _counter(pid, name, stamp, unit, value)


def _counter(pid: int, name: str, stamp: str, unit: str, value) -> str:
    """One counter event: a share to 6 significant digits, a count as it is."""
    shown = f"{value:.6g}" if unit == "share" else value
    return f'{{"ph":"C","pid":{pid},"name":"{name}","ts":{stamp},"args":{{"{unit}":{shown}}}}}'


def _all_done(alloc: AllocatorRun) -> bool:
    """Whether the summary says every request finished or was rejected (a cut-short run has some left)."""
    s = alloc.summary
    counts = [s.get(k) for k in ("num_requests", "num_finished", "num_rejected")]
    return all(isinstance(c, int) for c in counts) and counts[1] + counts[2] == counts[0]


def run_end(alloc: AllocatorRun) -> float:
    """End of an allocator's run: its summary's duration, else the end of its last memory row."""
    value = alloc.summary.get("sim_duration_s")
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return alloc.memory_span()[1]


def trace_events(run: Run) -> Iterator[str]:
    """Every trace event of a run, as JSON text, one allocator (process) after another."""
    for pid, alloc in enumerate(run.allocators.values(), start=1):
        yield _meta(pid, None, "process_name", alloc.name)
        yield _meta(pid, None, "process_sort_index", pid)
        yield from _counter_events(pid, alloc)
        yield from _request_events(pid, alloc, run_end(alloc))
        yield from _instant_events(pid, alloc)


def write_events(out: io.BufferedWriter, events: Iterable[str]) -> int:
    """Write a trace-event JSON object holding `events`; return how many were written."""
    out.write(b'{"displayTimeUnit":"ms","traceEvents":[\n')
    count, pending = 0, []
    for event in events:
        pending.append(event)
        if len(pending) >= 4096:
            out.write(((",\n" if count else "") + ",\n".join(pending)).encode())
            count += len(pending)
            pending.clear()
    if pending:
        out.write(((",\n" if count else "") + ",\n".join(pending)).encode())
        count += len(pending)
    out.write(b"\n]}\n")
    return count


def table_problem(run: Run) -> TableError | None:
    """The first table the export reads that cannot be read (from its footers, or a CSV's rows), or None:
    found before anything is written."""
    from viz.transitions import has_table

    for alloc in run.allocators.values():
        optional = ("transitions",) if has_table(alloc, "transitions") else ()
        problems = alloc.table_problems(("requests", "memory", *optional))
        if problems:
            return problems[0]
    return None


def check_tables(run: Run) -> None:
    """Raise, before anything is written, the first problem of the tables the export reads: a file that
    cannot be read (TableError), or a column missing (VizError naming the file and the column)."""
    problem = table_problem(run)
    if problem is not None:
        raise problem
    for alloc in run.allocators.values():
        check_table(alloc.path, "requests", EXPORTED_REQUEST_COLUMNS)
        check_table(alloc.path, "memory", _memory_columns(alloc))


def export_perfetto(run_dir: Path, out_path: Path) -> int:
    """Write run folder `run_dir` as trace-event JSON at `out_path` (via a temporary name); return the
    number of events. TableError naming the file when a table cannot be read."""
    return write_perfetto(load_run(Path(run_dir)), out_path)


def write_perfetto(run: Run, out_path: Path) -> int:
    """Write a loaded run as trace-event JSON at `out_path` (via a temporary name), once `check_tables`
    finds its tables whole; return the number of events."""
    check_tables(run)
    counted = []

    def write(tmp: Path) -> None:
        with open_out(tmp) as raw, io.BufferedWriter(raw, _WRITE_BUFFER) as out:
            counted.append(write_events(out, trace_events(run)))

    atomic_write(out_path, write, suffix=".json")
    return counted[0]

"""A long run's tables written by a child process: the files this process writes, rows in order, failures
that surface, nothing left behind."""
from __future__ import annotations

import dataclasses
import os
import socket
import sys
from functools import partial
from pathlib import Path

import pandas as pd
import pytest

from pagelab.parquet_parts import PART_PATTERN, PartedFile, part_files
from pagelab.table_sinks import arrow_schema, open_table_sink
from simulator.config import SimConfig
from simulator.core.allocator import EventLog
from simulator.loop import simulate
from simulator.output import RunFolder, Sizes
from simulator.output.child import SEND_BUFFER_BYTES, STREAM_BUFFER_BYTES, ChildTables
from simulator.output.request_rows import REQUEST_DTYPES, RequestRows, RequestTable
from simulator.output.tenures import EVENT_DTYPES, EVENT_SCHEMA
from traces import SyntheticConfig, generate_trace, load_trace

# Row groups small enough that a short trace crosses every boundary, in either process.
SMALL = Sizes(tenure_batch=37, event_group_rows=300, request_group_rows=256, memory_group_rows=512,
              memory_min_group_rows=64, table_part_groups=3)
IN_CHILD = dataclasses.replace(SMALL, child_min_requests=0)


def _trace(num: int = 150) -> pd.DataFrame:
    return generate_trace(SyntheticConfig(num_requests=num, rate=40.0, lengths="sharegpt", seed=3))


def _events(path: Path) -> ChildTables:
    return ChildTables(partial(open_table_sink, path, EVENT_SCHEMA))


def _files(folder: Path) -> dict[str, list[bytes]]:
    return {p.name: [q.read_bytes() for q in part_files(p)] for p in folder.iterdir()
            if p.suffix in (".parquet", ".csv")}


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_the_child_writes_the_files_this_process_writes(tmp_path, fmt):
    trace = _trace(900)
    cfg = SimConfig(capacity_tokens=20_000)
    runs = {}
    for label, child_min in (("here", len(trace) + 1), ("child", len(trace))):
        folder = tmp_path / label
        folder.mkdir()
        # The same hand-off batch both ways, so the memory table's row groups end at the same steps.
        sizes = dataclasses.replace(SMALL, child_min_requests=child_min, batch_rows=SMALL.spool_batch_rows)
        output = RunFolder(folder, fmt, num_requests=len(trace), sizes=sizes)
        runs[label] = (output, simulate(trace, cfg, output))
    (here_out, here), (child_out, child) = runs["here"], runs["child"]
    assert child_out.in_child and not here_out.in_child
    here_files, child_files = _files(tmp_path / "here"), _files(tmp_path / "child")
    tables = ("events", "memory", "refcounts", "requests", "transitions")
    assert sorted(here_files) == [f"{t}.{fmt}" for t in tables]
    assert child_files == here_files
    assert sorted(os.listdir(tmp_path / "child")) == sorted(os.listdir(tmp_path / "here"))  # no spools left
    assert child.num_events == here.num_events > 1000
    assert {k: v for k, v in child.summary.items() if k != "wall_s"} == \
        {k: v for k, v in here.summary.items() if k != "wall_s"}
    assert child.request_columns.column("ttft_s").tolist() == here.request_columns.column("ttft_s").tolist()
    assert 10 < child_out.child_peak_rss_mib < 1024  # its own peak, reported when it closed


def test_shared_prefix_blocks_pair_alike_in_the_child(tmp_path):
    trace = load_trace("mooncake-conv").iloc[:40].reset_index(drop=True)
    cfg = SimConfig(enable_prefix_caching=True, capacity_tokens=40_000)
    here = simulate(trace, cfg)
    output = RunFolder(tmp_path, num_requests=len(trace), sizes=IN_CHILD)
    simulate(trace, cfg, output)
    events = pd.read_parquet(tmp_path / "events.parquet")
    assert (events["max_ref_count"] > 1).any()  # shares went through the child's pairing
    pd.testing.assert_frame_equal(events, here.events)


def test_a_spooled_request_table_hands_rows_on_in_order_in_its_row_groups(tmp_path):
    child = _events(tmp_path / "events")
    open_sink = partial(open_table_sink, tmp_path / "requests", arrow_schema(REQUEST_DTYPES), group_rows=0,
                        part_groups=2)
    writer = child.table(RequestTable, open_sink, tmp_path / ".requests")
    from pagelab.table_sinks import FrameSink

    local = RequestTable(FrameSink(REQUEST_DTYPES))
    logs = [RequestRows(local, batch_rows=2, group_rows=7), RequestRows(writer, batch_rows=2, group_rows=7)]
    order = [i ^ 1 for i in range(40)]  # rows finish out of order: 1, 0, 3, 2, ...
    for log in logs:
        for i in range(40):
            log.open(i, (100 + i, float(i), 5, 3, 1, 1))
            log.admitted[i], log.first_token[i] = i + 0.5, 40.0 + i
        for k, i in enumerate(order):
            log.finish[i] = 50.0 + k
            log.close(i)
        log.end()
    child.close()
    assert writer.num_rows == 40 and writer.path == tmp_path / "requests.parquet"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.parquet", "requests.parquet"]
    pd.testing.assert_frame_equal(pd.read_parquet(writer.path), local.sink.frame(), check_exact=True)
    assert vars(logs[1].totals) == vars(logs[0].totals)
    assert logs[1].totals.num_finished == 40 and logs[1].totals.output_tokens == 120
    with PartedFile(writer.path) as f:  # each row group of 7 rows (the last shorter), two a part
        groups = [f.metadata.row_group(i).num_rows for i in range(f.metadata.num_row_groups)]
    assert groups == [7] * 5 + [5] and len(part_files(writer.path)) == 3


def test_an_error_in_the_child_is_raised_in_the_run_and_leaves_nothing(tmp_path):
    # The child cannot open the events file (no such folder): the run fails with the child's error.
    missing = tmp_path / "missing"
    output = RunFolder(tmp_path, num_requests=60, sizes=IN_CHILD)
    output._child.open_events = partial(open_table_sink, missing / "events", EVENT_SCHEMA)
    with pytest.raises(FileNotFoundError):
        simulate(_trace(60), SimConfig(capacity_tokens=6000), output)
    assert output._child._proc.returncode is not None  # no child left behind
    assert not list(tmp_path.glob(".*.rows"))  # nor the rows it did not get to


def test_an_aborted_run_leaves_no_spool_file(tmp_path):
    child = _events(tmp_path / "events")
    writer = child.table(RequestTable, partial(open_table_sink, tmp_path / "requests",
                                               arrow_schema(REQUEST_DTYPES)), tmp_path / ".requests")
    writer.add_batch(bytes(RequestTable.row_bytes * 3))  # a row group in progress: its rows wait in the spool
    assert [p.name for p in tmp_path.glob(".requests*")] == [".requests.0.rows"]
    child.abort()
    assert not list(tmp_path.glob(".requests*"))


def test_a_child_that_dies_fails_the_run(tmp_path):
    child = _events(tmp_path / "events")
    log = EventLog()
    log.acquire_blocks(list(range(40)), 16, 1, 1)
    child.tenures(*log.take(), None)  # the child starts
    child._proc.kill()
    child._proc.wait()
    with pytest.raises(RuntimeError, match="exited early"):
        for i in range(200):
            log.release_blocks(list(range(40)), 16, [16] * 40)
            log.acquire_blocks(list(range(40)), 16, i, i)
            child.tenures(*log.take(), 1.0)
        child.close()


def test_the_child_exits_when_the_parent_end_closes(tmp_path):
    child = _events(tmp_path / "events")
    log = EventLog()
    log.acquire_blocks([0], 16, 1, 1)
    child.tenures(*log.take(), None)
    child._conn.close()  # what the parent dying does to the socket
    assert child._proc.wait(timeout=60) == 0


def test_the_parent_end_has_room_for_several_raw_batches(tmp_path):
    # A raw batch (~250 KB pickled) must not wait for the child to read it: the send buffer is raised
    # as far as the system allows (Linux reports twice the size it keeps).
    try:
        limit = int(Path("/proc/sys/net/core/wmem_max").read_text())
    except OSError:
        pytest.skip("no /proc/sys/net/core/wmem_max to compare with")
    child = _events(tmp_path / "events")
    child._start()
    with socket.socket(fileno=os.dup(child._conn.fileno())) as end:
        assert end.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= min(SEND_BUFFER_BYTES, limit)
    child.close()
    assert child.num_events == 0 and list(pd.read_parquet(child.events_path).columns) == list(EVENT_DTYPES)


def test_the_child_pairs_and_writes_without_pandas(tmp_path):
    # pyarrow imports pandas at its first pa.array(ndarray) if it may (~45 MB resident); the child refuses
    # it. Its mapped files show what it imported, after it has paired and written a row group.
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/PID/maps to read a process's libraries from")
    assert "/pandas/" in maps.read_text()  # this process has pandas: the check below can see it
    child = ChildTables(partial(open_table_sink, tmp_path / "events", EVENT_SCHEMA, group_rows=4,
                                exact_groups=True))
    log = EventLog()
    log.acquire_blocks(list(range(8)), 16, 1, 1)
    log.now = 1.0
    log.release_blocks(list(range(8)), 16, [16] * 8)
    child.tenures(*log.take(), 2.0)  # released at 1.0 < 2.0: paired and written as two row groups
    # A table opened and closed after it: its answer comes once the child has written the tenures.
    child.table(RequestTable, partial(open_table_sink, tmp_path / "requests", arrow_schema(REQUEST_DTYPES)),
                tmp_path / ".requests").close()
    child_maps = Path(f"/proc/{child._proc.pid}/maps").read_text()
    child.close()
    assert "/pyarrow/" in child_maps and "/pandas/" not in child_maps
    assert child.num_events == 8 and len(pd.read_parquet(child.events_path)) == 8


class _Writes:
    """A file that records the size of every write before passing it on."""

    def __init__(self, out) -> None:
        self.out, self.sizes = out, []

    def write(self, data) -> int:
        self.sizes.append(len(data))
        return self.out.write(data)

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        self.out.close()


def test_raw_batches_go_to_the_child_in_frames_not_whole(tmp_path):
    # A raw batch is pickled into the socket a frame at a time: the parent never holds one whole.
    child = _events(tmp_path / "events")
    child._start()
    child._out = writes = _Writes(child._out)
    log = EventLog()
    ids = list(range(1000, 41_000))
    ids40k = list(range(40_000))
    log.acquire_blocks(ids, 16, ids40k, ids40k)  # 40,000 acquisitions, pickled > 400 KB
    log.now = 1.0
    log.release_blocks(ids, 16, [7] * len(ids))
    child.tenures(*log.take(), None, 2.0)
    child.close()
    # A frame ends at the first opcode past 64 KiB, a few bytes over.
    assert sum(writes.sizes) > 6 * STREAM_BUFFER_BYTES and max(writes.sizes) <= STREAM_BUFFER_BYTES + 1024
    events = pd.read_parquet(child.events_path)
    assert events["request_id"].tolist() == list(range(40_000)) and (events["filled"] == 7).all()


def test_spool_and_part_file_names_are_not_interned(tmp_path, monkeypatch):
    """pathlib interns every new part of a path, and each new interned string takes a slot of the
    interpreter's interned table until it grows: a long run's thousands of file names would grow it."""
    interned = []
    real = sys.intern
    monkeypatch.setattr(sys, "intern", lambda s: interned.append(s) or real(s))
    trace = _trace(900)
    output = RunFolder(tmp_path, num_requests=len(trace), sizes=IN_CHILD)
    assert simulate(trace, SimConfig(), output).summary["num_requests"] == len(trace)
    names = [s for s in interned if s.endswith(".rows") or (s.startswith("part-") and s != PART_PATTERN)]
    assert len(part_files(tmp_path / "requests.parquet")) > 1  # parts were opened, spools written
    assert names == []

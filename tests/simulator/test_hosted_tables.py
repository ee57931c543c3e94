"""A long run's memory and request tables written by the events process: the files this process writes,
rows in order, failures that surface, nothing left behind."""
from __future__ import annotations

from functools import partial

import pandas as pd
import pytest

from simulator.event_process import ProcessEventSink
from simulator.config import SimConfig
from simulator.loop import simulate
from simulator.sinks import open_event_sink
from traces import SyntheticConfig, generate_trace


def _table_bytes(path):
    from pagelab.parquet_parts import part_files

    return [p.read_bytes() for p in part_files(path)]


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_the_child_writes_the_memory_and_request_tables_this_process_would(tmp_path, fmt):
    """A long run's events process hosts the other two tables (`open_run_sinks`): the same files, the same
    summary, and the sinks report their rows and paths as local ones do."""
    from simulator.hosted_tables import HOSTED_CHUNK_ROWS, HostedTable, open_run_sinks
    from simulator.sinks import TABLE_BATCH_ROWS

    trace = generate_trace(SyntheticConfig(num_requests=2 * TABLE_BATCH_ROWS + 500, rate=40.0,
                                           lengths="sharegpt", seed=5))
    cfg = SimConfig()
    runs = {}
    for label, min_requests in (("here", len(trace) + 1), ("child", len(trace))):
        folder = tmp_path / label
        folder.mkdir()
        sinks = open_run_sinks(folder, fmt, len(trace), True, min_requests=min_requests)
        hosted = label == "child"
        assert all(isinstance(sinks[t], HostedTable) == hosted for t in ("memory", "requests"))
        if not hosted:  # the request log sees its half batch a chunk at a time: the memory batches then
            sinks["requests"].chunk_rows = HOSTED_CHUNK_ROWS  # end at the same steps (the same row groups)
        runs[label] = (folder, sinks, simulate(trace, cfg, **sinks))
    (here, here_sinks, a), (child, child_sinks, b) = runs["here"], runs["child"]
    for table in ("memory", "requests", "events"):
        name = f"{table}.{fmt}"
        assert child_sinks[table].path == child / name
        assert child_sinks[table].num_rows == here_sinks[table].num_rows > 0
        assert _table_bytes(child / name) == _table_bytes(here / name)
    assert child_sinks["requests"].num_rows == len(trace)
    assert sorted(p.name for p in child.iterdir()) == sorted(p.name for p in here.iterdir())  # no spools left
    assert {k: v for k, v in a.summary.items() if k != "wall_s"} == \
        {k: v for k, v in b.summary.items() if k != "wall_s"}
    assert b.requests is None and b.request_columns.column("ttft_s").tolist() == \
        a.request_columns.column("ttft_s").tolist()


def test_a_hosted_request_log_hands_rows_on_in_order_in_its_batches(tmp_path):
    from pagelab.parquet_parts import PartedFile, part_files
    from simulator.hosted_tables import HostedTable, host
    from simulator.request_log import REQUEST_DTYPES, RequestLog
    from simulator.sinks import open_table_sink

    events = ProcessEventSink(partial(open_event_sink, tmp_path / "events", "parquet"))
    table = host(events, partial(open_table_sink, tmp_path / "requests", REQUEST_DTYPES, group_rows=0,
                              part_groups=2), 7, tmp_path / ".requests")
    logs = [RequestLog(batch_rows=7, chunk_rows=2), RequestLog(table, batch_rows=7, chunk_rows=2)]
    order = [i ^ 1 for i in range(40)]  # rows finish out of order: 1, 0, 3, 2, ...
    for log in logs:
        for i in range(40):
            log.open(i, (100 + i, float(i), 5, 3, 1, 1))
            log.admitted[i], log.first_token[i] = i + 0.5, 40.0 + i
        for k, i in enumerate(order):
            log.finish[i] = 50.0 + k
            log.close(i)
        log.finish_run()
    events.close()
    assert isinstance(logs[1].sink, HostedTable) and logs[1].sink.num_rows == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.parquet", "requests.parquet"]
    written = pd.read_parquet(table.path)
    pd.testing.assert_frame_equal(written, logs[0].sink.frame(), check_exact=True)
    assert vars(logs[1].totals) == vars(logs[0].totals)
    assert logs[1].totals.num_finished == 40 and logs[1].totals.output_tokens == 120
    # Each batch of at least 7 rows (the last may be short) is a row group, two row groups a part.
    with PartedFile(table.path) as f:
        groups = [f.metadata.row_group(i).num_rows for i in range(f.metadata.num_row_groups)]
    assert sum(groups) == 40 and min(groups[:-1]) >= 7 and len(groups) >= 5
    assert len(part_files(table.path)) == (len(groups) + 1) // 2


def test_an_error_writing_a_hosted_table_is_raised_in_the_run(tmp_path):
    from simulator.hosted_tables import host
    from simulator.request_log import REQUEST_DTYPES
    from simulator.sinks import open_table_sink

    sink = ProcessEventSink(partial(open_event_sink, tmp_path / "events", "parquet"))
    requests = host(sink, partial(open_table_sink, tmp_path / "missing" / "requests", REQUEST_DTYPES), 50,
                         tmp_path / ".requests")
    trace = generate_trace(SyntheticConfig(num_requests=60, rate=40.0, lengths="sharegpt", seed=3))
    with pytest.raises(FileNotFoundError):
        simulate(trace, SimConfig(capacity_tokens=6000), events=sink, requests=requests)
    assert sink._proc.returncode is not None  # no child left behind
    assert not list(tmp_path.glob(".requests*"))  # nor the rows it did not get to
    with pytest.raises(TypeError, match="packed rows"):
        requests.write({})
    with pytest.raises(RuntimeError, match="one log"):
        requests.open_batches(None)


def test_an_aborted_run_leaves_no_spool_file(tmp_path):
    from simulator.hosted_tables import host
    from simulator.request_log import REQUEST_DTYPES, RequestBatches
    from simulator.sinks import open_table_sink

    sink = ProcessEventSink(partial(open_event_sink, tmp_path / "events", "parquet"))
    table = host(sink, partial(open_table_sink, tmp_path / "requests", REQUEST_DTYPES), 50,
                      tmp_path / ".requests")
    batches = table.open_batches(RequestBatches)
    batches.add_chunk(bytes(RequestBatches.row_bytes * 3))  # a batch in progress: its rows wait in the spool
    assert [p.name for p in tmp_path.glob(".requests*")] == [".requests.0.rows"]
    sink.abort()
    assert not list(tmp_path.glob(".requests*"))


def test_batch_and_part_file_names_are_not_interned(tmp_path, monkeypatch):
    """pathlib interns every new part of a path, and each new interned string takes a slot of the
    interpreter's interned table until it grows: a 10M run's spool file names doubled it (+0.9 MiB)."""
    import sys

    import numpy as np
    import pyarrow as pa

    from pagelab.parquet_parts import part_files
    from simulator.hosted_tables import open_run_sinks
    from simulator.sinks import TABLE_BATCH_ROWS, ParquetSink

    interned = []
    real = sys.intern
    monkeypatch.setattr(sys, "intern", lambda s: interned.append(s) or real(s))
    trace = generate_trace(SyntheticConfig(num_requests=TABLE_BATCH_ROWS + 500, rate=40.0,
                                           lengths="sharegpt", seed=6))
    sinks = open_run_sinks(tmp_path, "parquet", len(trace), True, min_requests=len(trace))
    assert simulate(trace, SimConfig(), **sinks).summary["num_requests"] == len(trace)
    sink = ParquetSink(tmp_path / "parts.parquet", pa.schema([("x", pa.int64())]), batch_rows=4,
                       part_groups=1)
    for k in range(5):
        sink.write({"x": np.arange(4) + 4 * k})
    assert [s for s in interned if s.endswith(".rows") or s.startswith("part-")] == []
    sink.close()
    assert len(part_files(tmp_path / "parts.parquet")) == 5

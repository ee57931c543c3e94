"""Streamed tenures (Parquet / CSV sinks, flushed in batches) read back equal to the in-memory table."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from pagelab.parquet_parts import PART_GROUPS, PartedFile, part_files
from simulator.config import SimConfig
from simulator.loop import simulate
from simulator.sinks import EVENT_DTYPES, FrameSink, open_event_sink
from traces import SyntheticConfig, generate_trace, load_trace


def _trace(num: int = 150) -> pd.DataFrame:
    return generate_trace(SyntheticConfig(num_requests=num, rate=40.0, lengths="sharegpt", seed=3))


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
@pytest.mark.parametrize("batch_rows", [37, 1 << 20])
def test_streamed_events_read_back_equal_to_the_in_memory_frame(tmp_path, fmt, batch_rows):
    trace = _trace()
    cfg = SimConfig(capacity_tokens=6000)  # small pool: preemptions, many short tenures
    mem = simulate(trace, cfg)
    sink = open_event_sink(tmp_path / "events", fmt, batch_rows=batch_rows, group_rows=0)
    streamed = simulate(trace, cfg, events=sink)
    assert streamed.events is None and streamed.num_events == len(mem.events) > 1000
    path = tmp_path / f"events.{fmt}"
    back = pd.read_parquet(path) if fmt == "parquet" else pd.read_csv(path).astype(EVENT_DTYPES)
    pd.testing.assert_frame_equal(back, mem.events)
    pd.testing.assert_frame_equal(streamed.requests, mem.requests)
    # The documented order: release time, then acquisition (t_start_s never decreases among equal ends).
    t_end = back["t_end_s"].to_numpy()
    assert (np.diff(t_end) >= 0).all()
    if fmt == "parquet" and batch_rows == 37:
        num_groups = PartedFile(path).metadata.num_row_groups
        assert num_groups > 10  # written as the run went
        # More row groups than one part holds: a directory of parts, each but the last one full.
        assert path.is_dir() == (num_groups > PART_GROUPS)
        assert [pq.ParquetFile(p).metadata.num_row_groups for p in part_files(path)][:-1] == \
            [PART_GROUPS] * (len(part_files(path)) - 1)


@pytest.mark.parametrize("group_rows", [300, 7])
def test_event_batches_fill_row_groups_of_exactly_group_rows(tmp_path, group_rows):
    # Batches cross group boundaries (37 pairing rows a batch at least; 7 splits every batch): each group
    # is written from the buffer before it is refilled, so every row must come back where it was.
    trace = _trace()
    cfg = SimConfig(capacity_tokens=6000)
    mem = simulate(trace, cfg)
    sink = open_event_sink(tmp_path / "events", batch_rows=37, group_rows=group_rows)
    streamed = simulate(trace, cfg, events=sink)
    assert streamed.num_events == len(mem.events) > 1000
    meta = PartedFile(tmp_path / "events.parquet").metadata
    sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    assert sum(sizes) == len(mem.events) and len(sizes) > 2
    assert set(sizes[:-1]) == {group_rows} and 0 < sizes[-1] <= group_rows
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "events.parquet"), mem.events)


def test_gathered_row_groups_hold_at_least_group_rows(tmp_path):
    # Without exact groups (the memory and request tables' way), batches are gathered by reference.
    from simulator.sinks import EVENT_SCHEMA, ParquetSink

    rng = np.random.default_rng(0)
    sink = ParquetSink(tmp_path / "t.parquet", EVENT_SCHEMA, group_rows=100)
    batches = [{c: rng.integers(0, 50, n).astype(t) for c, t in EVENT_DTYPES.items()}
               for n in rng.integers(1, 60, 20)]
    for batch in batches:
        sink.write(batch)
    sink.close()
    meta = pq.ParquetFile(tmp_path / "t.parquet").metadata
    sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    assert sum(sizes) == sum(len(b["start"]) for b in batches) and len(sizes) > 2
    assert min(sizes[:-1]) >= 100 and max(sizes) < 100 + 60
    want = pd.DataFrame({c: np.concatenate([b[c] for b in batches]) for c in EVENT_DTYPES})
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "t.parquet"), want)


def test_events_keep_dictionaries_only_on_the_integer_columns_with_few_values(tmp_path):
    # Dictionaries on times cost more bytes than they save and most of a row group's write memory.
    trace = _trace()
    cfg = SimConfig(capacity_tokens=6000)
    simulate(trace, cfg, events=open_event_sink(tmp_path / "events", group_rows=0))
    meta = pq.ParquetFile(tmp_path / "events.parquet").metadata
    group = meta.row_group(0)
    with_dictionary = {group.column(i).path_in_schema for i in range(group.num_columns)
                       if group.column(i).has_dictionary_page}
    assert with_dictionary == {"start", "size", "max_ref_count", "filled"}
    assert all(group.column(i).compression == "ZSTD" for i in range(group.num_columns))


def test_batch_size_does_not_change_the_table_with_prefix_sharing():
    trace = load_trace("mooncake-conv").iloc[:40].reset_index(drop=True)
    cfg = SimConfig(capacity_tokens=200_000, max_model_len=131072, enable_chunked_prefill=True,
                    max_num_batched_tokens=2048)
    whole = simulate(trace, cfg)
    small = simulate(trace, cfg, events=FrameSink(batch_rows=5))
    assert (whole.events["max_ref_count"] > 1).any()  # shared prefix blocks are in there
    pd.testing.assert_frame_equal(small.events, whole.events)


def test_empty_run_writes_a_readable_empty_table(tmp_path):
    trace = _trace(5)
    sink = open_event_sink(tmp_path / "events")
    res = simulate(trace, SimConfig(allocator="contiguous-max", record_events=False), events=sink)
    assert res.num_events == 0
    back = pd.read_parquet(tmp_path / "events.parquet")
    assert len(back) == 0 and dict(back.dtypes) == EVENT_DTYPES


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_streamed_memory_rows_read_back_equal_and_summarize_alike(tmp_path, fmt):
    from simulator.memory_log import MEMORY_DTYPES
    from simulator.sinks import open_table_sink
    trace = _trace(120)
    cfg = SimConfig(capacity_tokens=6000, record_events=False)
    mem = simulate(trace, cfg)
    sink = open_table_sink(tmp_path / "memory", MEMORY_DTYPES, fmt, batch_rows=50)
    streamed = simulate(trace, cfg, memory=sink)
    assert streamed.memory is None and sink.num_rows == len(mem.memory) > 500
    path = tmp_path / f"memory.{fmt}"
    back = pd.read_parquet(path) if fmt == "parquet" else pd.read_csv(path).astype(MEMORY_DTYPES)
    pd.testing.assert_frame_equal(back, mem.memory, check_exact=fmt == "parquet")
    a, b = mem.summary, streamed.summary
    for key in ("token_occupancy", "block_occupancy"):
        assert b[key] == pytest.approx(a[key], rel=1e-12)
    assert b["memory"] == pytest.approx(a["memory"], rel=1e-12)
    assert {k: v for k, v in b.items() if k not in ("memory", "token_occupancy", "block_occupancy",
                                                   "wall_s")} == \
        {k: v for k, v in a.items() if k not in ("memory", "token_occupancy", "block_occupancy", "wall_s")}


def test_a_run_folders_tables_start_a_part_every_table_part_groups_row_groups(tmp_path):
    from simulator.memory_log import MEMORY_DTYPES
    from simulator.sinks import TABLE_PART_GROUPS, open_table_sink

    # Fewer groups a part than the events table's: the writer's footer entries of the memory and request
    # tables sit in the loop's heap (simulator/sinks.py).
    assert TABLE_PART_GROUPS < PART_GROUPS
    sink = open_table_sink(tmp_path / "memory", MEMORY_DTYPES, batch_rows=10, group_rows=0)
    rows = 10 * (TABLE_PART_GROUPS + 1)
    for start in range(0, rows, 10):
        sink.write({c: np.arange(start, start + 10).astype(t) for c, t in MEMORY_DTYPES.items()})
    sink.close()
    path = tmp_path / "memory.parquet"
    assert [pq.ParquetFile(p).metadata.num_row_groups for p in part_files(path)] == [TABLE_PART_GROUPS, 1]
    assert pd.read_parquet(path)["t_s"].tolist() == list(range(rows))


class _Logged(FrameSink):
    """A FrameSink that notes (name, rows) of each write in a shared list."""

    def __init__(self, name: str, log: list, **kwargs) -> None:
        super().__init__(**kwargs)
        self.name, self.log = name, log

    def write(self, columns) -> None:
        self.log.append((self.name, len(next(iter(columns.values())))))
        super().write(columns)


@pytest.mark.parametrize("memory_rows", [1 << 17, 5000])  # uncapped, capped
def test_the_memory_log_hands_its_rows_on_halfway_through_every_request_batch(memory_rows):
    """One memory batch between two request batches, handed on when the request log holds half of its
    batch (the logs' buffers keep one phase, half a batch apart); a memory batch never exceeds its sink's
    size; the tables are those of a run kept in memory."""
    from simulator.memory_log import MEMORY_DTYPES
    from simulator.request_log import REQUEST_DTYPES
    from simulator.sinks import TABLE_BATCH_ROWS

    num = 2 * TABLE_BATCH_ROWS + 2000
    trace = generate_trace(SyntheticConfig(num_requests=num, rate=20.0, lengths="alpaca", seed=3))
    cfg = SimConfig(record_events=False)
    whole = simulate(trace, cfg)
    log: list = []
    memory = _Logged("memory", log, batch_rows=memory_rows, dtypes=MEMORY_DTYPES)
    requests = _Logged("requests", log, dtypes=REQUEST_DTYPES)
    streamed = simulate(trace, cfg, memory=memory, requests=requests)
    pd.testing.assert_frame_equal(memory.frame(), whole.memory, check_exact=True)
    pd.testing.assert_frame_equal(streamed.requests, whole.requests, check_exact=True)
    batches = [n for name, n in log if name == "requests"]
    assert len(batches) == 3 and min(batches[:2]) >= TABLE_BATCH_ROWS and sum(batches) == num
    sizes = [n for name, n in log if name == "memory"]
    assert max(sizes) <= memory_rows and sum(sizes) == len(whole.memory) > num
    if memory_rows == 5000:  # capped between request batches too
        assert sizes.count(5000) >= TABLE_BATCH_ROWS // 5000
        return
    # Uncapped: memory, requests, memory, requests, then the last rows of each. Rows are handed on in
    # trace order, so the request log holds half a batch once the batch's first half has finished (and
    # the few hundred rows waiting behind them): a memory batch ends at a step near that time.
    assert [name for name, _ in log][:4] == ["memory", "requests", "memory", "requests"]
    finished = np.fmax.accumulate(whole.requests["finish_s"].to_numpy())  # NaN: rejected
    ends = np.cumsum(sizes) - 1
    half = TABLE_BATCH_ROWS // 2
    for k, start in enumerate((0, batches[0])):
        t_mid = whole.memory["t_s"].iloc[ends[k]]
        assert finished[start + half - 500] <= t_mid <= finished[start + half + 2000], (k, t_mid)

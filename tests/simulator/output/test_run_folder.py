"""A run folder's tables, written as the run goes, read back equal to the tables kept in memory."""
from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from pagelab.parquet_parts import PartedFile, part_files
from pagelab.table_sinks import FrameSink
from simulator.config import SimConfig
from simulator.loop import simulate
from simulator.output import InMemory, RunFolder, Sizes
from simulator.output.memory_rows import MEMORY_DTYPES
from simulator.output.request_rows import REQUEST_DTYPES
from simulator.output.tenures import EVENT_DTYPES
from traces import SyntheticConfig, generate_trace, load_trace

SMALL = Sizes(tenure_batch=37, event_group_rows=300, event_part_groups=4)


def _trace(num: int = 150) -> pd.DataFrame:
    return generate_trace(SyntheticConfig(num_requests=num, rate=40.0, lengths="sharegpt", seed=3))


def _read(path, dtypes) -> pd.DataFrame:
    return pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path).astype(dtypes)


def _folder(tmp_path, trace, cfg, fmt="parquet", sizes=SMALL):
    output = RunFolder(tmp_path, fmt, num_requests=len(trace), record_events=cfg.record_events, sizes=sizes)
    return simulate(trace, cfg, output)


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_a_run_folders_tables_read_back_equal_to_the_in_memory_ones(tmp_path, fmt):
    trace = _trace()
    cfg = SimConfig(capacity_tokens=6000)  # small pool: preemptions, many short tenures
    mem = simulate(trace, cfg)
    streamed = _folder(tmp_path, trace, cfg, fmt)
    assert streamed.events is None and streamed.memory is None and streamed.requests is None
    assert streamed.num_events == len(mem.events) > 1000
    events = _read(tmp_path / f"events.{fmt}", EVENT_DTYPES)
    pd.testing.assert_frame_equal(events, mem.events)
    exact = fmt == "parquet"  # CSV prints floats to 17 digits at most
    pd.testing.assert_frame_equal(_read(tmp_path / f"memory.{fmt}", MEMORY_DTYPES), mem.memory,
                                  check_exact=exact)
    pd.testing.assert_frame_equal(_read(tmp_path / f"requests.{fmt}", REQUEST_DTYPES), mem.requests,
                                  check_exact=exact)
    # The documented order: release time, then acquisition.
    assert (np.diff(events["t_end_s"].to_numpy()) >= 0).all()
    a, b = mem.summary, streamed.summary
    assert b["memory"] == pytest.approx(a["memory"], rel=1e-12)
    same = ("num_steps", "num_finished", "num_preemptions", "ttft_s", "allocator_stats", "sim_duration_s")
    assert {k: b[k] for k in same} == {k: a[k] for k in same}


def test_event_row_groups_hold_exactly_their_rows_and_parts_hold_their_groups(tmp_path):
    trace = _trace()
    cfg = SimConfig(capacity_tokens=6000)
    mem = simulate(trace, cfg)
    _folder(tmp_path, trace, cfg, sizes=dataclasses.replace(SMALL, event_group_rows=7))
    path = tmp_path / "events.parquet"
    meta = PartedFile(path).metadata
    sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    assert sum(sizes) == len(mem.events) and set(sizes[:-1]) == {7} and 0 < sizes[-1] <= 7
    assert path.is_dir()  # more row groups than one part holds
    assert [pq.ParquetFile(p).metadata.num_row_groups for p in part_files(path)][:-1] == \
        [SMALL.event_part_groups] * (len(part_files(path)) - 1)
    pd.testing.assert_frame_equal(pd.read_parquet(path), mem.events)


def test_events_keep_dictionaries_only_on_the_integer_columns_with_few_values(tmp_path):
    # Dictionaries on times cost more bytes than they save.
    _folder(tmp_path, _trace(), SimConfig(capacity_tokens=6000), sizes=Sizes())
    group = pq.ParquetFile(tmp_path / "events.parquet").metadata.row_group(0)
    with_dictionary = {group.column(i).path_in_schema for i in range(group.num_columns)
                       if group.column(i).has_dictionary_page}
    assert with_dictionary == {"start", "size", "max_ref_count", "filled", "prefix_key"}
    assert all(group.column(i).compression == "ZSTD" for i in range(group.num_columns))


def test_the_tenure_batch_does_not_change_the_table_with_prefix_sharing():
    trace = load_trace("mooncake-conv").iloc[:40].reset_index(drop=True)
    cfg = SimConfig(capacity_tokens=200_000, max_model_len=131072, enable_chunked_prefill=True,
                    max_num_batched_tokens=2048)
    whole = simulate(trace, cfg)
    small = simulate(trace, cfg, InMemory(Sizes(tenure_batch=5)))
    assert (whole.events["max_ref_count"] > 1).any()  # shared prefix blocks are in there
    pd.testing.assert_frame_equal(small.events, whole.events)


def test_a_run_without_events_writes_no_events_table_and_empty_tables_are_readable(tmp_path):
    res = _folder(tmp_path, _trace(5), SimConfig(allocator="contiguous-max", record_events=False))
    assert res.num_events == 0 and not list(tmp_path.glob("events.*"))
    (tmp_path / "empty").mkdir()
    kept = RunFolder(tmp_path / "empty").close()
    back = pd.read_parquet(tmp_path / "empty" / "events.parquet")
    assert kept.num_events == 0 and len(back) == 0 and dict(back.dtypes) == EVENT_DTYPES
    assert len(pd.read_parquet(tmp_path / "empty" / "requests.parquet")) == 0


def test_memory_and_request_tables_start_a_part_every_table_part_groups_row_groups(tmp_path):
    trace = generate_trace(SyntheticConfig(num_requests=700, rate=40.0, lengths="alpaca", seed=2))
    sizes = Sizes(request_group_rows=32, memory_group_rows=40, memory_min_group_rows=8, table_part_groups=3)
    res = _folder(tmp_path, trace, SimConfig(record_events=False), sizes=sizes)
    for table, dtypes in (("requests", REQUEST_DTYPES), ("memory", MEMORY_DTYPES)):
        path = tmp_path / f"{table}.parquet"
        groups = [pq.ParquetFile(p).metadata.num_row_groups for p in part_files(path)]
        assert path.is_dir() and groups[:-1] == [3] * (len(groups) - 1), table
        with PartedFile(path) as f:
            rows = [f.metadata.row_group(i).num_rows for i in range(f.metadata.num_row_groups)]
        if table == "requests":  # exactly: the statistics read one row group at a time
            assert set(rows[:-1]) == {32}
        else:
            assert max(rows) < 40 + 8 and min(rows[:-1]) >= 8  # a short group waits for the next
        assert dict(pd.read_parquet(path).dtypes) == dtypes
    assert len(pd.read_parquet(tmp_path / "requests.parquet")) == res.summary["num_requests"] == 700


class _Logged(FrameSink):
    """A FrameSink that notes (name, rows) of each write in a shared list."""

    def __init__(self, name: str, log: list, dtypes) -> None:
        super().__init__(dtypes)
        self.name, self.log = name, log

    def write(self, columns) -> None:
        self.log.append((self.name, len(next(iter(columns.values())))))
        super().write(columns)


class _LoggedFolder(RunFolder):
    """A run folder whose memory and request tables are logged frames (the writers a file would get)."""

    def __init__(self, tmp_path, log: list, sizes: Sizes) -> None:
        super().__init__(tmp_path, record_events=False, sizes=sizes)
        self.log = log

    def _open_memory(self, hybrid=False):
        from simulator.output.memory_rows import MemoryRows, MemoryTable

        self.memory_sink = _Logged("memory", self.log, MEMORY_DTYPES)
        return MemoryRows(MemoryTable(self.memory_sink), self.sizes.batch_rows, self.sizes.memory_group_rows)

    def _open_requests(self):
        from simulator.output.request_rows import RequestRows, RequestTable

        self.request_sink = _Logged("requests", self.log, REQUEST_DTYPES)
        sizes = self.sizes
        return RequestRows(RequestTable(self.request_sink), sizes.batch_rows, sizes.request_group_rows)

    def close(self):
        kept = super().close()
        kept.requests.frame = self.request_sink.frame()  # the statistics read it there
        return kept


@pytest.mark.parametrize("memory_rows", [1 << 17, 5000])  # uncapped, capped
def test_the_memory_table_ends_a_row_group_halfway_through_every_request_row_group(tmp_path, memory_rows):
    """One memory row group between two request row groups, ended when the request table holds half of
    its group (the two buffers keep one phase); a memory row group never exceeds its size."""
    group = Sizes().request_group_rows
    num = 2 * group + 2000
    trace = generate_trace(SyntheticConfig(num_requests=num, rate=20.0, lengths="alpaca", seed=3))
    cfg = SimConfig(record_events=False)
    whole = simulate(trace, cfg)
    log: list = []
    output = _LoggedFolder(tmp_path, log, Sizes(memory_group_rows=memory_rows))
    streamed = simulate(trace, cfg, output)
    pd.testing.assert_frame_equal(output.memory_sink.frame(), whole.memory, check_exact=True)
    pd.testing.assert_frame_equal(output.request_sink.frame(), whole.requests, check_exact=True)
    assert streamed.request_columns.column("ttft_s").tolist() == whole.requests["ttft_s"].tolist()
    batches = [n for name, n in log if name == "requests"]
    assert len(batches) == 3 and min(batches[:2]) >= group and sum(batches) == num
    sizes = [n for name, n in log if name == "memory"]
    assert max(sizes) <= memory_rows and sum(sizes) == len(whole.memory) > num
    if memory_rows == 5000:  # capped between request row groups too
        assert sizes.count(5000) >= group // 5000
        return
    # Uncapped: memory, requests, memory, requests, then the last rows of each. Rows are handed on in
    # trace order, so the request table holds half a group once the group's first half has finished (and
    # the few hundred rows waiting behind them): a memory row group ends at a step near that time.
    assert [name for name, _ in log][:4] == ["memory", "requests", "memory", "requests"]
    finished = np.fmax.accumulate(whole.requests["finish_s"].to_numpy())  # NaN: rejected
    ends = np.cumsum(sizes) - 1
    half = group // 2
    for k, start in enumerate((0, batches[0])):
        t_mid = whole.memory["t_s"].iloc[ends[k]]
        assert finished[start + half - 500] <= t_mid <= finished[start + half + 2000], (k, t_mid)

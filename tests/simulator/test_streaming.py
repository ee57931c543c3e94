"""A run that reads its trace in batches and streams its request rows makes the in-memory run's tables.

The waiting queue builds requests only when they reach its head (simulator/loop/state.py), the request
rows keep only requests in flight (simulator/output/request_rows.py), and the trace is read a batch at a
time (traces/batches.py): none of that may change a decision, a time or a row.
"""
from __future__ import annotations

import json
from collections import deque

import numpy as np
import pandas as pd
import pytest
from fresh_process import run_script
from hypothesis import given, settings
from hypothesis import strategies as st

from pagelab.table_sinks import FrameSink
from simulator.config import SimConfig
from simulator.core.sequence import Sequence, SequenceGroup
from simulator.loop import simulate
from simulator.loop.state import WaitingQueue
from simulator.output import RunFolder, Sizes
from simulator.output.request_rows import REQUEST_DTYPES, RequestColumns, RequestRows, RequestTable
from traces import SyntheticConfig, generate_trace, save_trace
from traces.batches import FrameBatches, open_parquet_batches


def _group(i: int) -> SequenceGroup:
    return SequenceGroup(i, [Sequence(i, 4, 8, request_id=i)])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["arrive", "pop", "push_front", "head", "len"]), max_size=60))
def test_waiting_queue_behaves_as_a_deque_of_every_arrived_row(ops):
    built: list[int] = []
    queue = WaitingQueue(lambda i: built.append(i) or _group(i))
    model: deque[int] = deque()
    arrived, pushed = 0, 0
    for op in ops:
        if op == "arrive":
            arrived += 3
            queue.arrive(arrived)
            model.extend(range(arrived - 3, arrived))
        elif op == "pop" and model:
            assert queue.popleft().request_id == model.popleft()
        elif op == "push_front":
            pushed += 1
            g = _group(-pushed)  # a preempted group goes back to the front
            queue.appendleft(g)
            model.appendleft(g.request_id)
        elif op == "head" and model:
            assert queue[0].request_id == model[0]
        assert queue.num_waiting == len(model)
        assert bool(queue) == bool(model)  # the deque's own truth: the head is built whenever one waits
        assert len(queue) <= len(model)  # the groups built so far
    assert built == sorted(built) and len(set(built)) == len(built)  # each row built once, in order
    assert [g.request_id for g in queue] == list(model)


def test_waiting_queue_refuses_a_tail_append_behind_pending_rows():
    queue = WaitingQueue(_group)
    queue.arrive(2)
    with pytest.raises(RuntimeError, match="pending"):
        queue.append(_group(9))
    with pytest.raises(IndexError):
        queue[1]


@settings(max_examples=100, deadline=None)
@given(st.permutations(list(range(40))), st.integers(1, 7), st.integers(1, 4))
def test_request_rows_leave_in_trace_order_whatever_order_they_finish(order, group, batch):
    sink = FrameSink(REQUEST_DTYPES)
    log = RequestRows(RequestTable(sink), batch_rows=batch, group_rows=group)
    midways = []  # (rows handed on before, rows packed) at each call
    log.midway = lambda: midways.append((sink.num_rows, log.next_row - sink.num_rows))
    for i in range(40):
        log.open(i, (100 + i, float(i), 5, 3, 1, 1))
        log.admitted[i] = i + 0.5
    for k, i in enumerate(order):
        log.finish[i] = 50.0 + k
        log.first_token[i] = 40.0 + i
        log.close(i)
        assert log.next_row == min(set(range(40)) - set(order[:k + 1]), default=40)
    log.end()
    sizes = [len(b["finish_s"]) for b in sink._batches]
    assert sum(sizes) == 40 and all(n == group for n in sizes[:-1])  # row groups of exactly `group` rows
    # `midway` once a row group, when it holds half of it (the last group may end sooner).
    assert len(sizes) - 1 <= len(midways) <= len(sizes)
    assert [before for before, _ in midways] == np.cumsum([0, *sizes])[:len(midways)].tolist()
    assert all(held >= group // 2 for _, held in midways)
    table = sink.frame()
    assert table["request_id"].tolist() == list(range(100, 140))
    assert table["finish_s"].tolist() == [50.0 + order.index(i) for i in range(40)]
    assert list(table.dtypes) == list(REQUEST_DTYPES.values())
    assert log.totals.num_finished == 40 and log.totals.output_tokens == 120


def test_request_row_groups_are_the_row_groups_of_the_run_folders_table(tmp_path):
    # Each row group the rows hand on is written as one Parquet row group (nothing gathered in memory
    # between writes); the file holds the rows, and the totals, that the in-memory table does.
    import pyarrow.parquet as pq

    group = Sizes().request_group_rows
    num = 2 * group + 1000
    kept = []
    for output in (None, RunFolder(tmp_path, record_events=False)):
        log = output.request_rows() if output is not None else \
            RequestRows(RequestTable(FrameSink(REQUEST_DTYPES)), Sizes().batch_rows, group)
        for i in range(num):
            log.open(i, (i, float(i), 7, 2 + i % 5, 1, 1))
            log.admitted[i], log.first_token[i], log.finish[i] = i + 0.5, i + 1.0, i + 2.0 + i % 3
            log.close(i)
        log.end()
        kept.append(log)
    path = tmp_path / "requests.parquet"
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [group] * 2 + [1000]
    pd.testing.assert_frame_equal(pd.read_parquet(path), kept[0].writer.sink.frame(), check_exact=True)
    assert vars(kept[0].totals) == vars(kept[1].totals)


def test_request_rows_refuse_to_end_with_a_request_in_flight():
    log = RequestRows(RequestTable(FrameSink(REQUEST_DTYPES)), 4, 8)
    log.open(0, (0, 0.0, 1, 1, 1, 1))
    with pytest.raises(RuntimeError, match="never finished"):
        log.end()


def _assert_same_run(a, b):
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.memory, b.memory, check_exact=True)
    pd.testing.assert_frame_equal(a.events, b.events, check_exact=True)
    strip = lambda s: json.dumps({k: v for k, v in s.items() if k != "wall_s"}, sort_keys=True)  # noqa: E731
    assert strip(a.summary) == strip(b.summary)


TRACES = {
    "overloaded": dict(num_requests=400, rate=80.0, lengths="sharegpt", seed=3),
    "beams": dict(num_requests=60, rate=4.0, lengths="alpaca", beam_width=3, seed=4),
    "samples": dict(num_requests=120, rate=10.0, lengths="alpaca", n=3, seed=5),
    "prefix": dict(num_requests=200, rate=30.0, lengths="alpaca", num_prefix_groups=3, prefix_len=200,
                   prefix_fraction=0.8, seed=6),
}


@pytest.mark.parametrize("name", TRACES)
@pytest.mark.parametrize("mode", ["fast", "step"])
def test_batches_of_rows_make_the_same_run_as_the_whole_frame(name, mode):
    trace = generate_trace(SyntheticConfig(**TRACES[name]))
    cfg = SimConfig(capacity_tokens=3000, mode=mode, record_events=True,
                    preemption_mode="swap" if name == "samples" else "recompute")
    whole = simulate(trace, cfg)
    assert whole.summary["num_preemptions"] > 0 or name != "overloaded"
    _assert_same_run(simulate(FrameBatches(trace, max_rows=7), cfg), whole)


def test_a_canonical_parquet_trace_is_read_in_batches_and_streams_the_same_rows(tmp_path):
    trace = generate_trace(SyntheticConfig(**TRACES["overloaded"]))
    path = tmp_path / "t.parquet"
    save_trace(trace, path)
    batches = open_parquet_batches(path)
    assert batches is not None and batches.num_rows == len(trace)
    cfg = SimConfig(capacity_tokens=3000, record_events=True)
    whole = simulate(trace, cfg)
    for fmt in ("parquet", "csv"):
        (tmp_path / fmt).mkdir()
        streamed = simulate(batches, cfg, RunFolder(tmp_path / fmt, fmt, record_events=False))
        assert streamed.requests is None
        read = pd.read_parquet if fmt == "parquet" else lambda p: pd.read_csv(p, dtype=REQUEST_DTYPES)
        back = read(tmp_path / fmt / f"requests.{fmt}")
        pd.testing.assert_frame_equal(back, whole.requests, check_exact=True)
        assert streamed.summary["e2e_s"] == whole.summary["e2e_s"]
        cols = streamed.request_data()
        assert isinstance(cols, RequestColumns) and len(cols) == len(trace)
        np.testing.assert_array_equal(cols.column("ttft_s"), whole.requests["ttft_s"].to_numpy())
    limited = open_parquet_batches(path, limit=50)
    assert limited.num_rows == 50
    assert len(simulate(limited, cfg).requests) == 50


def _write(tmp_path, frame, name="t.parquet"):
    path = tmp_path / name
    frame.to_parquet(path, index=False)
    return path


def test_only_canonical_parquet_traces_are_read_in_batches(tmp_path):
    trace = generate_trace(SyntheticConfig(num_requests=30, rate=5.0, seed=1))
    assert open_parquet_batches(_write(tmp_path, trace)) is not None
    shifted = trace.assign(arrival_s=trace["arrival_s"] + 1.0)  # the loader would shift it to 0
    unsorted = trace.iloc[::-1].reset_index(drop=True)
    repeated = trace.assign(request_id=0)
    small = trace.astype({"prompt_len": "int32"})
    zero = trace.assign(output_len=0)
    reordered = trace[list(reversed(trace.columns))]
    for bad in (shifted, unsorted, repeated, small, zero, reordered):
        assert open_parquet_batches(_write(tmp_path, bad, "bad.parquet")) is None
    (tmp_path / "junk.parquet").write_text("not parquet")
    assert open_parquet_batches(tmp_path / "junk.parquet") is None


def test_request_columns_of_a_frame_total_what_the_frame_holds():
    trace = generate_trace(SyntheticConfig(num_requests=50, rate=5.0, n=2, seed=2))
    res = simulate(trace, SimConfig(capacity_tokens=4000))
    cols = RequestColumns.of_frame(res.requests)
    finished = int(res.requests["finish_s"].notna().sum())
    assert cols.totals.num_finished == res.summary["num_finished"] == finished
    assert cols.totals.output_tokens == int((res.requests["output_len"] * res.requests["n"]).sum())


def test_statistics_of_a_streamed_request_table_equal_the_frame_s(tmp_path):
    from simulator.metrics import bench_metrics, column_summary, overload_warning

    trace = generate_trace(SyntheticConfig(num_requests=400, rate=9.0, n=2, seed=4))
    frame = simulate(trace, SimConfig(capacity_tokens=6000)).requests
    streamed = simulate(trace, SimConfig(capacity_tokens=6000),
                        RunFolder(tmp_path, record_events=False)).request_columns
    assert streamed.frame is None and streamed.totals.input_tokens > 0
    for _ in range(2):  # the second time from what the first left in the table's memo
        assert [column_summary(streamed, c) for c in ("ttft_s", "tpot_s", "e2e_s")] == \
            [column_summary(frame, c) for c in ("ttft_s", "tpot_s", "e2e_s")]
        for qs in ((99.0,), (50.0, 90.0, 99.9)):
            got = bench_metrics(streamed, 100.0, metrics=("ttft", "tpot", "itl", "e2el"), percentiles=qs)
            assert got == bench_metrics(frame, 100.0, metrics=("ttft", "tpot", "itl", "e2el"), percentiles=qs)
    assert ("moments", "ttft_s") in streamed.memo and ("ranks", "e2e_s") in streamed.memo
    assert streamed.totals.last_arrival_s == float(trace["arrival_s"].max())
    assert overload_warning(streamed, 1e3) == overload_warning(frame, 1e3)


def test_trace_info_of_batches_equals_trace_info_of_the_frame(tmp_path):
    from traces.stats import trace_info

    trace = generate_trace(SyntheticConfig(num_requests=300, rate=7.0, n=2, seed=8))
    path = tmp_path / "t.parquet"
    save_trace(trace, path)
    assert trace_info(open_parquet_batches(path)) == trace_info(trace)
    assert trace_info(FrameBatches(trace, max_rows=11)) == trace_info(trace)


_CURSOR_MEMORY = """
import sys
import cli  # noqa: F401 - the CLI's allocator and Arrow pool settings, before pyarrow is imported
import pyarrow as pa
from pagelab.malloc import map_large_allocations
from simulator.config import SimConfig
from simulator.loop.simulate import start
from simulator.output import InMemory
from traces.batches import open_parquet_batches
map_large_allocations()
batches = open_parquet_batches(sys.argv[1])
run = start(batches, SimConfig(capacity_tokens=4096, record_events=False), InMemory(), True)
run.arrive_until(run.next_arrival)  # the arrival cursor's first batch
run.make_group(0)  # the request cursor's first batch
pools = [pa.system_memory_pool(), pa.mimalloc_memory_pool()]
try:
    pools.append(pa.jemalloc_memory_pool())
except NotImplementedError:  # a pyarrow built without jemalloc
    pass
print(sum(p.bytes_allocated() for p in pools))
"""


def test_a_runs_two_trace_cursors_hold_a_few_megabytes_of_arrows_memory(tmp_path):
    # The cursors hold a read buffer per column, one batch of rows and each column chunk's dictionary page
    # for as long as the run reads the trace. pagelab writes unique request ids and arrival times plain:
    # dictionaries on them would fill 1 MB dictionary pages (Parquet's default) per column chunk.
    path = tmp_path / "t.parquet"
    save_trace(generate_trace(SyntheticConfig(num_requests=300_000, rate=40.0, seed=7)), path)
    assert int(run_script(_CURSOR_MEMORY, path)) < 2 << 20

"""Tenures paired and written in a child process: the same file as in a thread, and failures that surface."""
from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import pandas as pd
import pytest

from simulator.event_process import ProcessEventSink, open_events_sink
from simulator.recorder import EventRecorder
from simulator.config import SimConfig
from simulator.loop import simulate
from simulator.sinks import EVENT_DTYPES, ParquetSink, open_event_sink
from traces import SyntheticConfig, generate_trace, load_trace


def _trace(num: int = 150) -> pd.DataFrame:
    return generate_trace(SyntheticConfig(num_requests=num, rate=40.0, lengths="sharegpt", seed=3))


def _both(tmp_path, trace, cfg, fmt="parquet", batch_rows=37):
    """The events file of a run paired in the recorder's thread, and of the same run paired in a child."""
    thread = simulate(trace, cfg, events=open_event_sink(tmp_path / "thread", fmt, batch_rows=batch_rows))
    sink = ProcessEventSink(partial(open_event_sink, tmp_path / "child", fmt, batch_rows), batch_rows)
    child = simulate(trace, cfg, events=sink)
    return thread, child, sink


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_a_child_writes_the_file_the_thread_writes(tmp_path, fmt):
    thread, child, sink = _both(tmp_path, _trace(), SimConfig(capacity_tokens=6000), fmt)
    assert child.events is None and child.num_events == thread.num_events == sink.num_rows > 1000
    assert sink.path == tmp_path / f"child.{fmt}"
    assert sink.path.read_bytes() == (tmp_path / f"thread.{fmt}").read_bytes()
    pd.testing.assert_frame_equal(child.requests, thread.requests)


def test_shared_prefix_blocks_pair_alike_in_a_child(tmp_path):
    trace = load_trace("mooncake-conv").iloc[:40].reset_index(drop=True)
    cfg = SimConfig(enable_prefix_caching=True, capacity_tokens=40_000)
    thread, child, sink = _both(tmp_path, trace, cfg, batch_rows=5)
    events = pd.read_parquet(sink.path)
    assert (events["max_ref_count"] > 1).any()  # shares went through the child's pairing
    pd.testing.assert_frame_equal(events, pd.read_parquet(tmp_path / "thread.parquet"))


def test_flush_returns_once_the_child_has_written_the_tenures(tmp_path):
    sink = ProcessEventSink(partial(open_event_sink, tmp_path / "events", "csv"))
    rec = EventRecorder(sink)
    rec.acquire_blocks([3, 4], 16, 7)
    rec.now = 1.0
    rec.release_blocks([3, 4], 16, [16, 5])
    rec.now = 2.0
    rec.flush()  # released at 1.0 < 2.0: in the file now (the child's CSV writer has flushed its batch)
    rec.finish(3.0)
    back = pd.read_csv(tmp_path / "events.csv").astype(EVENT_DTYPES)
    assert back[["start", "t_end_s", "filled"]].values.tolist() == [[48, 1.0, 16], [64, 1.0, 5]]


def test_an_error_in_the_child_is_raised_in_the_run(tmp_path):
    sink = ProcessEventSink(partial(open_event_sink, tmp_path / "missing" / "events", "parquet"), 37)
    with pytest.raises(FileNotFoundError):
        simulate(_trace(60), SimConfig(capacity_tokens=6000), events=sink)
    assert sink._proc.returncode is not None  # no child left behind


def test_a_child_that_dies_fails_the_run(tmp_path):
    sink = ProcessEventSink(partial(open_event_sink, tmp_path / "events", "parquet"), 37)
    rec = EventRecorder(sink)
    rec.acquire_blocks(list(range(40)), 16, 1)  # one batch: the child starts
    sink._proc.kill()
    sink._proc.wait()
    with pytest.raises(RuntimeError, match="exited early"):
        for i in range(200):
            rec.release_blocks(list(range(40)), 16, [16] * 40)
            rec.acquire_blocks(list(range(40)), 16, i)
        rec.finish(1.0)


def test_the_child_exits_when_the_parent_end_closes(tmp_path):
    sink = ProcessEventSink(partial(open_event_sink, tmp_path / "events", "parquet"))
    sink.sync()  # not started: nothing to wait for
    rec = EventRecorder(sink, flush_rows=1)
    rec.acquire_blocks([0], 16, 1)
    sink._conn.close()  # what the parent dying does to the socket
    assert sink._proc.wait(timeout=60) == 0


def test_long_runs_pair_in_a_child_short_ones_in_a_thread(tmp_path):
    short = open_events_sink(tmp_path / "short", "parquet", 999, min_requests=1000)
    long = open_events_sink(tmp_path / "long", "parquet", 1000, min_requests=1000)
    assert isinstance(short, ParquetSink) and isinstance(long, ProcessEventSink)
    short.close()
    long.close()  # never fed: the child still writes an empty table with the schema
    assert long.num_rows == 0 and list(pd.read_parquet(long.path).columns) == list(EVENT_DTYPES)


def test_the_parent_end_has_room_for_several_raw_batches(tmp_path):
    # A raw batch (~250 KB pickled) must not wait for the child to read it: the send buffer is raised
    # as far as the system allows (Linux reports twice the size it keeps).
    import socket

    from simulator.event_process import SEND_BUFFER_BYTES

    try:
        limit = int(Path("/proc/sys/net/core/wmem_max").read_text())
    except OSError:
        pytest.skip("no /proc/sys/net/core/wmem_max to compare with")
    sink = ProcessEventSink(partial(open_event_sink, tmp_path / "events", "parquet"))
    sink._start()
    with socket.socket(fileno=os.dup(sink._conn.fileno())) as end:
        assert end.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= min(SEND_BUFFER_BYTES, limit)
    sink.close()
    assert sink.num_rows == 0 and sink.path.exists()


def test_the_child_pairs_and_writes_without_pandas(tmp_path):
    # pyarrow imports pandas at its first pa.array(ndarray) if it may (~45 MB resident); the child refuses
    # it. Its mapped files show what it imported, after it has paired and written a row group.
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/PID/maps to read a process's libraries from")
    assert "/pandas/" in maps.read_text()  # this process has pandas: the check below can see it
    sink = ProcessEventSink(partial(open_event_sink, tmp_path / "events", "parquet", 4, group_rows=4), 4)
    rec = EventRecorder(sink, flush_rows=1)
    rec.acquire_blocks(list(range(8)), 16, 1)
    rec.now = 1.0
    rec.release_blocks(list(range(8)), 16, [16] * 8)
    rec.now = 2.0
    rec.flush()  # paired and written in the child by now
    child_maps = Path(f"/proc/{sink._proc.pid}/maps").read_text()
    rec.finish(3.0)
    assert "/pyarrow/" in child_maps and "/pandas/" not in child_maps
    assert sink.num_rows == 8 and len(pd.read_parquet(sink.path)) == 8


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
    from simulator.event_process import STREAM_BUFFER_BYTES

    sink = ProcessEventSink(partial(open_event_sink, tmp_path / "events", "parquet"))
    sink._start()
    sink._out = writes = _Writes(sink._out)
    rec = EventRecorder(sink, flush_rows=40_000)
    ids = list(range(1000, 41_000))
    rec.acquire_blocks(ids, 16, list(range(40_000)))  # one batch of 40,000 acquisitions, pickled > 400 KB
    rec.now = 1.0
    rec.release_blocks(ids, 16, [7] * len(ids))
    rec.finish(2.0)
    # A frame ends at the first opcode past 64 KiB, a few bytes over.
    assert sum(writes.sizes) > 6 * STREAM_BUFFER_BYTES and max(writes.sizes) <= STREAM_BUFFER_BYTES + 1024
    events = pd.read_parquet(sink.path)
    assert events["request_id"].tolist() == list(range(40_000)) and (events["filled"] == 7).all()


def test_the_child_reports_its_own_peak_memory_when_it_closes(tmp_path):
    sink = ProcessEventSink(partial(open_event_sink, tmp_path / "events", "parquet"))
    assert sink.peak_rss_mib is None
    sink._start()
    sink.close()
    assert 10 < sink.peak_rss_mib < 1024  # an interpreter with numpy and pyarrow, nothing of this process

"""`pagelab bench simulate` measures runs with and without events (streamed to Parquet, as --out does)."""
from __future__ import annotations

from bench.simulate import bench_simulate, summarize_runs


def test_bench_reports_both_event_modes_with_the_events_file_size():
    records = bench_simulate([300], ["paged"], events=(False, True), isolate=False)
    off, on = records
    assert (off["record_events"], on["record_events"]) == (False, True)
    assert off["trace"] == "synthetic(sharegpt, 15 req/s)" and off["num_memory_rows"] > 0
    assert off["num_events"] == 0 and off["events_mb"] == 0.0
    assert on["num_events"] > 300 and on["events_mb"] > 0.0
    assert on["num_steps"] == off["num_steps"]  # recording changes no decision
    rows = summarize_runs(records)
    assert [r["record_events"] for r in rows] == [False, True] and rows[1]["num_events"] == on["num_events"]


def test_bench_streams_a_parquet_trace_as_simulate_out_does(tmp_path):
    from bench.simulate import write_synthetic
    from simulator.config import SimConfig
    from simulator.loop import simulate
    from traces import load_trace

    path = write_synthetic(tmp_path / "t.parquet", 400, rate=40.0, lengths="sharegpt", seed=3)
    (rec,) = bench_simulate([250], ["paged"], trace=str(path), events=(True,), isolate=False)
    whole = simulate(load_trace(path).iloc[:250].reset_index(drop=True), SimConfig())
    assert rec["trace"] == str(path) and rec["num_requests"] == 250
    assert rec["num_steps"] == whole.summary["num_steps"]  # read in blocks, the same run
    assert rec["num_memory_rows"] == len(whole.memory) and rec["num_events"] == len(whole.events)


def test_bench_refuses_more_requests_than_the_trace_has(tmp_path):
    import pytest

    from bench.simulate import write_synthetic
    from simulator.core.errors import ConfigError

    path = write_synthetic(tmp_path / "t.parquet", 50, rate=40.0, lengths="sharegpt", seed=3)
    with pytest.raises(ConfigError, match="has 50 requests, fewer than the 60 asked for"):
        bench_simulate([60], trace=str(path), isolate=False)


def test_an_isolated_runs_peak_is_the_run_processes_not_the_benchmarks():
    # The run's process is started while this one holds 600 MiB more: none of it may count.
    ballast = b"\x01" * (600 << 20)
    (rec,) = bench_simulate([200], ["paged"], events=(True,), isolate=True)
    del ballast
    assert rec["num_events"] > 200 and 0 < rec["peak_rss_mb"] < 600

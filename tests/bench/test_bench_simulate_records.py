"""`pagelab bench simulate` measures runs with and without events (streamed to Parquet, as --out does)."""
from __future__ import annotations

from bench.simulate import bench_simulate, summarize_runs


def test_bench_reports_both_event_modes_with_the_events_file_size():
    records = bench_simulate([300], ["paged"], events=(False, True), isolate=False)
    off, on = records
    assert (off["record_events"], on["record_events"]) == (False, True)
    assert off["num_events"] == 0 and off["events_mb"] == 0.0
    assert on["num_events"] > 300 and on["events_mb"] > 0.0
    assert on["num_steps"] == off["num_steps"]  # recording changes no decision
    rows = summarize_runs(records)
    assert [r["record_events"] for r in rows] == [False, True] and rows[1]["num_events"] == on["num_events"]

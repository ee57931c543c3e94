"""A sweep worker killed by the OS (SIGKILL, as the out-of-memory killer does): the point is retried once,
then marked failed with the cause in the sweep table; the other points finish; a re-run reuses them and
runs the failed point again."""
from __future__ import annotations

import pandas as pd

from simulator.sweep.executors import KILL_POINT_ENV, LocalExecutor, death_cause
from simulator.sweep.points import POINTS_DIR
from simulator.sweep.runner import TRACE_FILE, run_sweep


def _sweep(tmp_path, trace, plan, jobs: int = 2):
    pool = LocalExecutor(jobs, tmp_path / TRACE_FILE)
    try:
        return run_sweep(trace, "small", plan, tmp_path, pool)
    finally:
        pool.close()


def test_a_point_whose_worker_dies_twice_is_marked_failed_and_rerun_later(tmp_path, small_trace, small_plan,
                                                                          monkeypatch):
    plan = small_plan(rate="1,2,3", allocators=("paged",), search=False)
    monkeypatch.setenv(KILL_POINT_ENV, "-r2-")
    result = _sweep(tmp_path, small_trace, plan)
    assert (result.num_run, result.num_failed) == (2, 1)
    points = result.points.set_index("rate")
    assert points.loc[2.0, "error"] == ("its worker process was killed by SIGKILL, as the kernel's "
                                        "out-of-memory killer does (twice: the point was retried once)")
    assert pd.isna(points.loc[2.0, "normalized_latency_s"]) and pd.isna(points.loc[2.0, "folder"])
    assert points.loc[[1.0, 3.0], "error"].isna().all()
    on_disk = pd.read_parquet(tmp_path / "sweep.parquet").set_index("rate")
    assert on_disk.loc[2.0, "error"] == points.loc[2.0, "error"]
    folders = sorted(p.name for p in (tmp_path / POINTS_DIR).iterdir())
    assert len(folders) == 2 and not any(name.startswith(".") for name in folders)  # nothing half-written

    monkeypatch.delenv(KILL_POINT_ENV)
    again = _sweep(tmp_path, small_trace, plan)
    assert (again.num_reused, again.num_run, again.num_failed) == (2, 1, 0)
    assert again.points["error"].isna().all()


def test_a_point_whose_worker_dies_once_finishes_on_its_retry(tmp_path, small_trace, small_plan, monkeypatch):
    plan = small_plan(rate="1,2,3", allocators=("paged",), search=False)
    monkeypatch.setenv(KILL_POINT_ENV, f"-r3-@{tmp_path / 'killed-once'}")
    result = _sweep(tmp_path / "s", small_trace, plan)
    assert (tmp_path / "killed-once").exists()
    assert (result.num_run, result.num_failed) == (3, 0)
    assert result.points["error"].isna().all()


def test_a_configuration_whose_next_search_rate_failed_stops_searching(tmp_path, small_trace, small_plan,
                                                                       monkeypatch):
    plan = small_plan(rate="0.5:40", allocators=("paged",))  # the bounds only: the search needs both
    monkeypatch.setenv(KILL_POINT_ENV, "-r40-")
    result = _sweep(tmp_path, small_trace, plan, jobs=1)
    assert result.num_failed == 1
    assert result.max_rates["status"].tolist() == ["point_failed"]


def test_the_cause_names_the_signal_or_the_exit_code():
    assert death_cause([-15, -9, -15]).startswith("its worker process was killed by SIGKILL")
    assert death_cause([143, -9]).startswith("its worker process was killed by SIGKILL")
    assert death_cause([None, 3]) == "its worker process exited with code 3"
    assert death_cause([-15]) == "its worker process was killed by SIGTERM"
    assert death_cause([]) == "its worker process died"

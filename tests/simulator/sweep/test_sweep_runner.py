"""Whole sweeps on a small trace: executors agree, points are real run folders, re-runs reuse, interrupts
leave no half-written point."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from simulator.sweep.executors import LocalExecutor, SerialExecutor
from simulator.sweep.runner import TRACE_FILE, run_sweep
from traces import rescale_rate
from viz.load import load_runs


def test_serial_sweep_finds_capacity_and_writes_normal_run_folders(tmp_path, small_trace, small_plan):
    plan = small_plan()
    result = run_sweep(small_trace, "small", plan, tmp_path, SerialExecutor(small_trace))
    points, max_rates = result.points, result.max_rates
    assert set(points["kind"]) == {"grid", "search"}
    assert result.num_run == len(points) and result.num_reused == 0
    for _, row in max_rates.iterrows():
        mine = points[points["allocator"] == row["allocator"]]
        assert row["runs"] == len(mine)
        if row["status"] == "found":
            # The reported rate was run and met the SLO; the first miss is within the tolerance above it.
            assert mine.loc[mine["rate"] == row["max_rate"], "met_slo"].item()
            assert not mine.loc[mine["rate"] == row["first_miss_rate"], "met_slo"].item()
            assert row["first_miss_rate"] <= row["max_rate"] * 1.05
    paged = max_rates.set_index("allocator").loc["paged"]
    assert paged["status"] == "found" and paged["paged_advantage"] == 1.0
    # Every point folder is a normal run folder (viz reads it) at the point's rate.
    runs = load_runs([tmp_path / f for f in points["folder"]])
    assert [r.trace["rate_override"] for r in runs] == list(points["rate"])
    first = json.loads((tmp_path / points["folder"][0] / "summary.json").read_text())
    assert first["trace"]["mean_rate_per_s"] == pytest.approx(points["rate"][0])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["slo"] == {"metric": "norm_latency", "bound": 0.2, "text": "norm_latency <= 0.2 s/token",
                              "spec": "norm_latency:0.2s/token"}
    assert len(summary["configurations"]) == len(max_rates)


def test_point_result_equals_a_plain_simulate_run(tmp_path, small_trace, small_plan):
    from simulator.loop import simulate

    plan = small_plan(rate="1.5,2.5", allocators=("paged",), search=False)
    result = run_sweep(small_trace, "small", plan, tmp_path, SerialExecutor(small_trace))
    direct = simulate(rescale_rate(small_trace, 1.5), plan.axes.sim_config({"allocator": "paged"}))
    row = result.points[result.points["rate"] == 1.5].iloc[0]
    assert row["normalized_latency_s"] == direct.summary["normalized_latency_s_per_token"]
    assert row["ttft_p99_s"] == direct.summary["ttft_s"]["p99"]
    # Search off, the bracket between the two rates stays open: a final status, not "searching".
    status = result.max_rates["status"].iloc[0]
    assert status in ("grid", "found", "above_range", "below_range") and status != "searching"


def test_local_pool_gives_the_serial_tables(tmp_path, small_trace, small_plan):
    plan = small_plan(axes={"block_size": (8, 32)})
    serial = run_sweep(small_trace, "small", plan, tmp_path / "a", SerialExecutor(small_trace))
    pool = LocalExecutor(2, tmp_path / "b" / TRACE_FILE)
    try:
        local = run_sweep(small_trace, "small", plan, tmp_path / "b", pool)
    finally:
        pool.close()
    pd.testing.assert_frame_equal(serial.points, local.points)
    pd.testing.assert_frame_equal(serial.max_rates, local.max_rates)
    assert pd.read_parquet(tmp_path / "b" / TRACE_FILE).equals(small_trace)


def test_rerun_reuses_every_point_and_other_settings_do_not(tmp_path, small_trace, small_plan):
    plan = small_plan()
    first = run_sweep(small_trace, "small", plan, tmp_path, SerialExecutor(small_trace))
    again = run_sweep(small_trace, "small", plan, tmp_path, SerialExecutor(small_trace))
    assert again.num_run == 0 and again.num_reused == len(first.points)
    pd.testing.assert_frame_equal(first.points, again.points)
    # A different trace (one request fewer) shares no point with the first sweep.
    other = run_sweep(small_trace.iloc[:-1], "small", plan, tmp_path, SerialExecutor(small_trace.iloc[:-1]))
    assert other.num_reused == 0


def test_rerun_finds_a_point_under_another_name_by_its_hash(tmp_path, small_trace, small_plan):
    plan = small_plan()
    first = run_sweep(small_trace, "small", plan, tmp_path, SerialExecutor(small_trace))
    for folder in (tmp_path / "points").iterdir():
        stem, key = folder.name.rsplit("-", 1)
        folder.rename(folder.with_name(f"{stem}-renamed-{key}"))
    again = run_sweep(small_trace, "small", plan, tmp_path, SerialExecutor(small_trace))
    assert again.num_run == 0 and again.num_reused == len(first.points)
    assert all("-renamed-" in f and (tmp_path / f / "summary.json").is_file() for f in again.points["folder"])


class StopAfter(SerialExecutor):
    """Runs `n` points, then raises as a Ctrl-C would (the pool and Ray see the same exception)."""

    def __init__(self, trace, n):
        super().__init__(trace)
        self.left = n

    def run(self, specs, source, out):
        for item in super().run(specs, source, out):
            yield item
            self.left -= 1
            if self.left == 0:
                raise KeyboardInterrupt


def test_interrupted_sweep_keeps_whole_points_only_and_resumes(tmp_path, small_trace, small_plan):
    plan = small_plan()
    with pytest.raises(KeyboardInterrupt):
        run_sweep(small_trace, "small", plan, tmp_path, StopAfter(small_trace, 3))
    folders = list((tmp_path / "points").iterdir())
    assert len(folders) == 3 and all((f / "summary.json").is_file() for f in folders)
    assert not [p for p in tmp_path.rglob(".*")]  # no temporary folders left
    assert not (tmp_path / "sweep.parquet").exists()
    # A killed (not interrupted) sweep leaves its temporary folder: the next run removes it.
    stale = tmp_path / "points" / ".paged-r0.1-0123456789ab.tmp-xyz"
    stale.mkdir()
    (stale / "config.json").write_text("{")
    resumed = run_sweep(small_trace, "small", plan, tmp_path, SerialExecutor(small_trace))
    assert resumed.num_reused == 3 and not stale.exists()
    fresh = run_sweep(small_trace, "small", plan, tmp_path / "fresh", SerialExecutor(small_trace))
    pd.testing.assert_frame_equal(resumed.points.drop(columns="kind"), fresh.points.drop(columns="kind"))


def test_search_only_range_stays_within_the_run_budget(tmp_path, small_trace, small_plan):
    plan = small_plan(rate="0.1:3", allocators=("paged",))
    result = run_sweep(small_trace, "small", plan, tmp_path, SerialExecutor(small_trace))
    row = result.max_rates.iloc[0]
    assert row["status"] == "found" and row["runs"] <= 12
    assert row["first_miss_rate"] / row["max_rate"] <= 1.05


def test_a_trace_with_prefix_keys_is_swept_and_its_keys_are_in_the_points_identity(tmp_path, small_plan):
    from simulator.loop import simulate
    from simulator.sweep.points import trace_fingerprint
    from traces import SyntheticConfig, generate_trace

    trace = generate_trace(SyntheticConfig(num_requests=60, lengths="sharegpt", seed=1, num_prefix_groups=2,
                                           prefix_len=64, prefix_fraction=0.5))
    plan = small_plan(rate="1.5", allocators=("paged",), search=False)
    result = run_sweep(trace, "keys", plan, tmp_path, SerialExecutor(trace))
    direct = simulate(rescale_rate(trace, 1.5), plan.axes.sim_config({"allocator": "paged"}))
    assert direct.summary["prefix_cache_hit_rate"] > 0  # the keys were used
    assert result.points["ttft_p99_s"].item() == direct.summary["ttft_s"]["p99"]
    other = trace.copy()
    other["prefix_blocks"] = [list(k[::-1]) for k in trace["prefix_blocks"]]
    assert trace_fingerprint(other) != trace_fingerprint(trace) == trace_fingerprint(trace.copy())


def test_a_point_is_new_when_its_profile_or_model_folder_changes(tmp_path):
    import shutil
    from pathlib import Path

    from simulator.config import SimConfig
    from simulator.sweep.points import PointSpec

    profile = tmp_path / "profile.json"
    shutil.copy(Path(__file__).resolve().parents[3] / "simulator/timing/profiles/h200-llama-1b.json", profile)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"num_hidden_layers": 2}')

    def key(**sim):
        return PointSpec((("allocator", "paged"),), 1.0, SimConfig(**sim), "trace").key

    before = key(latency=str(profile)), key(model=str(folder))
    assert key(latency=str(profile)) == before[0]  # the same files: the same point
    fitted = json.loads(profile.read_text())
    profile.write_text(json.dumps({**fitted, "step_overhead_s": 0.5}))  # a refit: same path, new numbers
    (folder / "config.json").write_text('{"num_hidden_layers": 3}')
    assert key(latency=str(profile)) != before[0] and key(model=str(folder)) != before[1]
    assert key() == PointSpec((("allocator", "paged"),), 1.0, SimConfig(), "trace").key  # no files read


def test_no_advantage_is_reported_against_a_search_stopped_by_a_failed_point():
    from simulator.sweep.search import SearchState
    from simulator.sweep.table import max_rate_rows

    configs = [{"allocator": "paged"}, {"allocator": "contiguous-max"}]
    def rows(paged_status):
        states = [SearchState(2.0, 4.0, True, paged_status, None), SearchState(3.2, 3.3, True, "found", None)]
        return {r["allocator"]: r["paged_advantage"] for r in max_rate_rows(configs, states, [3, 3], [1, 1])}

    assert rows("found")["contiguous-max"] == 2.0 / 3.2
    assert rows("point_failed") == {"paged": None, "contiguous-max": None}

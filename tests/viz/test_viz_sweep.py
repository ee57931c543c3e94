"""Sweep figures across run folders, and the trace overview."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from viz_fixtures import write_small_run, write_sweep_point

from traces.stats import mean_rate
from viz import figure_results, plot_runs
from viz.errors import VizError
from viz.load import load_runs
from viz.palette import ALLOCATOR_COLORS
from viz.sweep import applies, plot_block_size_sweep, plot_sweep_latency, run_rate, sweep_data
from viz.trace_overview import plot_trace_overview, save_trace_overview, trace_overview_data


@pytest.fixture
def rate_runs(tmp_path):
    return load_runs([write_sweep_point(tmp_path / "sw", f"rate{r}", rate=r) for r in (4.0, 1.0, 2.0)])


def test_rate_comes_from_config_else_derived(rate_runs, tmp_path):
    run = rate_runs[0]
    assert run_rate(run, run.allocators["paged"]) == (4.0, "config.json 'rate'")
    bare = load_runs([write_small_run(tmp_path / "bare")])[0]
    rate, source = run_rate(bare, bare.allocators["paged"])
    assert source == "derived from arrival_s" and rate == pytest.approx(3 / 2.0)  # 4 arrivals over 2 s
    bare.trace["mean_rate_per_s"] = 7.5
    assert run_rate(bare, bare.allocators["paged"]) == (7.5, "summary.json trace 'mean_rate_per_s'")
    bare.allocators["paged"].config["extra"] = {"rate": 3.0}
    assert run_rate(bare, bare.allocators["paged"]) == (3.0, "config.json extra 'rate'")


def test_sweep_latency_lines_per_allocator(rate_runs):
    assert applies(rate_runs, "rate") and not applies(rate_runs, "block_size")
    result = plot_sweep_latency(rate_runs)
    data = result.data
    assert len(data) == 6 and set(data["rate"]) == {1.0, 2.0, 4.0}
    ax = result.figure.axes[0]
    assert len(ax.lines) == 2
    line = ax.lines[0]
    assert line.get_color() == ALLOCATOR_COLORS["paged"]
    assert line.get_xdata().tolist() == [1.0, 2.0, 4.0]    # sorted by rate
    expected = data[data["allocator"] == "paged"].sort_values("rate")["normalized_latency_s"]
    assert line.get_ydata().tolist() == pytest.approx((1e3 * expected).tolist())  # drawn in ms
    assert ax.get_xlabel() == "request rate (req/s)" and ax.get_ylabel() == "normalized latency (ms/token)"


def test_points_of_other_settings_in_one_sweep_folder_are_lines_of_their_own(tmp_path):
    # Sweeping again into the same folder with another model keeps both sweeps' points in points/.
    paths = [write_sweep_point(tmp_path / "sw", f"r{r}{m}", rate=r) for m in ("a", "b") for r in (1.0, 2.0)]
    for path in paths[2:]:
        for config in path.glob("*/config.json"):
            config.write_text(json.dumps({**json.loads(config.read_text()), "model": "mistral-7b-v0.1"}))
    result = plot_sweep_latency(load_runs(paths))
    ax = result.figure.axes[0]
    assert len(ax.lines) == 4  # two allocators x two models, none zigzagging between the models
    assert all(line.get_xdata().tolist() == [1.0, 2.0] for line in ax.lines)
    labels = [t.get_text() for t in result.figure.legends[0].get_texts()]
    assert sum("model mistral-7b-v0.1" in t for t in labels) == 2
    # Points that differ only in rate (and bookkeeping) make one line per allocator, labelled plainly.
    same = plot_sweep_latency(load_runs(paths[:2]))
    assert [t.get_text() for t in same.figure.legends[0].get_texts()] == ["paged (vLLM)", "contiguous (Max)"]


def test_block_size_sweep(tmp_path):
    runs = load_runs([write_sweep_point(tmp_path / "sw", f"bs{b}", block_size=b) for b in (32, 8, 16)])
    assert applies(runs, "block_size") and not applies(runs, "rate")
    result = plot_block_size_sweep(runs)
    lat_ax, waste_ax = result.figure.axes
    assert [len(lat_ax.lines), len(waste_ax.lines)] == [1, 1]  # paged only: contiguous-max has no blocks
    assert lat_ax.lines[0].get_xdata().tolist() == [8, 16, 32]
    waste = waste_ax.lines[0].get_ydata()
    assert waste.tolist() == pytest.approx([9.0] * 3)       # 5% reservation + 4% internal (paged)
    assert lat_ax.get_xlabel() == "block size (tokens)"
    assert [t.get_text() for t in lat_ax.get_xticklabels()] == ["8", "16", "32"]


def _as_simulated(run: Path) -> Path:
    """`run` with its contiguous allocator's summary saying block size 1, as a simulated run's does."""
    for summary in (run / "summary.json", run / "contiguous-max" / "summary.json"):
        data = json.loads(summary.read_text())
        (data["allocators"]["contiguous-max"] if "allocators" in data else data)["block_size"] = 1
        summary.write_text(json.dumps(data))
    return run


def test_contiguous_allocators_name_no_block_size(tmp_path):
    sweep = tmp_path / "sw"
    runs = load_runs([_as_simulated(write_sweep_point(sweep, f"r{r:g}", rate=r)) for r in (2.0, 8.0)])
    assert np.isnan(sweep_data(runs).query("allocator == 'contiguous-max'")["block_size"]).all()
    assert applies(runs, "rate") and not applies(runs, "block_size")
    assert [r.name for r in figure_results(runs) if r.name.startswith(("sweep_", "block_size"))] == \
        ["sweep_latency"]
    legend = [t.get_text() for t in plot_sweep_latency(runs).figure.legends[0].get_texts()]
    assert sorted(legend) == ["contiguous (Max)", "paged (vLLM)"]


def test_a_contiguous_line_is_not_split_by_paged_block_sizes(tmp_path):
    points = tmp_path / "sw" / "points"
    paths = [_as_simulated(write_small_run(points / f"r{r:g}", r, 8, point_hash=f"r{r:g}"))
             for r in (1.0, 2.0)]
    # A sweep runs a contiguous allocator at the first block size only.
    paths += [write_small_run(points / f"r{r:g}-bs32", r, 32, ("paged",), f"b{r:g}") for r in (1.0, 2.0)]
    runs = load_runs(paths)
    legend = [t.get_text() for t in plot_sweep_latency(runs).figure.legends[0].get_texts()]
    assert sorted(legend) == ["contiguous (Max)", "paged (vLLM) (block size 32)",
                              "paged (vLLM) (block size 8)"]
    lat_ax, _ = plot_block_size_sweep(runs).figure.axes
    assert {tuple(line.get_xdata()) for line in lat_ax.lines} == {(8, 32)}  # one line per rate, paged only


def test_separate_runs_of_one_paged_block_size_get_no_block_size_warning(tmp_path):
    paths = [_as_simulated(write_small_run(tmp_path / name)) for name in ("a", "b")]
    told: list[str] = []
    written = {p.name for p in plot_runs(paths, tmp_path / "figs", warn=told.append)}
    assert told == [] and "block_size_sweep.png" not in written


def test_one_run_has_no_sweep(tmp_path):
    runs = load_runs([write_small_run(tmp_path / "one", rate=2.0)])
    assert not applies(runs, "rate")
    assert sweep_data(runs)["rate"].tolist() == [2.0, 2.0]


def test_separate_runs_are_not_joined_into_a_sweep(tmp_path):
    paths = [write_small_run(tmp_path / "a", rate=1.0, block_size=8),
             write_small_run(tmp_path / "b", rate=2.0, block_size=32)]
    assert not applies(load_runs(paths), "rate") and not applies(load_runs(paths), "block_size")
    told = []
    written = {p.name for p in plot_runs(paths, tmp_path / "figs", warn=told.append)}
    assert "breakdown.png" in written and not {"sweep_latency.png", "block_size_sweep.png"} & written
    assert [m.split(":")[0] for m in told] == ["figure 'sweep_latency' not drawn",
                                               "figure 'block_size_sweep' not drawn"]
    assert "are separate runs; it needs two or more points of one sweep" in told[0]
    with pytest.raises(VizError, match="block_size_sweep' needs two or more points of one sweep"):
        plot_runs(paths, tmp_path / "figs", only=["block_size_sweep"])


def test_a_folder_named_points_without_a_point_hash_is_no_sweep(tmp_path):
    paths = [write_small_run(tmp_path / "points" / f"r{r:g}", rate=r) for r in (1.0, 2.0)]
    assert not applies(load_runs(paths), "rate")


def test_only_the_points_of_one_sweep_are_joined(tmp_path):
    points = [write_sweep_point(tmp_path / "sw", f"r{r:g}", rate=r) for r in (1.0, 2.0)]
    other = write_small_run(tmp_path / "lone", rate=8.0)
    (result,) = [r for r in figure_results(load_runs([*points, other])) if r.name.startswith("sweep_")]
    assert result.name == "sweep_latency" and sorted(result.data["rate"].unique()) == [1.0, 2.0]


def test_two_sweeps_get_a_figure_each(tmp_path):
    paths = [write_sweep_point(tmp_path / s, f"r{r:g}", rate=r) for s in ("low", "high") for r in (1.0, 2.0)]
    results = [r for r in figure_results(load_runs(paths)) if r.name.startswith("sweep_")]
    assert [r.name for r in results] == ["sweep_latency-low", "sweep_latency-high"]
    assert all(len(r.data) == 4 for r in results)  # two points of two allocators each


def _trace(n: int = 2000, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"request_id": np.arange(n), "arrival_s": np.sort(rng.uniform(0, 100, n)),
                         "prompt_len": rng.integers(1, 4000, n), "output_len": rng.integers(1, 500, n)})


def test_trace_overview_data_counts_every_request():
    df = _trace()
    data = trace_overview_data(df)
    assert (data["rate"] * np.diff(data["rate_edges"])).sum() == pytest.approx(len(df))
    assert data["prompt_len_counts"].sum() == len(df) and data["output_len_counts"].sum() == len(df)
    assert data["prompt_len_edges"][0] == 1.0 and data["prompt_len_edges"][-1] >= df["prompt_len"].max()
    assert float(data["prompt_len_mean"]) == pytest.approx(df["prompt_len"].mean())


def test_trace_overview_figure_axes():
    result = plot_trace_overview(_trace())
    rate_ax, prompt_ax, out_ax = result.figure.axes
    assert rate_ax.get_ylabel() == "arrival rate (req/s)" and rate_ax.get_xlabel() == "arrival time (s)"
    assert prompt_ax.get_xscale() == "log" and out_ax.get_xscale() == "log"
    assert prompt_ax.get_xlabel() == "prompt length (tokens)"
    assert "2,000 requests" in rate_ax.get_title()


def test_trace_overview_mean_rate_is_trace_infos():
    df = _trace()
    rate = mean_rate(df["arrival_s"].to_numpy(float))
    result = plot_trace_overview(df)
    assert float(result.data["mean_rate"]) == pytest.approx(rate)  # (N - 1) / span, not N / span
    assert f"mean {rate:,.3f} req/s" in result.figure.axes[0].get_title()
    assert result.figure.axes[0].lines[0].get_ydata()[0] == pytest.approx(rate)


@pytest.mark.parametrize(("num", "said"), [(100, "a burst"), (1, "a single request")])
def test_trace_overview_of_a_burst_draws_no_rate(num, said):
    df = _trace(num).assign(arrival_s=5.0)
    result = plot_trace_overview(df)
    rate_ax = result.figure.axes[0]
    assert np.isnan(result.data["mean_rate"]) and len(result.data["rate"]) == 0
    assert said in rate_ax.get_title() and "req/s" not in rate_ax.get_title()
    assert len(rate_ax.lines) == len(rate_ax.patches) == len(rate_ax.get_xticks()) == 0
    assert "t = 5 s" in rate_ax.texts[0].get_text()


def test_save_trace_overview_to_folder_or_file(tmp_path):
    folder_out = save_trace_overview(_trace(), tmp_path / "figs", "svg")
    assert folder_out == tmp_path / "figs" / "trace_overview.svg"
    assert folder_out.read_text().lstrip().startswith("<?xml")
    file_out = save_trace_overview(_trace(), tmp_path / "t.png")
    assert file_out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figs", "t.png"]  # no temp files left


def test_trace_overview_rejects_bad_tables(tmp_path):
    with pytest.raises(VizError, match="trace table: missing column 'arrival_s'"):
        trace_overview_data(_trace().drop(columns=["arrival_s"]))
    with pytest.raises(VizError, match="format 'gif'"):
        save_trace_overview(_trace(), tmp_path, "gif")
    with pytest.raises(VizError, match="no rows"):
        trace_overview_data(_trace().iloc[:0])


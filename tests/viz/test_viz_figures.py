"""Breakdown, memory-over-time, latency and batch-size figures: the data they draw and their axes."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PolyCollection
from viz_fixtures import MEMORY_FRACTIONS, requests_table, write_small_run

from viz.breakdown import plot_breakdown
from viz.latency_cdf import latency_cdf_data, plot_latency_cdf
from viz.load import load_run, load_runs
from viz.palette import ALLOCATOR_COLORS, STATE_COLORS, STATE_ORDER
from viz.timeline import plot_batch_size, plot_memory_over_time

STATES = list(STATE_ORDER)


@pytest.fixture
def run(tmp_path):
    return load_run(write_small_run(tmp_path / "small"))


def test_breakdown_bars_stack_the_summary_fractions(run):
    result = plot_breakdown([run])
    data = result.data
    assert data["allocator"].tolist() == ["paged", "contiguous-max"]
    for _, row in data.iterrows():
        assert row[STATES].to_dict() == pytest.approx(MEMORY_FRACTIONS[row["allocator"]])
    ax = result.figure.axes[0]
    assert len(ax.containers) == 5
    for state, bars in zip(STATES, ax.containers, strict=True):
        heights = [p.get_height() for p in bars.patches]
        assert heights == pytest.approx((data[state] * 100).tolist())
        assert bars.patches[0].get_facecolor()[:3] == pytest.approx(_rgb(STATE_COLORS[state]))
    token_bar = ax.containers[0].patches[0]
    assert token_bar.get_y() == 0  # token states sit on the axis
    texts = {t.get_text() for t in ax.texts}
    assert {"55.0%", "36.0%", "25.0%"} <= texts
    assert ax.get_ylabel() == "share of KV cache capacity (%)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["paged\n(vLLM)", "contiguous\n(Max)"]


def test_breakdown_of_several_runs_labels_run_and_allocator(tmp_path):
    runs = load_runs([write_small_run(tmp_path / "r1"), write_small_run(tmp_path / "r2")])
    result = plot_breakdown(runs)
    labels = [t.get_text() for t in result.figure.axes[0].get_xticklabels()]
    assert labels == [f"{r}\n{a}" for r in ("r1", "r2") for a in ("paged\n(vLLM)", "contiguous\n(Max)")]


def _rgb(hex_colour: str) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb
    return to_rgb(hex_colour)


def test_memory_over_time_panels_series_and_labels(run):
    result = plot_memory_over_time(run)
    axes = result.figure.axes
    assert len(axes) == 6  # memory + queues for each of two allocators, then each one's waiting axis
    mem_ax, queue_ax, waiting_ax = axes[0], axes[1], axes[4]
    fills = [c for c in mem_ax.collections if isinstance(c, PolyCollection)]
    assert len(fills) == 5
    assert [tuple(np.round(f.get_facecolor()[0][:3], 4)) for f in fills] == \
        [tuple(np.round(_rgb(STATE_COLORS[s]), 4)) for s in STATES]
    assert [line.get_label() for line in queue_ax.lines] == ["running", "swapped"]
    assert [line.get_label() for line in waiting_ax.lines] == ["waiting"]
    assert waiting_ax.get_shared_x_axes().joined(waiting_ax, queue_ax)
    assert "paged" in mem_ax.get_title(loc="left") and "contiguous (Max)" in axes[2].get_title(loc="left")
    assert mem_ax.get_ylabel() == "capacity (%)" and queue_ax.get_ylabel() == "running,\nswapped"
    assert axes[3].get_xlabel() == "simulated time (s)"
    assert axes[0].get_shared_x_axes().joined(axes[0], axes[3])
    states = result.data["paged"]["states"]
    mem = run.allocators["paged"].memory
    assert np.allclose(states.mean, mem[STATES].to_numpy())  # 16 rows: drawn as they are
    assert np.allclose(states.mean.sum(axis=1), 1.0)


def test_memory_over_time_downsamples_long_runs_keeping_the_peak(run):
    alloc = run.allocators["paged"]
    n = 50_000
    mem = pd.concat([alloc.memory.iloc[[0]]] * n, ignore_index=True)
    mem["t_s"] = np.arange(n) * 0.01
    mem["dt_s"] = 0.01
    mem.loc[31_337, ["token_states", "free"]] = [1.0 - mem.loc[0, STATES[1:4]].sum(), 0.0]
    alloc.__dict__["memory"] = mem  # the cached table: same columns, just long
    result = plot_memory_over_time(run, max_bins=400)
    series = result.data["paged"]
    assert len(series["states"].edges) == 401
    assert np.allclose(np.nansum(series["states"].mean, axis=1), 1.0)
    assert np.nanmax(series["used"].hi) == pytest.approx(1.0)  # the one full step survives
    assert np.nanmax(series["states"].mean[:, 0]) < 0.6         # ... though the mean hides it
    mem_ax = result.figure.axes[0]
    assert len(mem_ax.lines) == 1                               # the peak envelope line
    bands = [c for ax in (result.figure.axes[1], result.figure.axes[4]) for c in ax.collections
             if isinstance(c, PolyCollection)]
    assert len(bands) == 3                                      # min/max band of each queue


def test_latency_cdf_data_is_the_empirical_distribution(run):
    data = latency_cdf_data([run])
    assert set(data) == {"ttft_s", "tpot_s", "normalized_latency_s"}
    req = requests_table("paged")
    x, y = data["ttft_s"]["paged"]
    assert x.tolist() == pytest.approx(sorted(req["ttft_s"]))
    assert y.tolist() == pytest.approx([0.25, 0.5, 0.75, 1.0])
    # contiguous request 4 never finished: dropped from TPOT and normalized latency, kept in TTFT
    assert len(data["normalized_latency_s"]["contiguous-max"][0]) == 3
    assert len(data["ttft_s"]["contiguous-max"][0]) == 4


def test_latency_cdf_figure_overlays_runs(tmp_path):
    runs = load_runs([write_small_run(tmp_path / "r1"), write_small_run(tmp_path / "r2")])
    result = plot_latency_cdf(runs)
    axes = result.figure.axes
    assert [ax.get_title() for ax in axes] == ["TTFT", "TPOT", "normalized latency"]
    # Latencies under 100 s are drawn in ms, the unit of the CLI's tables; the data stays in seconds.
    assert axes[0].get_xlabel() == "time to first token (ms)"
    assert axes[2].get_xlabel() == "end-to-end latency / output tokens (ms/token)"
    seconds = result.data["ttft_s"]["r1/paged"][0]
    np.testing.assert_allclose(axes[0].lines[0].get_xdata(), 1e3 * seconds)
    assert axes[0].get_ylabel() == "fraction of finished requests"
    assert all(len(ax.lines) == 4 for ax in axes)
    styles = [(line.get_color(), line.get_linestyle()) for line in axes[0].lines]
    assert styles[0] == (ALLOCATOR_COLORS["paged"], "-") and styles[2] == (ALLOCATOR_COLORS["paged"], "--")
    legend_texts = [t.get_text() for t in result.figure.legends[0].get_texts()]
    assert legend_texts[0] == "r1: paged (vLLM)"


def test_batch_size_lines_and_means(run):
    result = plot_batch_size([run])
    ax = result.figure.axes[0]
    assert len(ax.lines) == 2
    assert ax.get_ylabel() == "running requests" and ax.get_xlabel() == "simulated time (s)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == \
        ["paged (vLLM) (mean 2.0)", "contiguous (Max) (mean 1.5)"]
    assert result.data["paged"].mean.tolist() == run.allocators["paged"].memory["num_running"].tolist()

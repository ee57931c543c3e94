"""Figures from sweep tables: Fig. 12 lines and max-rate bars (tables written by hand, no simulator)."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_hex

from viz.capacity import load_sweep, plot_latency_vs_rate, plot_max_rates, plot_sweep_folder
from viz.errors import VizError
from viz.palette import ALLOCATOR_COLORS

SUMMARY = {"trace": "t",
           "slo": {"metric": "norm_latency", "bound": 0.2, "text": "norm_latency <= 0.2 s/token"}}


def points(block_sizes=(16,)):
    rows = []
    for name, knee in (("paged", 2.0), ("contiguous-max", 0.5)):
        for bs in block_sizes:
            for rate in (0.25, 1.0, 3.0):
                rows.append({"allocator": name, "block_size": bs, "rate": rate, "kind": "grid",
                             "normalized_latency_s": 0.05 if rate < knee else 1.0 + rate,
                             "met_slo": rate < knee})
    return pd.DataFrame(rows)


def max_rates():
    return pd.DataFrame([
        {"allocator": "contiguous-max", "max_rate": 0.5, "first_miss_rate": 0.52, "status": "found",
         "monotone": True, "runs": 8, "search_runs": 5, "paged_advantage": 4.0},
        {"allocator": "paged", "max_rate": 2.0, "first_miss_rate": 2.1, "status": "found",
         "monotone": True, "runs": 8, "search_runs": 5, "paged_advantage": 1.0},
    ])


def test_fig12_has_one_line_per_allocator_in_its_colour_and_the_slo():
    result = plot_latency_vs_rate(points(), SUMMARY)
    ax = result.figure.axes[0]
    data_lines = [ln for ln in ax.lines if len(ln.get_xdata()) == 3]
    assert [to_hex(ln.get_color()) for ln in data_lines] == \
        [ALLOCATOR_COLORS["paged"].lower(), ALLOCATOR_COLORS["contiguous-max"].lower()]
    np.testing.assert_array_equal(data_lines[0].get_xdata(), [0.25, 1.0, 3.0])
    # Latencies under 100 s are drawn in ms, as the CLI's tables give them: the 0.2 s/token SLO at 200.
    assert ax.get_ylabel() == "normalized latency (ms/token)"
    assert any(np.allclose(ln.get_ydata(), 200) for ln in ax.lines if ln not in data_lines)
    np.testing.assert_allclose(data_lines[0].get_ydata(), 1e3 * points().query("allocator == 'paged'")
                               .sort_values("rate")["normalized_latency_s"].to_numpy())


def test_fig12_splits_lines_by_a_swept_block_size():
    ax = plot_latency_vs_rate(points((8, 32)), SUMMARY).figure.axes[0]
    assert len([ln for ln in ax.lines if len(ln.get_xdata()) == 3]) == 4
    labels = [t.get_text() for t in ax.figure.legends[0].get_texts()]
    assert "paged (vLLM) (block size 8)" in labels


def test_fig12_names_no_block_size_for_a_contiguous_line():
    swept = points((8, 32))
    swept = swept[(swept["allocator"] == "paged") | (swept["block_size"] == 8)]  # as a sweep runs them
    labels = [t.get_text() for t in plot_latency_vs_rate(swept, SUMMARY).figure.legends[0].get_texts()]
    assert "contiguous (Max)" in labels and "paged (vLLM) (block size 32)" in labels
    assert not any("Max) (block size" in label for label in labels)


def test_max_rate_bars_are_paged_first_with_the_advantage():
    result = plot_max_rates(max_rates(), SUMMARY)
    ax = result.figure.axes[0]
    assert [p.get_width() for p in ax.patches] == [2.0, 0.5]  # horizontal bars, paged in the top row
    assert ax.yaxis_inverted() and ax.get_yticklabels()[0].get_text() == "paged (vLLM)"
    texts = [t.get_text() for t in ax.texts]
    assert "0.5\npaged 4.00x" in texts and "2" in texts


def test_max_rate_bar_names_do_not_overprint_each_other():
    configs = [{"allocator": "paged", "block_size": b, "kv_cache_dtype": d}
               for b in (16, 32) for d in ("auto", "fp8")]
    table = pd.DataFrame([{**c, "max_rate": 120.0, "first_miss_rate": None, "status": "above_range",
                           "monotone": True, "runs": 3, "search_runs": 0, "paged_advantage": 1.0}
                          for c in configs])
    fig = plot_max_rates(table, SUMMARY).figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    names = [t for t in ax.get_xticklabels() + ax.get_yticklabels() if "paged" in t.get_text()]
    boxes = [t.get_window_extent(renderer) for t in names]
    assert len(boxes) == 4
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert "kv cache dtype auto, block size 16" in names[0].get_text()


def test_sweep_folder_round_trip_and_incomplete_folder(tmp_path):
    points().to_parquet(tmp_path / "sweep.parquet")
    max_rates().to_parquet(tmp_path / "max_rates.parquet")
    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))
    written = plot_sweep_folder(tmp_path, tmp_path / "figs")
    assert [p.name for p in written] == ["sweep_fig12.png", "sweep_max_rates.png"]
    assert all(p.stat().st_size > 1000 for p in written)
    (tmp_path / "max_rates.parquet").unlink()
    with pytest.raises(VizError, match="not a complete sweep folder"):
        load_sweep(tmp_path)

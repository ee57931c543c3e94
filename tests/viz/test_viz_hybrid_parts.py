"""Padding layers and window blocks kept for prefix caching, where a run carries them: hatched inside their
states in the breakdown bars and the memory-over-time areas (named in the legends), counter tracks in
the Perfetto export, rows of `pagelab compare`, series of the run explorer; none of it for a one-group run.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from cli.compare import side_by_side
from tests.cli.clirun import pagelab
from viz.breakdown import plot_breakdown
from viz.explorer import page_data
from viz.load import load_run, load_runs
from viz.palette import PART_HATCH, PART_LABELS
from viz.timeline import plot_memory_over_time

PART_NAMES = set(PART_LABELS.values())  # "padding layers", "window blocks kept for prefix caching"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """gemma-3-27b served with its hybrid layout (7 groups, 8 padding layers, 1024-token windows) and
    forced into one group, on the first Mooncake conversations."""
    root = tmp_path_factory.mktemp("parts")
    args = ("simulate", "mooncake-conv", "--limit", "12", "--model", "gemma-3-27b", "--gpu", "h100-80gb",
            "--max-model-len", "32768", "-a", "paged")
    for name, extra in (("hybrid", ()), ("one-group", ("--disable-hybrid-kv-cache-manager",))):
        result = pagelab(*args, *extra, "-o", root / name, timeout=300)
        assert result.returncode == 0, result.stderr
    return root / "hybrid", root / "one-group"


def _legend_texts(fig) -> list[str]:
    return [t.get_text() for leg in fig.legends for t in leg.get_texts()]


def _hatched(ax, hatch: str) -> list:
    return [p for p in ax.patches if p.get_hatch() == hatch]


def test_breakdown_hatches_the_parts_a_run_carries(runs):
    hybrid, flat = runs
    fig = plot_breakdown([load_run(hybrid)]).figure
    assert set(_legend_texts(fig)) >= PART_NAMES
    shares = json.loads((hybrid / "paged" / "summary.json").read_text())["memory"]
    ax = fig.axes[0]
    for part, hatch in PART_HATCH.items():
        (bar,) = _hatched(ax, hatch)
        assert bar.get_height() == pytest.approx(100 * shares[part]) and bar.get_height() > 0
    fig = plot_breakdown([load_run(flat)]).figure
    assert not PART_NAMES & set(_legend_texts(fig))
    assert all(not p.get_hatch() for p in fig.axes[0].patches)


def test_breakdown_of_both_gives_the_one_group_bar_no_parts(runs):
    result = plot_breakdown(load_runs(list(runs)))
    assert result.data["padding"].iloc[1] == 0 and result.data["padding"].iloc[0] > 0
    assert set(_legend_texts(result.figure)) >= PART_NAMES


def test_memory_over_time_hatches_the_parts_inside_their_bands(runs):
    hybrid, flat = runs
    result = plot_memory_over_time(load_run(hybrid))
    assert set(_legend_texts(result.figure)) >= PART_NAMES
    ax = result.figure.axes[0]
    hatches = {c.get_hatch() for c in ax.collections}
    assert set(PART_HATCH.values()) <= hatches
    series = result.data["paged"]
    assert series["parts"].mean.shape[1] == 2 and np.nanmax(series["parts"].mean) > 0
    result = plot_memory_over_time(load_run(flat))
    assert not PART_NAMES & set(_legend_texts(result.figure))
    assert "parts" not in result.data["paged"]
    assert all(not c.get_hatch() for ax in result.figure.axes for c in ax.collections)


def test_perfetto_has_counter_tracks_for_the_parts(runs, tmp_path):
    names = []
    for run in runs:
        out = tmp_path / f"{run.name}.json"
        assert pagelab("export", run, "--format", "perfetto", "--out", out, timeout=300).returncode == 0
        events = json.loads(out.read_text())
        events = events["traceEvents"] if isinstance(events, dict) else events
        names.append({e["name"] for e in events if e.get("ph") == "C"})
    assert {"padding", "window_cached"} <= names[0]
    assert not {"padding", "window_cached"} & names[1]


def test_compare_rows_the_parts_with_zero_for_the_one_group_run(runs):
    pairs = [(json.loads((r / "paged" / "config.json").read_text()),
              json.loads((r / "paged" / "summary.json").read_text())) for r in runs]
    rows = {label: (a, b) for section, label, a, b in side_by_side(*pairs) if section.startswith("memory")}
    a, b = rows["  of which padding layers"]
    assert a > 0 and b == 0
    a, b = rows["  of which window blocks kept for prefix caching"]
    assert a > 0 and b == 0
    one_group = side_by_side(pairs[1], pairs[1])
    assert not any("of which" in label for section, label, _, _ in one_group if section.startswith("memory"))


def test_the_explorer_carries_the_parts_only_for_a_run_that_has_them(runs):
    hybrid, flat = runs
    data = page_data(load_run(hybrid))
    assert set(data["palette"]["parts"]) == {"padding", "window_cached"}
    alloc = data["allocators"][0]
    assert alloc["parts"] == ["padding", "window_cached"]
    assert {"padding", "window_cached"} <= set(alloc["summary"]) and {"padding", "window_cached"} <= set(
        alloc["windows"][0]["memory"])
    data = page_data(load_run(flat))
    assert "parts" not in data["palette"] and "parts" not in data["allocators"][0]
    assert "padding" not in data["allocators"][0]["summary"]

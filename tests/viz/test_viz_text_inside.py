"""Every figure family keeps all of its text on the canvas, at the sizes it is drawn at (one allocator or
four, long run labels), and gives latencies in one unit, chosen as the CLI's tables choose theirs."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.text import Text

from pagelab.run_folder import write_run
from simulator.config import SimConfig
from simulator.loop import simulate
from traces import load_trace
from traces.stats import trace_info
from viz import FIGURES, figure_results
from viz.breakdown import plot_breakdown
from viz.capacity import plot_latency_vs_rate, plot_max_rates
from viz.compare import plot_latency_overlay
from viz.load import load_runs
from viz.trace_overview import plot_trace_overview
from viz.validation import HeldOutRun, plot_validation

ALLOCATORS = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")
LONG = "a-trace-name-as-long-as-a-dated-production-export-2026-11-27.parquet"


def drawn_text_outside(fig) -> list[tuple[str, tuple[float, ...]]]:
    """The text artists a draw of `fig` puts (partly) outside its canvas, with their extents."""
    drawn = []
    original = Text.draw

    def draw(self, renderer):
        original(self, renderer)
        if self.get_visible() and self.get_text().strip():
            drawn.append((self, self.get_window_extent(renderer)))

    Text.draw = draw
    try:
        fig.canvas.draw()
    finally:
        Text.draw = original
    width, height = fig.bbox.width, fig.bbox.height
    return [(t.get_text()[:60], tuple(round(v) for v in box.extents)) for t, box in drawn
            if box.x0 < -0.5 or box.y0 < -0.5 or box.x1 > width + 0.5 or box.y1 > height + 0.5]


def simulated_run(folder: Path, allocators, block_size: int = 16, rate: float | None = None) -> Path:
    """A small real run folder of the bundled trace, under a long trace label; the sweep figures join
    the runs written in one points/ folder."""
    trace = load_trace("azure-conv").iloc[:150].reset_index(drop=True)
    base = SimConfig(model="opt-13b", kv_memory_gb=3, max_model_len=2048, block_size=block_size,
                     extra={"trace": LONG, "rate": rate})
    results = {a: simulate(trace, dataclasses.replace(base, allocator=a)) for a in allocators}
    info = {"source": LONG, **trace_info(trace), "rate_override": rate, "point_hash": folder.name}
    return write_run(folder, info, results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    points = tmp_path_factory.mktemp("sweep") / "points"
    return {"one": simulated_run(points / "one-allocator-run-with-a-long-label", ("paged",)),
            "four": simulated_run(points / "four", ALLOCATORS),
            "bs32": simulated_run(points / "four-bs32-rate2", ALLOCATORS, block_size=32, rate=2.0)}


@pytest.mark.parametrize("which", [("one",), ("four",), ("four", "bs32")])
def test_run_figures_keep_their_text_inside(runs, which):
    drawn = set()
    for result in figure_results(load_runs([runs[w] for w in which])):
        assert drawn_text_outside(result.figure) == [], result.name
        drawn.add(result.name.split("-")[0])
    if len(which) == 2:
        assert drawn == set(FIGURES)  # every family, the sweeps included


def overlapping_tick_labels(ax) -> list[tuple[str, str]]:
    """Neighbouring x tick labels of `ax` whose drawn boxes overlap."""
    ax.figure.canvas.draw()
    boxes = [(t.get_text(), t.get_window_extent()) for t in ax.get_xticklabels() if t.get_text()]
    return [(a, b) for (a, box_a), (b, box_b) in zip(boxes, boxes[1:], strict=False) if box_a.x1 > box_b.x0]


@pytest.mark.parametrize("which, drop, parts", [(("four",), (), False),
                                                (("four",), ("contiguous-max",), True),
                                                (("four", "bs32"), ("contiguous-max",), True)])
def test_breakdown_tick_labels_never_overlap(runs, which, drop, parts):
    # Three bars next to the wide legend of a hybrid run's parts ran "contiguous (Pow2)" into its neighbour.
    loaded = load_runs([runs[w] for w in which])
    loaded = [dataclasses.replace(r, allocators={n: a for n, a in r.allocators.items() if n not in drop})
              for r in loaded]
    if parts:
        loaded[0].allocators["paged"].summary["memory"].update(padding=0.09, window_cached=0.01)
    fig = plot_breakdown(loaded).figure
    assert overlapping_tick_labels(fig.axes[0]) == []
    assert drawn_text_outside(fig) == []


def test_sweep_folder_figures_keep_their_text_inside():
    rows = [{"allocator": a, "block_size": b, "rate": r, "kind": "grid", "normalized_latency_s": 0.04 * r,
             "met_slo": r < 3} for a in ALLOCATORS for b in (16, 32) for r in (0.5, 1.0, 2.0, 4.0)]
    slo_text = "norm_latency <= 0.2 s/token (mean end-to-end latency / output tokens)"
    summary = {"trace": LONG, "slo": {"metric": "norm_latency", "bound": 0.2, "text": slo_text}}
    max_rates = pd.DataFrame([{"allocator": a, "block_size": b, "max_rate": 2.5, "first_miss_rate": 2.6,
                               "status": "above_range", "monotone": True, "runs": 9, "search_runs": 5,
                               "paged_advantage": 1.7} for a in ALLOCATORS for b in (16, 32)])
    for result in (plot_latency_vs_rate(pd.DataFrame(rows), summary), plot_max_rates(max_rates, summary)):
        assert drawn_text_outside(result.figure) == [], result.name


def test_trace_comparison_and_validation_figures_keep_their_text_inside(runs):
    requests = pd.read_parquet(runs["four"] / "paged" / "requests.parquet")
    assert drawn_text_outside(plot_trace_overview(load_trace("azure-conv"), title=LONG).figure) == []
    assert drawn_text_outside(plot_latency_overlay(requests, requests, title=LONG).figure) == []
    held_out = [HeldOutRun(f"part-{i}-with-a-long-name", 0.05 * i, -0.01 * i, True, i % 2 == 0, judged=i > 1,
                           floor_e2e=0.03, floor_throughput=0.02) for i in range(1, 9)]
    assert drawn_text_outside(plot_validation(held_out, 0.10, 0.05, title=LONG).figure) == []


def test_latencies_take_one_unit_per_figure(runs):
    [cdf] = figure_results(load_runs([runs["four"]]), ["latency_cdf"])
    largest = max(float(v[0].max()) for series in cdf.data.values() for v in series.values() if len(v[0]))
    unit, per_s = ("s", 1.0) if largest >= 100 else ("ms", 1e3)  # as the serving table's rows
    labels = [ax.get_xlabel() for ax in cdf.figure.axes]
    assert labels == [f"time to first token ({unit})", f"time per output token ({unit})",
                      f"end-to-end latency / output tokens ({unit}/token)"]
    ttft = cdf.data["ttft_s"]["paged"][0]
    np.testing.assert_allclose(cdf.figure.axes[0].lines[0].get_xdata(), per_s * ttft)
    # Under 100 s: ms in every panel; from 100 s: s in every panel.
    fast = pd.DataFrame({"ttft_s": [0.5, 2.0], "tpot_s": [0.01, 0.02], "e2e_s": [3.0, 40.0]})
    slow = fast * 10
    for frame, unit in ((fast, "ms"), (slow, "s")):
        overlay = plot_latency_overlay(frame, frame)
        assert [ax.get_xlabel() for ax in overlay.figure.axes] == \
            [f"TTFT ({unit})", f"TPOT ({unit})", f"end-to-end latency ({unit})"]

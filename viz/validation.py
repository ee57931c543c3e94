"""Held-out validation at a glance: each run's timing errors against the targets, beside the machine's own
noise floor (how far a second replay of the same part lands from the first), so a miss reads as either the
model's or the machine's (docs/calibration.md)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from viz.common import FigureResult, legend_below, new_figure

MET_COLOR, MISSED_COLOR, FLOOR_COLOR = "#4477AA", "#CC3311", "#000000"
UNJUDGED_LABEL_COLOR = "#888888"


@dataclass(frozen=True)
class HeldOutRun:
    """One held-out run as its validation judged it (errors as fractions; None where the comparison had no
    value). The verdicts are bench.calibration's: the figure draws them, it does not decide them."""

    name: str  # run folder name, e.g. "B-repeat"
    e2e: float | None  # median |relative error| of end-to-end latency
    throughput: float | None  # signed relative error of output throughput
    e2e_met: bool
    throughput_met: bool
    judged: bool  # its part's noise floor is within both targets: the verdicts measure the model
    floor_e2e: float | None = None  # its part's noise floor (None: the part was not repeated)
    floor_throughput: float | None = None


def _pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


def validation_data(runs: Sequence[HeldOutRun]) -> dict:
    """Per run (in order): values and floors in percent, the verdicts, whether it is judged."""
    return {"runs": [r.name for r in runs], "e2e_pct": [_pct(r.e2e) for r in runs],
            "throughput_pct": [_pct(r.throughput) for r in runs], "e2e_met": [r.e2e_met for r in runs],
            "throughput_met": [r.throughput_met for r in runs],
            "floor_e2e_pct": [_pct(r.floor_e2e) for r in runs],
            "floor_throughput_pct": [_pct(r.floor_throughput) for r in runs],
            "judged": [r.judged for r in runs]}


def plot_validation(runs: Sequence[HeldOutRun], target_e2e: float, target_throughput: float,
                    title: str = "") -> FigureResult:
    """Two panels, a row per run: e2e median |error| and throughput error as bars coloured met / missed,
    the target as a dashed line (a band for the signed throughput error), the part's floor as a marker;
    runs whose part the machine does not repeat within both targets (or was not repeated) in grey."""
    data = validation_data(runs)
    n = len(data["runs"])
    fig = new_figure(11.0, 1.9 + 0.34 * n)
    axes = fig.subplots(1, 2, sharey=True)
    y = np.arange(n)
    panels = ((axes[0], "e2e", "end-to-end latency: median |error| (%)", 100 * target_e2e),
              (axes[1], "throughput", "output throughput: error (%)", 100 * target_throughput))
    for ax, key, xlabel, target in panels:
        values = np.array([np.nan if v is None else v for v in data[f"{key}_pct"]], dtype=float)
        colors = [MET_COLOR if ok else MISSED_COLOR for ok in data[f"{key}_met"]]
        ax.barh(y, np.nan_to_num(values), color=colors, height=0.6)
        floors = np.array([np.nan if v is None else v for v in data[f"floor_{key}_pct"]], dtype=float)
        ax.scatter(floors, y, marker="D", s=22, color=FLOOR_COLOR, zorder=3)
        signed = key == "throughput"
        if signed:
            ax.axvspan(-target, target, color="#DDDDDD", zorder=0)
            ax.axvline(0, color="#444444", linewidth=0.8)
        for x in (-target, target) if signed else (target,):
            ax.axvline(x, color="#444444", linestyle="--", linewidth=1.0)
        finite = np.concatenate([values[np.isfinite(values)], floors[np.isfinite(floors)], [target]])
        reach = 1.12 * float(np.max(np.abs(finite)))
        ax.set_xlim((-reach, reach) if signed else (0, reach))
        ax.set_xlabel(xlabel)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y, data["runs"])
    axes[0].invert_yaxis()  # the first run on top, as in the tables
    for label, judged in zip(axes[0].get_yticklabels(), data["judged"], strict=True):
        if not judged:
            label.set_color(UNJUDGED_LABEL_COLOR)
    fig.suptitle(title or "Held-out validation: simulated against measured")
    handles = [Patch(color=MET_COLOR), Patch(color=MISSED_COLOR),
               Line2D([], [], color="#444444", linestyle="--"),
               Line2D([], [], marker="D", color=FLOOR_COLOR, linestyle="", markersize=5),
               Patch(color=UNJUDGED_LABEL_COLOR)]
    labels = ["target met", "target missed", "target", "noise floor: the part's repeat vs its first replay",
              "run named in grey: floor above a target or not measured (not judged)"]
    legend_below(fig, handles, labels, ncol=3)
    return FigureResult("validation", fig, data)

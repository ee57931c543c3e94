"""Simulated vs measured latency: the CDFs of both runs overlaid (TTFT, TPOT, end-to-end), one figure."""
from __future__ import annotations

import numpy as np
import pandas as pd

from pagelab.units import latency_unit
from viz.common import FigureResult, legend_below, new_figure, use_log_scale
from viz.downsample import cdf_points

METRICS = {"ttft_s": "TTFT ({unit})", "tpot_s": "TPOT ({unit})", "e2e_s": "end-to-end latency ({unit})"}
STYLES = {"measured": ("#222222", "-"), "simulated": ("#d95f02", "--")}


def latency_overlay_data(sim: pd.DataFrame, real: pd.DataFrame, max_points: int = 2000
                         ) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """metric -> "measured"/"simulated" -> (sorted values, cumulative fraction), unfinished dropped."""
    return {m: {"measured": cdf_points(real[m].to_numpy(float), max_points),
                "simulated": cdf_points(sim[m].to_numpy(float), max_points)} for m in METRICS}


def plot_latency_overlay(sim: pd.DataFrame, real: pd.DataFrame, title: str = "") -> FigureResult:
    """Three panels; in each the measured CDF (solid) and the simulated one (dashed) of one latency, all in
    one unit (pagelab/units.py); `data` stays in seconds."""
    data = latency_overlay_data(sim, real)
    unit, per_s = latency_unit(float(x[-1]) for series in data.values() for x, _ in series.values() if len(x))
    fig = new_figure(12.0, 4.0)
    axes = fig.subplots(1, len(METRICS), sharey=True)
    handles, labels = [], []
    for ax, (metric, xlabel) in zip(axes, METRICS.items(), strict=True):
        for which, (x, y) in data[metric].items():
            if len(x) == 0:
                continue
            color, style = STYLES[which]
            (line,) = ax.plot(x * per_s, y, color=color, linestyle=style, linewidth=1.4,
                              drawstyle="steps-post")
            if metric == "ttft_s":
                handles.append(line)
                labels.append(which)
        values = np.concatenate([v[0] for v in data[metric].values()])
        if use_log_scale(values):
            ax.set_xscale("log")
        ax.set_xlabel(xlabel.format(unit=unit))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of finished requests")
    axes[0].set_ylim(0, 1.02)
    fig.suptitle(title or "Latency: simulated vs measured")
    legend_below(fig, handles, labels, ncol=2)
    return FigureResult("latency_overlay", fig, data)

"""Figure 4: latency CDFs (TTFT, TPOT, normalized latency) per allocator, overlaid across runs."""
from __future__ import annotations

import numpy as np
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from pagelab.units import latency_unit
from viz.common import FigureResult, legend_below, new_figure
from viz.downsample import cdf_points
from viz.load import Run, series_label
from viz.palette import LINESTYLES, allocator_color, allocator_label, allocator_marker
from viz.titles import figure_title

METRICS = {
    "ttft_s": ("TTFT", "time to first token ({unit})"),
    "tpot_s": ("TPOT", "time per output token ({unit})"),
    "normalized_latency_s": ("normalized latency", "end-to-end latency / output tokens ({unit}/token)"),
}


def latency_cdf_data(runs: list[Run], max_points: int = 2000
                     ) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """metric -> series label -> (sorted values, cumulative fraction), NaNs (unfinished) dropped."""
    multi = len(runs) > 1
    data: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {m: {} for m in METRICS}
    for run in runs:
        for alloc in run.allocators.values():
            for metric in METRICS:  # one column at a time: a 10M-request table is not loaded whole
                values = alloc.request_columns((metric,))[metric].to_numpy(float)
                data[metric][series_label(run, alloc, multi)] = cdf_points(values, max_points)
    return data


def latency_scale(data: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]) -> str:
    """One x scale for all three panels: "log" when every drawn value is positive, else "linear".

    Latencies are heavy-tailed, and a TPOT panel turned linear alone (its values spanning under two
    decades) would squeeze the bulk of requests against the axis next to log TTFT and normalized panels.
    """
    values = np.concatenate([v[0] for series in data.values() for v in series.values()] or [np.zeros(0)])
    return "log" if len(values) and bool(np.all(values > 0)) else "linear"


def _log_axis(ax, values: np.ndarray) -> None:
    """Log x axis; spanning under two decades it is labelled at 1-2-5 steps in plain numbers.

    (matplotlib's default then labels every minor tick in scientific notation, and they overlap.)
    """
    ax.set_xscale("log")
    v = values[np.isfinite(values) & (values > 0)]
    if len(v) and np.log10(v.max() / v.min()) < 2.0:
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())


def plot_latency_cdf(runs: list[Run]) -> FigureResult:
    """Three panels of empirical CDFs, colour = allocator, line style = run; every panel in one unit (ms,
    or s when a value reaches 100 s: pagelab/units.py, as the CLI's tables). `data` stays in seconds."""
    data = latency_cdf_data(runs)
    multi = len(runs) > 1
    scale = latency_scale(data)
    unit, per_s = latency_unit(float(v[0][-1]) for series in data.values() for v in series.values()
                               if len(v[0]))
    fig = new_figure(12.0, 4.2)
    axes = fig.subplots(1, len(METRICS), sharey=True)
    handles, labels = [], []
    for ax, (metric, (title, xlabel)) in zip(axes, METRICS.items(), strict=True):
        for r, run in enumerate(runs):
            for alloc in run.allocators.values():
                label = series_label(run, alloc, multi)
                x, y = data[metric][label]
                if len(x) == 0:
                    continue
                (line,) = ax.plot(x * per_s, y, color=allocator_color(alloc.name), linewidth=1.3,
                                  linestyle=LINESTYLES[r % len(LINESTYLES)], drawstyle="steps-post",
                                  **allocator_marker(alloc.name, len(x)))
                if metric == next(iter(METRICS)):
                    handles.append(line)
                    name = allocator_label(alloc.name)
                    labels.append(f"{run.label}: {name}" if multi else name)
        if scale == "log":
            _log_axis(ax, per_s * np.concatenate([v[0] for v in data[metric].values()] or [np.zeros(0)]))
        else:
            ax.ticklabel_format(axis="x", useOffset=False)
        ax.set_title(title)
        ax.set_xlabel(xlabel.format(unit=unit))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of finished requests")
    axes[0].set_ylim(0, 1.02)
    fig.suptitle(figure_title("Latency distributions", runs))
    legend_below(fig, handles, labels, ncol=4)
    return FigureResult("latency_cdf", fig, data)

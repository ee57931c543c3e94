"""Figures over time: memory states as stacked areas (with queue sizes beneath) and batch size."""
from __future__ import annotations

import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from viz.common import FigureResult, legend_below, new_figure, time_label
from viz.downsample import DEFAULT_MAX_BINS, Binned, downsample_chunks
from viz.load import AllocatorRun, Run, series_label
from viz.palette import (
    PART_LABELS,
    PART_OF,
    QUEUE_COLORS,
    QUEUE_LABELS,
    QUEUE_LINESTYLES,
    STATE_COLORS,
    STATE_LABELS,
    STATE_ORDER,
    allocator_color,
    allocator_label,
    allocator_marker,
    part_style,
)
from viz.titles import figure_title

QUEUES = ("num_running", "num_waiting", "num_swapped")


def _steps(binned: Binned, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x/y arrays for a 'post' step plot over bin edges (the last value repeated at the end)."""
    return binned.edges, np.concatenate([values, values[-1:]]) if len(values) else values


def memory_series(alloc: AllocatorRun, max_bins: int = DEFAULT_MAX_BINS) -> dict[str, Binned]:
    """Binned state fractions ("states", columns in STATE_ORDER), used share and queue sizes, and the
    parts of states the run carries ("parts", columns in `alloc.parts`; only when it has some)."""
    # One pass over the table: states, used share, queues and parts binned together.
    parts = alloc.parts
    chunks = ((m["t_s"].to_numpy(float), m["dt_s"].to_numpy(float),
               np.column_stack([m[list(STATE_ORDER)].to_numpy(float), 1.0 - m["free"].to_numpy(float),
                                m[list(QUEUES)].to_numpy(float), *(m[p].to_numpy(float) for p in parts)]))
              for m in alloc.memory_chunks(("t_s", "dt_s", *STATE_ORDER, *QUEUES, *parts)))
    both = downsample_chunks(chunks, alloc.num_memory_rows, alloc.memory_span(), max_bins)
    n, q = len(STATE_ORDER), len(QUEUES)

    def part(cols) -> Binned:
        return Binned(both.edges, both.mean[:, cols], both.lo[:, cols], both.hi[:, cols])
    series = {"states": part(slice(0, n)), "used": part(n), "queues": part(slice(n + 1, n + 1 + q))}
    if parts:
        series["parts"] = part(slice(n + 1 + q, None))
    return series


def _queue_line(ax, queues: Binned, j: int, q: str, num_rows: int) -> None:
    """One queue's mean (and min/max band when downsampled) as a step line."""
    x, mean = _steps(queues, queues.mean[:, j])
    ax.plot(x, mean, drawstyle="steps-post", color=QUEUE_COLORS[q], linestyle=QUEUE_LINESTYLES[q],
            linewidth=0.9, label=QUEUE_LABELS[q])
    if len(queues.edges) - 1 < num_rows:
        _, lo = _steps(queues, queues.lo[:, j])
        _, hi = _steps(queues, queues.hi[:, j])
        ax.fill_between(x, lo, hi, step="post", color=QUEUE_COLORS[q], alpha=0.25, linewidth=0)


def _plot_queues(ax, queues: Binned, num_rows: int):
    """Running and swapped on `ax`; waiting on its own right-hand axis (returned), or None if nobody waits.

    A saturated run queues thousands of requests while a few dozen run: on one scale the running
    line would lie flat on zero.
    """
    for j, q in enumerate(QUEUES):
        if q != "num_waiting":
            _queue_line(ax, queues, j, q, num_rows)
    ax.set_ylabel("running,\nswapped")
    ax.set_ylim(bottom=0)
    j = QUEUES.index("num_waiting")
    if not np.nanmax(queues.hi[:, j], initial=0.0) > 0:
        return None
    ax_w = ax.twinx()
    _queue_line(ax_w, queues, j, "num_waiting", num_rows)
    colour = QUEUE_COLORS["num_waiting"]
    ax_w.set_ylabel("waiting", color=colour)
    ax_w.tick_params(axis="y", colors=colour)
    ax_w.set_ylim(bottom=0)
    return ax_w


def plot_memory_over_time(run: Run, max_bins: int = DEFAULT_MAX_BINS, name: str = "memory_over_time"
                          ) -> FigureResult:
    """Per allocator: stacked areas of the five memory states and, beneath, the queue sizes."""
    allocs = list(run.allocators.values())
    data = {a.name: memory_series(a, max_bins) for a in allocs}
    fig = new_figure(10.0, 2.7 * len(allocs) + 1.2)
    axes = fig.subplots(2 * len(allocs), 1, sharex=True,
                        gridspec_kw={"height_ratios": [3.0, 1.3] * len(allocs)})
    axes = np.atleast_1d(axes)
    downsampled = False
    t_max = 0.0
    for i, alloc in enumerate(allocs):
        series = data[alloc.name]
        ax_mem, ax_q = axes[2 * i], axes[2 * i + 1]
        states = series["states"]
        downsampled |= len(states.edges) - 1 < alloc.num_memory_rows
        t_max = max(t_max, float(states.edges[-1]))
        bottom = np.zeros(len(states.mean))
        for j, state in enumerate(STATE_ORDER):
            top = bottom + np.nan_to_num(states.mean[:, j])
            x, lo = _steps(states, bottom * 100)
            _, hi = _steps(states, top * 100)
            ax_mem.fill_between(x, lo, hi, step="post", color=STATE_COLORS[state], linewidth=0)
            _draw_parts(ax_mem, series, alloc.parts, state, bottom)
            bottom = top
        if len(states.edges) - 1 < alloc.num_memory_rows:
            x, peak = _steps(series["used"], series["used"].hi * 100)
            ax_mem.plot(x, peak, drawstyle="steps-post", color="black", linewidth=0.6)
        ax_mem.set_ylim(0, 100)
        ax_mem.set_ylabel("capacity (%)")
        ax_mem.set_title(f"{allocator_label(alloc.name)}: KV memory by state", loc="left",
                         fontsize="medium", color=allocator_color(alloc.name))
        _plot_queues(ax_q, series["queues"], alloc.num_memory_rows)
    axes[-1].set_xlim(0, t_max if t_max > 0 else 1.0)
    axes[-1].set_xlabel(time_label(next(iter(run.allocators.values())).config.get("source")))
    fig.suptitle(figure_title(f"Memory over time: {run.label}", [run]))
    handles = [Patch(color=STATE_COLORS[s]) for s in STATE_ORDER]
    labels = [STATE_LABELS[s] for s in STATE_ORDER]
    drawn = [p for p in PART_OF if any(p in a.parts for a in allocs)]
    for p in drawn:
        handles.insert(labels.index(STATE_LABELS[PART_OF[p]]) + 1, Patch(linewidth=0, **part_style(p)))
        labels.insert(labels.index(STATE_LABELS[PART_OF[p]]) + 1, PART_LABELS[p])
    handles += [Line2D([], [], color=QUEUE_COLORS[q], linestyle=QUEUE_LINESTYLES[q]) for q in QUEUES]
    labels += [QUEUE_LABELS[q] for q in QUEUES]
    if downsampled:
        handles.append(Line2D([], [], color="black", linewidth=0.6))
        labels.append("peak used in bin")
    legend_below(fig, handles, labels, ncol=5)
    return FigureResult(name, fig, data)


def _draw_parts(ax, series: dict[str, Binned], parts: tuple[str, ...], state: str,
                bottom: np.ndarray) -> None:
    """The parts of `state` the run carries, hatched at the foot of its band (which starts at `bottom`)."""
    for k, p in enumerate(parts):
        if PART_OF[p] != state:
            continue
        binned = series["parts"]
        x, lo = _steps(binned, bottom * 100)
        _, hi = _steps(binned, (bottom + np.nan_to_num(binned.mean[:, k])) * 100)
        ax.fill_between(x, lo, hi, step="post", linewidth=0, **part_style(p))


def plot_batch_size(runs: list[Run], max_bins: int = DEFAULT_MAX_BINS) -> FigureResult:
    """Running requests over time: one panel per run, one line (mean, min/max band) per allocator."""
    fig = new_figure(10.0, 2.4 * len(runs) + 1.0)
    axes = np.atleast_1d(fig.subplots(len(runs), 1, squeeze=False)[:, 0])
    data: dict[str, Binned] = {}
    for ax, run in zip(axes, runs, strict=True):
        for alloc in run.allocators.values():
            chunks = ((m["t_s"].to_numpy(float), m["dt_s"].to_numpy(float), m["num_running"].to_numpy(float))
                      for m in alloc.memory_chunks(("t_s", "dt_s", "num_running")))
            binned = downsample_chunks(chunks, alloc.num_memory_rows, alloc.memory_span(), max_bins)
            data[series_label(run, alloc, len(runs) > 1)] = binned
            color = allocator_color(alloc.name)
            mean_bs = alloc.summary.get("mean_batch_size")
            label = allocator_label(alloc.name)
            if mean_bs is not None:
                label += f" (mean {float(mean_bs):.1f})"
            x, y = _steps(binned, binned.mean)
            ax.plot(x, y, drawstyle="steps-post", color=color, linewidth=0.9, label=label,
                    **allocator_marker(alloc.name, len(x)))
            if len(binned.edges) - 1 < alloc.num_memory_rows:
                _, lo = _steps(binned, binned.lo)
                _, hi = _steps(binned, binned.hi)
                ax.fill_between(x, lo, hi, step="post", color=color, alpha=0.2, linewidth=0)
        ax.set_ylabel("running requests")
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        ax.set_title(figure_title(f"Batch size over time: {run.label}", [run]), loc="left", fontsize="medium")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize="small")
        source = next(iter(run.allocators.values())).config.get("source")
        ax.set_xlabel(time_label(source))
    return FigureResult("batch_size", fig, data)

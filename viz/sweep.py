"""Figure 5: sweeps across run folders: normalized latency vs request rate, and the effect of block size.

Only paged allocators have a block size: a contiguous one's summary.json says 1, but it is drawn (and
counted when runs are compared) as having none, so it never makes runs differ in block size.

Only the points of one `pagelab sweep` (run folders in its points/ folder, docs/sweeps.md) are joined into
lines: separate runs may differ in more than the rate or block size (trace, pool, allocator), so a line
through them would show a trend that is not there.

The request rate of a run is the first positive number among: an allocator's config.json keys
`rate`, `request_rate`, `rate_per_s`, then the same keys under config.json `extra`, then the run's
summary.json `trace` keys `rate_override`, `rate`, `request_rate`, `mean_rate_per_s`; else it is
derived from requests.parquet as (number of requests - 1) / (last arrival - first arrival).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from pagelab.run_format import SWEEP_POINTS_DIR
from pagelab.units import latency_unit
from viz.common import FigureResult, legend_below, new_figure, use_log_scale
from viz.load import AllocatorRun, Run
from viz.palette import LINESTYLES, allocator_color, allocator_label

CONFIG_RATE_KEYS = ("rate", "request_rate", "rate_per_s")
TRACE_RATE_KEYS = ("rate_override", "rate", "request_rate", "mean_rate_per_s")


def run_rate(run: Run, alloc: AllocatorRun) -> tuple[float, str]:
    """The request rate (req/s) of a run and where it came from."""
    extra = alloc.config.get("extra") if isinstance(alloc.config.get("extra"), dict) else {}
    places = (("config.json", alloc.config, CONFIG_RATE_KEYS), ("config.json extra", extra, CONFIG_RATE_KEYS),
              ("summary.json trace", run.trace, TRACE_RATE_KEYS))
    for source, table, keys in places:
        for key in keys:
            value = table.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                return float(value), f"{source} '{key}'"
    arrival = np.sort(alloc.requests["arrival_s"].to_numpy(float))
    if len(arrival) > 1 and arrival[-1] > arrival[0]:
        return (len(arrival) - 1) / float(arrival[-1] - arrival[0]), "derived from arrival_s"
    return float("nan"), "unknown"


def paged_block_size(alloc: AllocatorRun) -> float:
    """The block size of a paged allocator; NaN for a contiguous one, whose summary says 1 though it has no
    blocks (so it never makes runs look like they differ in block size, docs/sweeps.md)."""
    return float(alloc.block_size) if alloc.is_paged else float("nan")


# What a point's line is drawn against or split by (the rate, the block size), the line itself (the
# allocator), and what follows from other settings or does not change a result: never a variant.
_NOT_VARIANTS = {"rate", "allocator", "block_size", "extra", "seed", "debug", "mode", "record_events",
                 "capacity_tokens", "bytes_per_token"}


def _variants(configs: list[dict]) -> list[str]:
    """Per run, the settings in which the runs differ ("model mistral-7b-v0.1, max num seqs 64"; "" where
    they differ in none): points that differ in them are not points of one line."""
    keys = sorted({k for c in configs for k in c} - _NOT_VARIANTS)
    keys = [k for k in keys if len({repr(c.get(k)) for c in configs}) > 1]
    if len({repr((c.get("extra") or {}).get("trace")) for c in configs}) > 1:
        configs = [{**c, "trace": (c.get("extra") or {}).get("trace")} for c in configs]
        keys.append("trace")
    return [", ".join(f"{k.replace('_', ' ')} {c.get(k)}" for k in keys) for c in configs]


def sweep_data(runs: list[Run]) -> pd.DataFrame:
    """One row per (run, allocator): rate, block size (NaN when contiguous), the settings it differs in
    (`variant`), normalized latency, batch size, waste."""
    rows = []
    configs = []
    for run in runs:
        for alloc in run.allocators.values():
            rate, rate_source = run_rate(run, alloc)
            latency = alloc.summary.get("normalized_latency_s_per_token")
            if not isinstance(latency, (int, float)):
                latency = float(np.nanmean(alloc.requests["normalized_latency_s"].to_numpy(float)))
            mem = alloc.summary.get("memory") or {}
            waste = sum(float(mem.get(k, np.nan)) for k in
                        ("reservation", "internal_fragmentation", "external_fragmentation"))
            rows.append({"run": run.label, "allocator": alloc.name, "rate": rate, "rate_source": rate_source,
                         "block_size": paged_block_size(alloc), "normalized_latency_s": float(latency),
                         "mean_batch_size": float(alloc.summary.get("mean_batch_size", np.nan)),
                         "waste": waste})
            configs.append(alloc.config)
    return pd.DataFrame(rows).assign(variant=_variants(configs)) if rows else pd.DataFrame(rows)


def _distinct(values: pd.Series) -> int:
    """Number of distinct finite values, to 6 significant digits."""
    v = values.to_numpy(float)
    return len(np.unique(np.round(v[np.isfinite(v)], 6)))


def sweep_of(run: Run) -> Path | None:
    """The points folder of the sweep `run` is a point of, else None: a point sits there and its summary
    names its point_hash (both, so a folder that happens to be called points/ is not taken for one)."""
    parent = run.path.resolve().parent
    return parent if parent.name == SWEEP_POINTS_DIR and "point_hash" in run.trace else None


def sweeps(runs: list[Run], column: str) -> list[list[Run]]:
    """The runs grouped by the sweep they are points of, keeping the groups that differ in `column` ("rate"
    or "block_size"); runs that are no sweep's points join no group."""
    groups: dict[Path, list[Run]] = {}
    for run in runs:
        where = sweep_of(run)
        if where is not None:
            groups.setdefault(where, []).append(run)
    return [g for g in groups.values() if len(g) > 1 and _distinct(sweep_data(g)[column]) > 1]


def applies(runs: list[Run], column: str) -> bool:
    """Whether some of the runs are points of one sweep that differ in `column`, so a sweep figure makes
    sense."""
    return bool(sweeps(runs, column))


def unjoined(runs: list[Run], column: str) -> bool:
    """Whether the runs differ in `column` yet no sweep figure applies (they are not points of one sweep)."""
    return len(runs) > 1 and not applies(runs, column) and _distinct(sweep_data(runs)[column]) > 1


def sweep_label(runs: list[Run]) -> str:
    """The name of the sweep folder the runs are points of."""
    where = sweep_of(runs[0])
    return where.parent.name if where is not None else runs[0].label


def _lines(ax, data: pd.DataFrame, x: str, y: str, other: str) -> tuple[list, list[str]]:
    """One line per allocator (line style per value of `other` when it varies); returns legend parts."""
    # Split lines by `other` only when some split line would still have two or more points.
    split = _distinct(data[other]) > 1 and bool(
        (data.groupby(["allocator", "variant", other])[x].nunique() > 1).any())
    others = sorted(data[other].dropna().unique()) if split else [None]
    handles, labels = [], []
    for (name, variant), group in data.groupby(["allocator", "variant"], sort=False):
        # An allocator without a value of `other` (a contiguous one's block size) is one unsplit line.
        for k, value in enumerate(others if group[other].notna().any() else [None]):
            part = group if value is None else group[group[other] == value]
            part = part.sort_values(x)
            if part.empty:
                continue
            ax.plot(part[x], part[y], marker="o", markersize=4, color=allocator_color(name),
                    linestyle=LINESTYLES[k % len(LINESTYLES)])
            handles.append(Line2D([], [], color=allocator_color(name), marker="o",
                                  linestyle=LINESTYLES[k % len(LINESTYLES)]))
            suffix = "" if value is None else f" ({other.replace('_', ' ')} {value:g})"
            labels.append(allocator_label(name) + suffix + (f", {variant}" if variant else ""))
    if use_log_scale(data[y].to_numpy(float)):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    return handles, labels


def _in_latency_unit(data: pd.DataFrame) -> tuple[str, pd.DataFrame]:
    """The latency unit of the figure (pagelab/units.py) and the data with the latencies in it."""
    unit, per_s = latency_unit(data["normalized_latency_s"].tolist())
    return unit, data.assign(normalized_latency_s=data["normalized_latency_s"] * per_s)


def plot_sweep_latency(runs: list[Run], name: str = "sweep_latency") -> FigureResult:
    """Normalized latency against request rate, one line per allocator (vLLM Fig. 12 shape)."""
    data = sweep_data(runs)
    unit, shown = _in_latency_unit(data)
    fig = new_figure(6.5, 4.6)
    ax = fig.subplots()
    handles, labels = _lines(ax, shown, "rate", "normalized_latency_s", "block_size")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(f"normalized latency ({unit}/token)")
    ax.set_title("Normalized latency vs request rate")
    legend_below(fig, handles, labels, ncol=2)
    return FigureResult(name, fig, data)


def plot_block_size_sweep(runs: list[Run], name: str = "block_size_sweep") -> FigureResult:
    """Normalized latency and wasted memory share against block size, one line per paged allocator."""
    data = sweep_data(runs)
    data = data[np.isfinite(data["block_size"].to_numpy(float))]  # contiguous allocators have no block size
    unit, shown = _in_latency_unit(data)
    fig = new_figure(10.0, 4.4)
    ax_lat, ax_waste = fig.subplots(1, 2)
    handles, labels = _lines(ax_lat, shown, "block_size", "normalized_latency_s", "rate")
    data_pct = data.assign(waste=data["waste"] * 100)
    _lines(ax_waste, data_pct, "block_size", "waste", "rate")
    sizes = sorted(int(b) for b in data["block_size"].unique())
    for ax in (ax_lat, ax_waste):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("block size (tokens)")
    ax_lat.set_ylabel(f"normalized latency ({unit}/token)")
    ax_lat.set_title("Normalized latency vs block size")
    ax_waste.set_ylabel("reserved + fragmented (% of capacity)")
    ax_waste.set_title("Wasted KV memory vs block size")
    legend_below(fig, handles, labels, ncol=4)
    return FigureResult(name, fig, data)

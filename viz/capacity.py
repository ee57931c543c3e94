"""Figures from a sweep folder's tables (pagelab sweep): the paper's Fig. 12 and the max-rate bars.

Reads only sweep.parquet, max_rates.parquet and summary.json (docs/sweeps.md), never the simulator.
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from pagelab.run_format import sweep_axis_applies
from pagelab.units import latency_unit
from viz.common import FORMATS, FigureResult, legend_below, new_figure, save_figure
from viz.errors import VizError
from viz.palette import LINESTYLES, allocator_color, allocator_label, allocator_sort_key

# Columns of sweep.parquet that describe the point's metrics rather than its configuration.
METRIC_COLUMNS = {"rate", "kind", "slo_value", "met_slo", "normalized_latency_s", "ttft_p50_s", "ttft_p99_s",
                  "tpot_p50_s", "tpot_p99_s", "e2e_p99_s", "throughput_tokens_per_s", "mean_batch_size",
                  "num_requests", "num_finished", "num_preemptions", "capacity_tokens", "folder",
                  "point_hash", "block_size", "error"}
LABEL_CHARS = 34  # a bar's configuration wraps after this many characters a line
SLO_LABELS = {"norm_latency": "normalized latency (s/token)", "ttft_p99": "TTFT p99 (s)",
              "tpot_p99": "TPOT p99 (s)"}


def load_sweep(folder: Path) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """The point table, the max-rate table and the summary of a sweep folder."""
    folder = Path(folder)
    try:
        points = pd.read_parquet(folder / "sweep.parquet")
        max_rates = pd.read_parquet(folder / "max_rates.parquet")
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError) as exc:
        raise VizError(f"{folder}: not a complete sweep folder ({exc})") from None
    return points, max_rates, summary


def _variant_columns(table: pd.DataFrame) -> list[str]:
    """Configuration axes other than the allocator that take more than one value.

    block_size counts only when one allocator has several (contiguous allocators report 1, paged 16).
    """
    cols = [c for c in table.columns if c not in METRIC_COLUMNS and c != "allocator"
            and table[c].nunique(dropna=False) > 1]
    if "block_size" in table and (table.groupby("allocator")["block_size"].nunique() > 1).any():
        cols.append("block_size")
    return cols


def _variant_label(row: pd.Series, cols: list[str]) -> str:
    cols = [c for c in cols if sweep_axis_applies(c, row["allocator"])]  # block_size: the first one it ran at
    return ", ".join(f"{c.replace('_', ' ')} {row[c]:g}" if isinstance(row[c], (int, float, np.number))
                     else f"{c.replace('_', ' ')} {row[c]}" for c in cols)


def plot_latency_vs_rate(points: pd.DataFrame, summary: dict | None = None,
                         metric: str = "normalized_latency_s") -> FigureResult:
    """Normalized latency against request rate, one line per allocator (vLLM Fig. 12), SLO dashed; latencies
    in one unit (pagelab/units.py)."""
    unit, per_s = latency_unit(points[metric].tolist())
    if "error" in points:
        points = points[points["error"].isna()]  # a failed point has no latency to draw
    fig = new_figure(6.5, 4.6)
    ax = fig.subplots()
    variants = _variant_columns(points)
    handles, labels = [], []
    groups = points.groupby(["allocator", *variants], sort=False, dropna=False)
    ordered = sorted(groups, key=lambda g: (allocator_sort_key(g[0][0]), str(g[0][1:])))
    styles: dict[tuple, str] = {}
    for key, group in ordered:
        name = key[0]
        style = styles.setdefault(tuple(key[1:]), LINESTYLES[len(styles) % len(LINESTYLES)])
        part = group.sort_values("rate")
        (line,) = ax.plot(part["rate"], part[metric] * per_s, marker="o", markersize=3,
                          color=allocator_color(name), linestyle=style)
        handles.append(line)
        extra = _variant_label(part.iloc[0], variants)
        labels.append(allocator_label(name) + (f" ({extra})" if extra else ""))
    slo = (summary or {}).get("slo") or {}
    if slo.get("metric") == "norm_latency" and metric == "normalized_latency_s":
        ax.axhline(slo["bound"] * per_s, color="grey", linestyle="--", linewidth=1)
        handles.append(ax.lines[-1])
        labels.append(f"SLO {slo['bound'] * per_s:g} {unit}/token")
    finite = points[metric].to_numpy(float) * per_s
    finite = finite[np.isfinite(finite) & (finite > 0)]
    if len(finite):
        # Like the paper (1 s/token), clip the exploding tail so the knees stay readable: 5x the SLO
        # bound when it is on this metric, else 20x the unloaded (smallest) latency.
        has_bound = slo.get("metric") == "norm_latency" and metric == "normalized_latency_s"
        cap = 5 * slo["bound"] * per_s if has_bound else 20 * finite.min()
        ax.set_ylim(0, min(finite.max(), cap) * 1.05)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(f"normalized latency ({unit}/token)")
    ax.set_title(f"Normalized latency vs request rate ({(summary or {}).get('trace', 'sweep')})")
    ax.grid(alpha=0.3)
    legend_below(fig, handles, labels, ncol=2)
    return FigureResult("sweep_fig12", fig, points)


def _bar_label(name: str, row: pd.Series, variants: list[str]) -> str:
    """A bar's name: the allocator, then its configuration wrapped over lines of at most LABEL_CHARS."""
    extra = _variant_label(row, variants) if variants else ""
    return allocator_label(name) + ("\n" + textwrap.fill(extra, LABEL_CHARS) if extra else "")


def plot_max_rates(max_rates: pd.DataFrame, summary: dict | None = None) -> FigureResult:
    """Maximum sustainable rate per configuration, annotated with paged's advantage (paged / other).

    The bars are horizontal, one row per configuration from the top: a configuration's name ("paged (vLLM)",
    kv cache dtype, block size, ...) is wider than a vertical bar, and a row can be as wide as it needs.
    """
    table = max_rates.copy()
    table["_order"] = [allocator_sort_key(a) for a in table["allocator"]]
    table = table.sort_values("_order", kind="stable").drop(columns="_order").reset_index(drop=True)
    variants = [c for c in _variant_columns(table) if c not in ("max_rate", "first_miss_rate", "status",
                                                                "monotone", "runs", "search_runs",
                                                                "paged_advantage")]
    names = [_bar_label(row["allocator"], row, variants) for _, row in table.iterrows()]
    lines = max(n.count("\n") + 1 for n in names) if names else 1
    fig = new_figure(7.5, max(3.2, 1.6 + len(table) * (0.25 + 0.17 * lines)))
    ax = fig.subplots()
    widths = table["max_rate"].astype(float).fillna(0).to_numpy()
    y = np.arange(len(table))
    ax.barh(y, widths, height=0.7, color=[allocator_color(a) for a in table["allocator"]])
    for i, row in table.iterrows():
        if row["status"] == "below_range":
            text = "below range"
        else:
            text = f"{widths[i]:.3g}" + ("+" if row["status"] == "above_range" else "")
            adv = row.get("paged_advantage")
            if row["allocator"] != "paged" and adv is not None and np.isfinite(adv):
                text += f"\npaged {adv:.2f}x"
        ax.annotate(text, (widths[i], i), ha="left", va="center", fontsize="small",
                    xytext=(3, 0), textcoords="offset points")
    ax.set_yticks(y, names, fontsize="small")
    ax.invert_yaxis()  # paged first, at the top
    ax.set_xlim(0, max(widths.max() if len(widths) else 0, 1e-9) * 1.3)  # room for the numbers
    ax.set_xlabel("max sustainable rate (req/s)")
    slo = ((summary or {}).get("slo") or {}).get("text", "")
    ax.set_title(f"Capacity under the SLO {slo}".strip())
    ax.grid(axis="x", alpha=0.3)
    return FigureResult("sweep_max_rates", fig, table)


def plot_sweep_folder(folder: Path, out: Path, fmt: str = "png") -> list[Path]:
    """Draw the Fig. 12 lines and the max-rate bars of a sweep folder into `out`."""
    if fmt not in FORMATS:
        raise VizError(f"format '{fmt}' is not one of {', '.join(FORMATS)}")
    points, max_rates, summary = load_sweep(folder)
    written = []
    for result in (plot_latency_vs_rate(points, summary), plot_max_rates(max_rates, summary)):
        written.append(save_figure(result.figure, Path(out) / f"{result.name}.{fmt}", fmt))
    return written

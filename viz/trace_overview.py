"""Figure 6: a trace at a glance: arrival rate over time and prompt/output length distributions."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from viz.common import FORMATS, FigureResult, new_figure, save_figure
from viz.errors import VizError
from viz.load import check_columns

TRACE_COLUMNS = ("request_id", "arrival_s", "prompt_len", "output_len")
MAX_RATE_BINS = 200
LENGTH_BINS = 50


def trace_overview_data(df: pd.DataFrame) -> dict[str, np.ndarray]:
    """Arrival-rate bins (edges, req/s) and log-spaced length histograms (edges, counts)."""
    check_columns(df, TRACE_COLUMNS, "trace table")
    arrival = df["arrival_s"].to_numpy(float)
    if len(arrival) == 0:
        raise VizError("trace table: no rows to plot")
    t0, t1 = float(np.nanmin(arrival)), float(np.nanmax(arrival))
    nbins = int(np.clip(np.sqrt(len(arrival)), 1, MAX_RATE_BINS))
    rate_edges = np.linspace(t0, t1 if t1 > t0 else t0 + 1.0, nbins + 1)
    counts, _ = np.histogram(arrival, rate_edges)
    data = {"rate_edges": rate_edges, "rate": counts / np.diff(rate_edges)}
    for col in ("prompt_len", "output_len"):
        lengths = df[col].to_numpy(float)
        lengths = lengths[np.isfinite(lengths) & (lengths >= 1)]
        hi = max(2.0, float(lengths.max())) if len(lengths) else 2.0
        edges = np.logspace(0, np.log10(hi) + 1e-9, LENGTH_BINS + 1)
        data[f"{col}_edges"], data[f"{col}_counts"] = edges, np.histogram(lengths, edges)[0]
        data[f"{col}_mean"] = np.array(lengths.mean() if len(lengths) else np.nan)
    return data


def plot_trace_overview(df: pd.DataFrame, title: str = "Trace overview") -> FigureResult:
    """Three panels: arrivals per second over time, prompt length and output length histograms."""
    data = trace_overview_data(df)
    fig = new_figure(12.0, 3.8)
    ax_rate, ax_prompt, ax_out = fig.subplots(1, 3)
    edges, rate = data["rate_edges"], data["rate"]
    mean_rate = len(df) / max(edges[-1] - edges[0], 1e-12)
    ax_rate.stairs(rate, edges, fill=True, color="#4477AA", alpha=0.8)
    ax_rate.axhline(mean_rate, color="black", linewidth=0.8, linestyle="--")
    ax_rate.set_xlabel("arrival time (s)")
    ax_rate.set_ylabel("arrival rate (req/s)")
    ax_rate.set_title(f"Arrivals: {len(df):,} requests\nmean {mean_rate:.2f} req/s (dashed)")
    for ax, col, colour, name in ((ax_prompt, "prompt_len", "#228833", "Prompt"),
                                  (ax_out, "output_len", "#AA3377", "Output")):
        ax.stairs(data[f"{col}_counts"], data[f"{col}_edges"], fill=True, color=colour, alpha=0.8)
        ax.set_xscale("log")
        ax.set_xlabel(f"{name.lower()} length (tokens)")
        ax.set_ylabel("requests per bin")
        ax.set_title(f"{name} lengths (mean {float(data[f'{col}_mean']):.1f})")
    fig.suptitle(title)
    return FigureResult("trace_overview", fig, data)


def save_trace_overview(df: pd.DataFrame, out: Path, fmt: str = "png") -> Path:
    """Draw the trace overview into `out` (a folder, or a file path ending in .png/.svg/.pdf)."""
    if fmt not in FORMATS:
        raise VizError(f"format '{fmt}' is not one of {', '.join(FORMATS)}")
    out = Path(out)
    path = out if out.suffix.lstrip(".") in FORMATS else out / f"trace_overview.{fmt}"
    result = plot_trace_overview(df)
    return save_figure(result.figure, path, path.suffix.lstrip("."))

"""Figure 6: a trace at a glance: arrival rate over time and prompt/output length distributions."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from traces.stats import mean_rate
from viz.common import FORMATS, FigureResult, new_figure, save_figure
from viz.errors import VizError
from viz.load import check_columns

TRACE_COLUMNS = ("request_id", "arrival_s", "prompt_len", "output_len")
MAX_RATE_BINS = 200
LENGTH_BINS = 50


def trace_overview_data(df: pd.DataFrame) -> dict[str, np.ndarray]:
    """Arrival-rate bins (edges, req/s; none when every request arrives at once), the mean rate as `trace
    info` gives it (NaN when it has none) and log-spaced length histograms (edges, counts)."""
    check_columns(df, TRACE_COLUMNS, "trace table")
    arrival = df["arrival_s"].to_numpy(float)
    if len(arrival) == 0:
        raise VizError("trace table: no rows to plot")
    t0, t1 = float(np.nanmin(arrival)), float(np.nanmax(arrival))
    rate = mean_rate(arrival)
    data = {"mean_rate": np.array(np.nan if rate is None else rate), "first_arrival_s": np.array(t0)}
    if t1 > t0:
        nbins = int(np.clip(np.sqrt(len(arrival)), 1, MAX_RATE_BINS))
        rate_edges = np.linspace(t0, t1, nbins + 1)
        counts, _ = np.histogram(arrival, rate_edges)
        data |= {"rate_edges": rate_edges, "rate": counts / np.diff(rate_edges)}
    else:  # one request, or a burst: no time span to spread them over, so no rate to draw
        data |= {"rate_edges": np.empty(0), "rate": np.empty(0)}
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
    _draw_arrivals(ax_rate, data, len(df))
    for ax, col, colour, name in ((ax_prompt, "prompt_len", "#228833", "Prompt"),
                                  (ax_out, "output_len", "#AA3377", "Output")):
        ax.stairs(data[f"{col}_counts"], data[f"{col}_edges"], fill=True, color=colour, alpha=0.8)
        ax.set_xscale("log")
        ax.set_xlabel(f"{name.lower()} length (tokens)")
        ax.set_ylabel("requests per bin")
        ax.set_title(f"{name} lengths (mean {float(data[f'{col}_mean']):.1f})")
    fig.suptitle(title)
    return FigureResult("trace_overview", fig, data)


def _draw_arrivals(ax, data: dict[str, np.ndarray], num: int) -> None:
    """The arrival rate over time with its mean dashed, or a note when all requests arrive at one time."""
    requests = f"{num:,} request{'s' if num != 1 else ''}"
    if len(data["rate"]) == 0:
        at = f"t = {float(data['first_arrival_s']):g} s"
        ax.set_xticks([])
        ax.set_yticks([])
        ax.text(0.5, 0.5, f"{'all arrive' if num > 1 else 'arrives'} at\n{at}\n(no arrival rate)",
                transform=ax.transAxes, ha="center", va="center")
        ax.set_title(f"Arrivals: {requests}\n{'a burst' if num > 1 else 'a single request'}")
        return
    ax.stairs(data["rate"], data["rate_edges"], fill=True, color="#4477AA", alpha=0.8)
    ax.axhline(float(data["mean_rate"]), color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("arrival rate (req/s)")
    # The mean as `trace info` prints it: (requests - 1) / span, to the same 3 decimals.
    ax.set_title(f"Arrivals: {requests}\nmean {float(data['mean_rate']):,.3f} req/s (dashed)")


def save_trace_overview(df: pd.DataFrame, out: Path, fmt: str = "png") -> Path:
    """Draw the trace overview into `out` (a folder, or a file path ending in .png/.svg/.pdf)."""
    if fmt not in FORMATS:
        raise VizError(f"format '{fmt}' is not one of {', '.join(FORMATS)}")
    out = Path(out)
    path = out if out.suffix.lstrip(".") in FORMATS else out / f"trace_overview.{fmt}"
    result = plot_trace_overview(df)
    return save_figure(result.figure, path, path.suffix.lstrip("."))

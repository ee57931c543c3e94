"""The hit-ratio-versus-capacity curve of a trace's prefix reuse (`pagelab trace reuse --plot`)."""
from __future__ import annotations

from pathlib import Path

from viz.common import figure_format, new_figure, save_figure


def save_reuse_curve(report: dict, out: Path, title: str = "Prefix reuse") -> Path:
    """Draw the LRU curve of a reuse report, with the other policies at the requested capacities."""
    fmt = figure_format(out)
    fig = new_figure(6.4, 4.2)
    ax = fig.subplots()
    curve = report["lru_curve"]
    ax.plot(curve["capacity_tokens"], curve["hit_ratio"], color="#4477AA", label="LRU (stack distances)")
    ax.axhline(report["infinite"]["hit_ratio"], color="black", linewidth=0.8, linestyle="--",
               label="infinite cache")
    markers = {"lru": "o", "lfu": "s", "s3fifo": "^"}
    for name, marker in markers.items():
        pts = [(row["capacity_tokens"], row[name]["hit_ratio"])
               for row in report["capacities"] if name in row]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.scatter(xs, ys, marker=marker, zorder=3, label=name.upper())
    ax.set_xscale("log")
    ax.set_ylim(0, 1)
    ax.set_xlabel("prefix cache capacity (tokens)")
    ax.set_ylabel("prefix blocks hit / queried")
    ax.set_title(f"{title} (block size {report['block_size']})")
    ax.legend(loc="upper left", fontsize=8)
    return save_figure(fig, Path(out), fmt)

"""Figure 1: where KV memory goes, one stacked bar per allocator (vLLM Fig. 2 style)."""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from viz.common import FigureResult, new_figure
from viz.load import Run
from viz.palette import STATE_COLORS, STATE_LABELS, STATE_ORDER, allocator_label
from viz.titles import figure_title

MIN_LABELLED_SHARE = 0.025  # segments thinner than this get no text (it would not fit)


def breakdown_data(runs: list[Run]) -> pd.DataFrame:
    """Time-weighted memory fractions per bar: columns run, allocator, label and the five states."""
    multi = len(runs) > 1
    rows = []
    for run in runs:
        for name, alloc in run.allocators.items():
            fractions = alloc.memory_fractions()
            label = f"{run.label}\n{allocator_label(name)}" if multi else allocator_label(name)
            rows.append({"run": run.label, "allocator": name, "label": label, **fractions})
    return pd.DataFrame(rows, columns=["run", "allocator", "label", *STATE_ORDER])


def plot_breakdown(runs: list[Run]) -> FigureResult:
    """Stacked bars of the five memory states (token states at the bottom), labelled in percent."""
    data = breakdown_data(runs)
    n = len(data)
    fig = new_figure(max(5.0, 1.15 * n + 3.2), 4.6)
    ax = fig.subplots()
    x = np.arange(n)
    bottom = np.zeros(n)
    for state in STATE_ORDER:
        share = data[state].to_numpy(dtype=float)
        ax.bar(x, share * 100, 0.62, bottom=bottom * 100, color=STATE_COLORS[state],
               edgecolor="white", linewidth=0.6, label=STATE_LABELS[state])
        for xi, b, s in zip(x, bottom, share, strict=True):
            if s >= MIN_LABELLED_SHARE:
                dark = state in ("token_states", "internal_fragmentation")
                ax.text(xi, (b + s / 2) * 100, f"{s * 100:.1f}%", ha="center", va="center",
                        fontsize="small", color="white" if dark else "black")
        bottom = bottom + share
    ax.set_xticks(x, data["label"], fontsize="small")
    ax.set_ylim(0, 100)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylabel("share of KV cache capacity (%)")
    ax.set_title(figure_title("KV cache memory breakdown (time-weighted)", runs), fontsize="medium")
    handles = [Patch(color=STATE_COLORS[s]) for s in reversed(STATE_ORDER)]
    fig.legend(handles, [STATE_LABELS[s] for s in reversed(STATE_ORDER)], loc="outside right center",
               frameon=False, fontsize="small")
    return FigureResult("breakdown", fig, data)

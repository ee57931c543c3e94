"""Figure 1: where KV memory goes, one stacked bar per allocator (vLLM Fig. 2 style)."""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.font_manager import FontProperties
from matplotlib.patches import Patch
from matplotlib.textpath import TextToPath

from viz.common import FigureResult, break_long_words, new_figure
from viz.load import Run
from viz.palette import (
    PART_LABELS,
    PART_OF,
    STATE_COLORS,
    STATE_LABELS,
    STATE_ORDER,
    allocator_label,
    part_style,
)
from viz.titles import figure_title

MIN_LABELLED_SHARE = 0.025  # segments thinner than this get no text (it would not fit)
BAR_SPACING_IN = 1.15  # figure width per bar, unless its tick label needs more
LABEL_CHARS = 18  # a tick label's longer words are broken at this width
TICK_FONT = FontProperties(size="small")


def tick_label(run_label: str | None, allocator: str) -> str:
    """A bar's tick label on short lines: run label (when several runs), then the allocator's name with
    its variant on a line of its own ('contiguous' over '(Pow2)'), so neighbouring labels never run
    together."""
    name = allocator_label(allocator).replace(" (", "\n(")
    return break_long_words(name if run_label is None else f"{run_label}\n{name}", LABEL_CHARS)


def text_width_in(text: str, font: FontProperties) -> float:
    """Width in inches of the widest line of `text` in `font`."""
    measure = TextToPath()
    return max(measure.get_text_width_height_descent(line, font, ismath=False)[0]
               for line in text.split("\n")) / 72.0


def breakdown_data(runs: list[Run]) -> pd.DataFrame:
    """Time-weighted memory fractions per bar: columns run, allocator, label and the five states, then the
    parts of states (PART_STATES) that some bar's run carries (0 for the bars of runs without them)."""
    multi = len(runs) > 1
    rows, parts = [], []
    for run in runs:
        for name, alloc in run.allocators.items():
            fractions = {**alloc.memory_fractions(), **alloc.part_fractions()}
            parts += [p for p in alloc.parts if p not in parts]
            label = f"{run.label}\n{allocator_label(name)}" if multi else allocator_label(name)
            rows.append({"run": run.label, "allocator": name, "label": label, **fractions})
    data = pd.DataFrame(rows, columns=["run", "allocator", "label", *STATE_ORDER, *parts])
    return data.fillna(dict.fromkeys(parts, 0.0))


def _legend_entries(parts: list[str]) -> tuple[list[Patch], list[str]]:
    """Legend handles and labels: states top to bottom, each followed by the parts drawn inside it."""
    handles, labels = [], []
    for s in reversed(STATE_ORDER):
        handles.append(Patch(color=STATE_COLORS[s]))
        labels.append(STATE_LABELS[s])
        for part in (p for p in parts if PART_OF[p] == s):
            handles.append(Patch(linewidth=0, **part_style(part)))
            labels.append(PART_LABELS[part])
    return handles, labels


def figure_width(tick_labels: list[str], legend_labels: list[str]) -> float:
    """Inches for the bars, each as wide as its tick label needs, plus the y axis and the legend beside."""
    spacing = max([BAR_SPACING_IN] + [text_width_in(t, TICK_FONT) + 0.3 for t in tick_labels])
    legend = max(text_width_in(t, TICK_FONT) for t in legend_labels) + 0.7  # swatch and padding
    return max(5.0, 1.0 + spacing * len(tick_labels) + legend)


def plot_breakdown(runs: list[Run]) -> FigureResult:
    """Stacked bars of the five memory states (token states at the bottom), labelled in percent; the
    parts of states a run carries are hatched at the foot of their state's segment."""
    data = breakdown_data(runs)
    parts = [c for c in data.columns if c in PART_OF]
    n = len(data)
    handles, labels = _legend_entries(parts)
    ticks = [tick_label(run if len(runs) > 1 else None, alloc)
             for run, alloc in zip(data["run"], data["allocator"], strict=True)]
    fig = new_figure(figure_width(ticks, labels), 4.6)
    ax = fig.subplots()
    x = np.arange(n)
    bottom = np.zeros(n)
    for state in STATE_ORDER:
        share = data[state].to_numpy(dtype=float)
        ax.bar(x, share * 100, 0.62, bottom=bottom * 100, color=STATE_COLORS[state],
               edgecolor="white", linewidth=0.6, label=STATE_LABELS[state])
        for part in (p for p in parts if PART_OF[p] == state):
            ax.bar(x, data[part].to_numpy(dtype=float) * 100, 0.62, bottom=bottom * 100, linewidth=0,
                   label=PART_LABELS[part], **part_style(part))
        for xi, b, s in zip(x, bottom, share, strict=True):
            if s >= MIN_LABELLED_SHARE:
                dark = state in ("token_states", "internal_fragmentation")
                ax.text(xi, (b + s / 2) * 100, f"{s * 100:.1f}%", ha="center", va="center",
                        fontsize="small", color="white" if dark else "black")
        bottom = bottom + share
    ax.set_xticks(x, ticks, fontproperties=TICK_FONT)
    ax.set_ylim(0, 100)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylabel("share of KV cache capacity (%)")
    ax.set_title(figure_title("KV cache memory breakdown (time-weighted)", runs), fontsize="medium")
    fig.legend(handles, labels, loc="outside right center", frameon=False, fontsize="small")
    return FigureResult("breakdown", fig, data)

"""Figure plumbing shared by the figure modules: creation, atomic saving, legends, axis helpers."""
from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from pagelab.atomic import atomic_write, remove_stale_temp_dirs
from pagelab.writes import open_out
from viz.errors import VizError
from viz.palette import OWNER_LEGEND, SHARED_HATCH

FORMATS = ("png", "svg", "pdf")
DPI = 130


@dataclass(frozen=True)
class FigureResult:
    """A drawn figure, the file stem it is saved under, and the data it drew (for tests)."""

    name: str
    figure: Figure
    data: Any


class TitledFigure(Figure):
    """A Figure whose titles wrap at its edges when drawn, at any size it is drawn at.

    A title that names the run (viz/titles.py) can be longer than a narrow figure is wide; unwrapped, it
    would run off both edges. Words wrap at spaces; a word longer than a line (a long trace file name) is
    broken after a '-', '_', '.' or '/' near the end of the line.
    """

    def draw(self, renderer) -> None:
        """Wrap the suptitle and every axes title, then draw (the layout sees the wrapped titles)."""
        titles = [self._suptitle]
        titles += [t for ax in self.axes for t in (ax.title, ax._left_title, ax._right_title)]
        for title in titles:
            if title is None or not title.get_text():
                continue
            char_px = 0.62 * title.get_fontsize() * self.dpi / 72
            title.set_text(break_long_words(title.get_text(), max(12, int(0.9 * self.bbox.width / char_px))))
            title.set_wrap(True)
        super().draw(renderer)


def break_long_words(text: str, width: int) -> str:
    """`text` with every word longer than `width` characters split over lines, after a separator when one
    falls in the last third of the piece."""
    def pieces(word: str):
        while len(word) > width:
            window = word[:width]
            cut = max((window.rfind(c) + 1 for c in "-_./"), default=0)
            cut = cut if cut > width * 2 // 3 else width
            yield word[:cut]
            word = word[cut:]
        yield word

    return "\n".join(" ".join("\n".join(pieces(w)) for w in line.split(" ")) for line in text.split("\n"))


def new_figure(width: float, height: float) -> Figure:
    """A Figure on the Agg canvas, independent of pyplot's global state."""
    fig = TitledFigure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def figure_format(path: Path) -> str:
    """The format a figure's path names by its suffix (png without one); refused unless in FORMATS."""
    return format_named(Path(path).suffix or "png", path)


def format_named(name: str, where: object) -> str:
    """A figure format as FORMATS spells it (any case, a leading dot allowed); VizError naming `where`."""
    fmt = name.lower().lstrip(".")
    if fmt not in FORMATS:
        raise VizError(f"{where}: format '{fmt}' is not one of {', '.join(FORMATS)}")
    return fmt


def save_figure(fig: Figure, path: Path, fmt: str) -> Path:
    """Save under a temporary name in the same folder, then rename into place."""
    def write(tmp: Path) -> None:
        with open_out(tmp) as f:
            fig.savefig(f, format=fmt, dpi=DPI)

    return atomic_write(path, write, suffix=f".{fmt}")


@contextlib.contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """Yield a new hidden folder to write files into; when the block completes, move them into `out`
    (made only then, and only when there is a file), so a command that fails part way leaves `out` and
    the folders above it as they were. Other files already in `out` stay."""
    out = Path(out)  # as given: a write error names the destination the way the user did
    base = out.parent
    while not base.is_dir() and base != base.parent:
        base = base.parent  # the folders above `out` are made at the end too
    remove_stale_temp_dirs(base / out.name)  # the staging folders of writers killed before cleaning up
    # atomic_dir's naming, so that those cleanups recognise a killed writer's folder
    tmp = base / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(mode=0o777)
    try:
        yield tmp
        files = sorted(tmp.iterdir())
        if files and not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # `out` made meanwhile: moved a file at a time below
                tmp.rename(out)
                return
        if files:
            out.mkdir(parents=True, exist_ok=True)
        for f in files:
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def legend_below(fig: Figure, handles: list, labels: list[str], ncol: int | None = None) -> None:
    """One legend for the whole figure, under the axes so it never covers data.

    Columns are capped so the rows fit the figure width (about 0.06 in per character at small size).
    """
    if not handles:
        return
    entry_in = 0.45 + 0.062 * max(len(label) for label in labels)
    fits = max(1, int(fig.get_figwidth() / entry_in))
    ncol = min(ncol or 5, fits, len(labels))
    fig.legend(handles, labels, loc="outside lower center", ncol=ncol, frameon=False, fontsize="small",
               handler_map=OWNER_LEGEND)


def hatch_shared(ax, ref_count: np.ndarray, x_edges: np.ndarray, y_edges: np.ndarray) -> dict[int, bool]:
    """Hatch the cells of an image (rows x cols) whose ref count is 2, or 3 and more; returns which exist.

    Each cell is sampled just inside its two edges so hatch borders fall on cell borders.
    """
    present = {2: bool(np.any(ref_count == 2)), 3: bool(np.any(ref_count >= 3))}
    if not any(present.values()):
        return present
    def inside(edges: np.ndarray) -> np.ndarray:
        width = np.diff(edges) * 1e-3
        return np.column_stack([edges[:-1] + width, edges[1:] - width]).ravel()
    levels = np.repeat(np.repeat(np.minimum(ref_count, 3), 2, axis=0), 2, axis=1)
    ax.contourf(inside(np.asarray(x_edges, float)), inside(np.asarray(y_edges, float)), levels,
                levels=[1.5, 2.5, 3.5], hatches=[SHARED_HATCH[2], SHARED_HATCH[3]], colors="none")
    return present


def shared_legend(present: dict[int, bool]) -> tuple[list, list[str]]:
    """Legend handles and labels for the hatches drawn by hatch_shared."""
    handles, labels = [], []
    for ref, text in ((2, "shared block, ref count 2"), (3, "shared block, ref count >= 3")):
        if present[ref]:
            handles.append(Patch(facecolor="white", edgecolor="black", hatch=SHARED_HATCH[ref], linewidth=0))
            labels.append(text)
    return handles, labels


def use_log_scale(values: np.ndarray, decades: float = 2.0) -> bool:
    """Whether positive data span more than `decades` orders of magnitude (then log axes read better)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    return len(v) > 1 and np.log10(v.max() / v.min()) > decades


def time_label(source: str | None) -> str:
    """x-axis label for run time, honest about simulated vs measured clocks."""
    return "measured time (s)" if source == "replay" else "simulated time (s)"


def safe_stem(text: str) -> str:
    """A file-name-safe version of a run label."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)

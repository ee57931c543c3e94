"""Figure 3: block maps, the KV pool as an image (pool position x time), one panel per allocator."""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch

from viz.common import FigureResult, hatch_shared, legend_below, new_figure, shared_legend, time_label
from viz.errors import VizError
from viz.load import AllocatorRun, Run
from viz.palette import (
    FREE_RGB,
    OWNER_FAMILY,
    STATE_COLORS,
    STATE_LABELS,
    OwnerSwatch,
    allocator_color,
    allocator_label,
    owner_rgb,
)
from viz.raster import OwnerRaster, rasterize_owners
from viz.snapshot import peak_time
from viz.titles import figure_title

DEFAULT_TIME_BINS = 400  # about one image column per screen pixel of a panel
MIN_TIME_BINS = 100
CONTESTED_BUDGET = 2_500_000  # partly covered (cell, tenure) entries one raster may sort
NEAREST_MAX_ROWS = 600   # taller images are shrunk on screen: blend rows instead of skipping them
DEFAULT_MAX_ROWS = 512
# Beyond this only an early time window is drawn: the figure's time grows with the tenures it draws.
MAX_TENURES = 2_000_000
# Never-filled slots are internal fragmentation: drawn in its state colour, as in the snapshot and the
# breakdown, not as a lighter owner colour (which has no single legend swatch and means "reserved" there).
UNFILLED_RGB = to_rgb(STATE_COLORS["internal_fragmentation"])
ZOOM_LIFETIMES = 8       # zoom window width in median request lifetimes
ZOOM_MAX_SHARE = 0.25    # no zoom row when the window would cover more of the run than this


def run_end_time(run: Run) -> float:
    """End of the run: the longest sim_duration_s, else the latest tenure end."""
    ends = [float(a.summary["sim_duration_s"]) for a in run.allocators.values()
            if isinstance(a.summary.get("sim_duration_s"), (int, float))]
    if not ends:
        ends = [float(a.events["t_end_s"].max()) for a in run.allocators.values() if len(a.events)]
    return max(ends) if ends and max(ends) > 0 else 1.0


def row_slots_for(alloc: AllocatorRun, max_rows: int) -> int:
    """Slots per image row, at most `max_rows` rows; a paged block never straddles two rows.

    Paged pools use whole blocks per row, or a divisor of the block size when the pool is small
    enough to show more detail (so never-filled tails inside a block stay visible).
    """
    cap = alloc.capacity_slots
    if not alloc.is_paged:
        return max(1, -(-cap // max_rows))
    bs = alloc.block_size
    for d in (d for d in range(1, bs + 1) if bs % d == 0):
        if -(-cap // d) <= max_rows:
            return d
    num_blocks = -(-cap // bs)
    return bs * -(-num_blocks // max_rows)


def tenure_window(alloc: AllocatorRun, t_end: float) -> float:
    """The drawn time span: the whole run, or an early window holding about MAX_TENURES tenures."""
    if alloc.num_events <= MAX_TENURES:
        return t_end
    early = alloc.early_events_end(MAX_TENURES)  # row-group statistics of a release-ordered file
    if early is not None:
        return min(early, t_end)
    starts = np.sort(alloc.events["t_start_s"].to_numpy(float))
    return float(starts[MAX_TENURES])


def time_bins_for(events: pd.DataFrame, capacity: int, row_slots: int, t_start: float, t_end: float,
                  num_bins: int) -> int:
    """Time bins for a raster: `num_bins`, or fewer when the exact majority would cost too much.

    Fewer (never under MIN_TIME_BINS) when more than CONTESTED_BUDGET partly covered cells would
    have to be sorted. A tenure covering only part of a row is contested in every bin it spans, so
    the work grows with bins x lifetime for pools scattered over many rows (paged blocks in big pools).
    """
    span_s = t_end - t_start
    if len(events) == 0 or span_s <= 0:
        return num_bins
    start = events["start"].to_numpy(np.int64)
    end = np.minimum(start + events["size"].to_numpy(np.int64), capacity)
    rows = np.maximum((end - 1) // row_slots - start // row_slots + 1, 1)
    partial = np.minimum(rows, (start % row_slots != 0).astype(np.int64)
                         + ((end % row_slots != 0) & (end < capacity)).astype(np.int64))
    life = np.clip(np.minimum(events["t_end_s"].to_numpy(float), t_end)
                   - np.maximum(events["t_start_s"].to_numpy(float), t_start), 0, None)
    fixed = float(np.sum(2 * (rows - partial) + partial))
    per_bin = float(np.sum(partial * life)) / span_s
    if fixed + per_bin * num_bins <= CONTESTED_BUDGET:
        return num_bins
    return int(np.clip((CONTESTED_BUDGET - fixed) / max(per_bin, 1e-12), MIN_TIME_BINS, num_bins))


def block_map_raster(alloc: AllocatorRun, t_start: float, t_end: float, num_bins: int = DEFAULT_TIME_BINS,
                     max_rows: int = DEFAULT_MAX_ROWS) -> OwnerRaster:
    """The owner matrix of one allocator over [t_start, t_end), with never-filled slots flagged.

    A cell goes to the (request, filled or never-filled part) covering most of it.
    """
    events = alloc.events_between(t_start, t_end)
    t0, t1 = events["t_start_s"].to_numpy(float), events["t_end_s"].to_numpy(float)
    inside = (t0 < t_end) & (t1 > t_start)
    if not inside.all():  # copying 8 M rows that all pass costs a second
        events = events[inside]
    slots = row_slots_for(alloc, max_rows)
    bins = time_bins_for(events, alloc.capacity_slots, slots, t_start, t_end, num_bins)
    edges = np.linspace(t_start, t_end, bins + 1)
    return rasterize_owners(events, alloc.capacity_slots, edges, slots, split_unfilled=True)


def owner_image(raster: OwnerRaster) -> np.ndarray:
    """RGB image (rows x bins x 3): owner colours, red where never filled (internal frag.), white free."""
    rgb = np.empty(raster.owner.shape + (3,))
    rgb[...] = FREE_RGB
    held = raster.owner >= 0
    rgb[held] = owner_rgb(raster.owner[held])
    if raster.unfilled is not None:
        rgb[raster.unfilled] = UNFILLED_RGB
    return rgb


def zoom_window(run: Run, t_end: float) -> tuple[float, float] | None:
    """A window around the peak of the first allocator whose request and memory tables can be read,
    ZOOM_LIFETIMES median request lifetimes wide.

    None when that is not much shorter than the run (the full map is then readable as it is), or when no
    allocator has those tables: the map itself needs only the tenures.
    """
    alloc = next((a for a in run.allocators.values() if not a.table_problems(("requests", "memory"))), None)
    if alloc is None:
        return None
    req = alloc.request_columns(("admitted_s", "finish_s"))
    life = (req["finish_s"] - req["admitted_s"]).to_numpy(float)
    life = life[np.isfinite(life) & (life > 0)]
    if len(life) == 0:
        return None
    width = ZOOM_LIFETIMES * float(np.median(life))
    if width > ZOOM_MAX_SHARE * t_end:
        return None
    lo = float(np.clip(peak_time(alloc) - width / 2, 0.0, t_end - width))
    return lo, lo + width


def _seconds(t: float) -> str:
    """A time for a title: thousands separated, one decimal for long runs."""
    return f"{t:,.1f}" if abs(t) >= 100 else f"{t:.3g}"


def _draw_raster(ax, raster: OwnerRaster) -> dict[int, bool]:
    """Draw one owner matrix (hatching shared cells); returns which ref-count hatches appear."""
    blend = raster.owner.shape[0] > NEAREST_MAX_ROWS
    ax.imshow(owner_image(raster), origin="lower", aspect="auto",
              interpolation="antialiased" if blend else "nearest",
              extent=(raster.time_edges[0], raster.time_edges[-1], 0, raster.pos_edges[-1]))
    present = hatch_shared(ax, raster.ref_count, raster.time_edges, raster.pos_edges)
    ax.set_xlim(raster.time_edges[0], raster.time_edges[-1])
    ax.set_ylim(0, raster.pos_edges[-1])
    return present


def plot_block_map(run: Run, num_bins: int = DEFAULT_TIME_BINS, max_rows: int = DEFAULT_MAX_ROWS,
                   name: str = "block_map", window: tuple[float, float] | None = None) -> FigureResult:
    """Pool position vs time per allocator on one time span, plus a zoom on the peak for long runs.

    The span is `window` (start, end in seconds) if given, else the whole run, or its first part when the
    run holds more than MAX_TENURES tenures; the title says which part is drawn and how to draw another.

    data: {"full": {allocator: OwnerRaster}, "zoom": {allocator: OwnerRaster}, "window": (t0, t1) | None,
    "span": (start, end)}
    """
    allocs = list(run.allocators.values())
    run_end = run_end_time(run)
    if window is not None:
        start, end = check_window(window, run_end)
    else:
        start, end = 0.0, min(tenure_window(a, run_end) for a in allocs)
    full = {a.name: block_map_raster(a, start, end, num_bins, max_rows) for a in allocs}
    zoom_at = zoom_window(run, end) if window is None else None
    zoom = {a.name: block_map_raster(a, *zoom_at, num_bins, max_rows) for a in allocs} if zoom_at else {}
    nrows = 1 if zoom_at is None else 2
    fig = new_figure(max(4.5, 3.4 * len(allocs) + 0.6), 5.0 * nrows + 0.6)
    # Pools of different sizes (a hybrid model's paged pool spans its groups' slots) each get their own
    # axis: on a shared one the last panel's limits would cut the larger pool off.
    same_pool = len({a.capacity_slots for a in allocs}) == 1
    axes = fig.subplots(nrows, len(allocs), sharey=True if same_pool else "col", squeeze=False)
    any_shared = {2: False, 3: False}
    for col, alloc in enumerate(allocs):
        rasters = [full[alloc.name]] + ([zoom[alloc.name]] if zoom_at else [])
        for row, raster in enumerate(rasters):
            ax = axes[row, col]
            present = _draw_raster(ax, raster)
            any_shared = {k: any_shared[k] or present[k] for k in any_shared}
            ax.set_xlabel(time_label(alloc.config.get("source")))
        detail = f"block size {alloc.block_size}" if alloc.is_paged else "contiguous regions"
        detail += "" if same_pool else f", {alloc.capacity_slots:,} slots"
        axes[0, col].set_title(f"{allocator_label(alloc.name)}\n{detail}", fontsize="medium",
                               color=allocator_color(alloc.name))
        if zoom_at:
            axes[0, col].axvspan(*zoom_at, facecolor="none", edgecolor="black", linestyle="--", linewidth=0.8)
            zoom_title = f"zoom: {_seconds(zoom_at[0])} to {_seconds(zoom_at[1])} s"
            axes[1, col].set_title(zoom_title, fontsize="small")
    for row in range(nrows):
        axes[row, 0].set_ylabel("pool position (token slot)")
    fig.suptitle(figure_title(f"KV pool block map: {run.label}{span_text(start, end, run_end)}", [run]))
    handles = [Patch(facecolor=FREE_RGB, edgecolor="0.5"), OwnerSwatch(), Patch(color=UNFILLED_RGB)]
    labels = ["free (over half the cell)", f"held ({OWNER_FAMILY}: one shade per request, the one holding "
              "most of the cell)", STATE_LABELS["internal_fragmentation"] + " (held, never filled)"]
    if zoom_at:
        handles.append(Patch(facecolor="none", edgecolor="black", linestyle="--"))
        labels.append("zoom window")
    more_handles, more_labels = shared_legend(any_shared)
    legend_below(fig, handles + more_handles, labels + more_labels)
    return FigureResult(name, fig, {"full": full, "zoom": zoom, "window": zoom_at, "span": (start, end)})


WINDOW_HINT = "pagelab plot --only block_map --window START:END draws another"


def span_text(start: float, end: float, run_end: float) -> str:
    """'' for the whole run, else which seconds are drawn, of how many, and how to draw others."""
    if start <= 0 and end >= run_end:
        return ""
    digits = 1 if run_end >= 100 else 3  # one format for the three numbers
    shown = [f"{t:,.{digits}f}".rstrip("0").rstrip(".") if t else "0" for t in (start, end, run_end)]
    return f" ({shown[0]} to {shown[1]} s of {shown[2]} s; {WINDOW_HINT})"


def check_window(window: tuple[float, float], run_end: float) -> tuple[float, float]:
    """A drawable (start, end): finite, start >= 0, end > start, start before the run's end; end is cut
    to the run's end."""
    start, end = (float(x) for x in window)
    if not (np.isfinite(start) and np.isfinite(end)) or start < 0 or end <= start:
        raise VizError(f"window {start:g}:{end:g}: expected START:END seconds with 0 <= START < END")
    if start >= run_end:
        raise VizError(f"window {start:g}:{end:g} starts after the end of the run ({run_end:,.3f} s)")
    return start, min(end, run_end)

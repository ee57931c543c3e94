"""Figure 3b: the pool at one instant as a grid of slots: owners, reservations, waste and holes.

Fill level at time t is approximated from the requests table: a request holds
prompt_len + generated(t) tokens, where generated(t) grows linearly from 1 at first_token_s to
output_len at finish_s. A contiguous region holds min(filled, tokens); in a paged pool every block
of a request except its most recently allocated one is taken as full (its `filled`), and the latest
holds ((tokens - 1) mod block_size) + 1 slots, capped at its `filled`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch
from matplotlib.ticker import MultipleLocator

from viz.common import FigureResult, hatch_shared, legend_below, new_figure, shared_legend
from viz.errors import VizError
from viz.load import AllocatorRun, Run
from viz.palette import (
    FREE_RGB,
    OUTSIDE_POOL_RGB,
    OWNER_FAMILY,
    STATE_COLORS,
    OwnerSwatch,
    allocator_color,
    allocator_label,
    owner_rgb,
)
from viz.titles import figure_title

SLOT_FREE, SLOT_TOKEN, SLOT_RESERVED, SLOT_INTERNAL, SLOT_HOLE = range(5)


@dataclass(frozen=True)
class PoolSnapshot:
    """Per slot: owner (the request's row in the request table, -1 none), state (SLOT_*), and the
    holder's max ref count."""

    at_s: float
    owner: np.ndarray
    state: np.ndarray
    ref_count: np.ndarray
    hole_slots: int  # free runs shorter than this are holes


TOKEN_COLUMNS = ("prompt_len", "output_len", "first_token_s", "finish_s")


def tokens_at(requests: pd.DataFrame, at: float) -> pd.Series:
    """Approximate tokens each request of the whole request table holds at time `at`, indexed by its row
    (what the events table's request_id names; the table's own request_id is the trace's id)."""
    prompt = requests["prompt_len"].to_numpy(float)
    out = requests["output_len"].to_numpy(float)
    first = requests["first_token_s"].to_numpy(float)
    finish = requests["finish_s"].to_numpy(float)
    span = finish - first
    with np.errstate(invalid="ignore", divide="ignore"):
        progress = np.where(span > 0, np.clip((at - first) / span, 0.0, 1.0), 1.0)
    generated = np.where(np.isfinite(first) & (at >= first),
                         1.0 + np.floor((out - 1.0) * np.where(np.isfinite(finish), progress, 0.0)), 0.0)
    return pd.Series(prompt + generated, index=np.arange(len(requests), dtype=np.int64))


def peak_time(alloc: AllocatorRun) -> float:
    """Middle of the memory row with the most blocks in use (the median row among ties)."""
    if alloc.num_memory_rows == 0:
        raise VizError(f"{alloc.path / 'memory.parquet'}: no rows, cannot find the peak")
    cols = ("t_s", "dt_s", "blocks_used")
    peak, num_tied = -np.inf, 0
    for m in alloc.memory_chunks(cols):  # two passes over a streamed table: the peak, then its median tie
        used = m["blocks_used"].to_numpy(float)
        top = used.max(initial=-np.inf)
        if top > peak:
            peak, num_tied = top, 0
        num_tied += int((used == peak).sum())
    want = num_tied // 2
    for m in alloc.memory_chunks(cols):
        tied = np.flatnonzero(m["blocks_used"].to_numpy(float) == peak)
        if want < len(tied):
            i = int(tied[want])
            return float(m["t_s"].iloc[i] + m["dt_s"].iloc[i] / 2)
        want -= len(tied)
    raise AssertionError("unreachable: the peak row was counted")


def _fill_now(active: pd.DataFrame, tokens: pd.Series, block_size: int, paged: bool) -> np.ndarray:
    """Slots of each active tenure holding tokens now (see the module docstring)."""
    filled = active["filled"].to_numpy(np.int64)
    if not len(filled):  # nothing held (every request refused, or no tenure spans the moment)
        return filled
    tok = active["request_id"].map(tokens).to_numpy(float)
    known = np.isfinite(tok)
    tok = np.where(known, tok, filled).astype(np.int64)
    if not paged:
        return np.minimum(filled, np.maximum(tok, 0))
    order = np.lexsort((active["start"].to_numpy(), active["t_start_s"].to_numpy(),
                        active["request_id"].to_numpy()))
    rid_sorted = active["request_id"].to_numpy()[order]
    latest = np.zeros(len(active), dtype=bool)
    latest[order[np.append(rid_sorted[1:] != rid_sorted[:-1], True)]] = True
    partial = np.minimum(filled, (np.maximum(tok, 1) - 1) % block_size + 1)
    return np.where(latest & known, partial, filled)


def pool_snapshot(alloc: AllocatorRun, at: float) -> PoolSnapshot:
    """States of every slot of the pool at time `at`."""
    cap, bs = alloc.capacity_slots, alloc.block_size
    ev = alloc.events_between(at, at)
    t0, t1 = ev["t_start_s"].to_numpy(float), ev["t_end_s"].to_numpy(float)
    active = ev[(t0 <= at) & (t1 > at)]
    owner = np.full(cap, -1, dtype=np.int64)
    state = np.full(cap, SLOT_FREE, dtype=np.int8)
    ref = np.zeros(cap, dtype=np.int64)
    start = np.clip(active["start"].to_numpy(np.int64), 0, cap)
    size = np.clip(active["size"].to_numpy(np.int64), 0, cap - start)
    filled = np.minimum(active["filled"].to_numpy(np.int64), size)
    tokens = tokens_at(alloc.request_columns(TOKEN_COLUMNS), at)
    fill = np.minimum(_fill_now(active, tokens, bs, alloc.is_paged), filled)
    item = np.repeat(np.arange(len(active)), size)
    offset = np.arange(len(item)) - np.repeat(np.cumsum(size) - size, size)
    slot = start[item] + offset
    owner[slot] = active["request_id"].to_numpy(np.int64)[item]
    ref[slot] = active["max_ref_count"].to_numpy(np.int64)[item]
    state[slot] = np.where(offset < fill[item], SLOT_TOKEN,
                           np.where(offset < filled[item], SLOT_RESERVED, SLOT_INTERNAL))
    hole_slots = bs if alloc.is_paged else int(np.median(size)) if len(size) else 0
    _mark_holes(state, cap, bs, alloc.is_paged, hole_slots)
    return PoolSnapshot(float(at), owner, state, ref, hole_slots)


def _mark_holes(state: np.ndarray, cap: int, bs: int, paged: bool, hole_slots: int) -> None:
    """Mark free slots no request can use: the partial block tail (paged), short free runs (contiguous)."""
    if paged:
        tail = state[(cap // bs) * bs:]
        tail[tail == SLOT_FREE] = SLOT_HOLE
        return
    free = np.concatenate([[False], state == SLOT_FREE, [False]])
    change = np.flatnonzero(free[1:] != free[:-1])
    run_start, run_end = change[0::2], change[1::2]
    short = (run_end - run_start) < hole_slots
    lengths = (run_end - run_start)[short]
    if len(lengths):
        item = np.repeat(run_start[short], lengths)
        item += np.arange(len(item)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        state[item] = SLOT_HOLE



MAX_PIXELS = 1 << 20   # larger pools show every u-th slot (documented in docs/figures.md)
GRID_ASPECT = 1.6      # slots per row / rows


def grid_width(num_cells: int, block_size: int) -> int:
    """Cells per grid row: whole blocks, so the grid is about GRID_ASPECT times wider than tall."""
    width = int(np.ceil(np.sqrt(num_cells * GRID_ASPECT) / block_size)) * block_size
    return max(block_size, width)


def snapshot_image(snap: PoolSnapshot, width: int, stride: int = 1) -> np.ndarray:
    """RGB grid (rows x width x 3) of every `stride`-th slot; cells past the pool are grey."""
    idx = np.arange(0, len(snap.state), stride)
    state, owner = snap.state[idx], snap.owner[idx]
    rgb = np.empty((len(idx), 3))
    rgb[...] = FREE_RGB
    held = owner >= 0
    rgb[held] = owner_rgb(owner[held])
    rgb[state == SLOT_RESERVED] = to_rgb(STATE_COLORS["reservation"])
    rgb[state == SLOT_INTERNAL] = to_rgb(STATE_COLORS["internal_fragmentation"])
    rgb[state == SLOT_HOLE] = to_rgb(STATE_COLORS["external_fragmentation"])
    rows = -(-len(idx) // width)
    grid = np.empty((rows * width, 3))
    grid[...] = OUTSIDE_POOL_RGB
    grid[: len(idx)] = rgb
    return grid.reshape(rows, width, 3)


def plot_block_snapshot(run: Run, at: float | None = None, name: str = "block_snapshot") -> FigureResult:
    """The pool of each allocator at `at` (default: each allocator's peak usage) as a grid of slots."""
    allocs = list(run.allocators.values())
    snaps = {a.name: pool_snapshot(a, peak_time(a) if at is None else at) for a in allocs}
    ncols = min(len(allocs), 2)
    nrows = -(-len(allocs) // ncols)
    fig = new_figure(5.2 * ncols + 0.4, 3.9 * nrows + 1.0)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False).ravel())
    for ax in axes[len(allocs):]:
        ax.set_axis_off()
    shared = {2: False, 3: False}
    for ax, alloc in zip(axes, allocs, strict=False):
        snap = snaps[alloc.name]
        stride = max(1, -(-len(snap.state) // MAX_PIXELS))
        bs = alloc.block_size
        width = grid_width(-(-len(snap.state) // stride), bs)
        image = snapshot_image(snap, width, stride)
        rows = image.shape[0]
        row_span = width * stride
        shrink = max(image.shape[:2]) > 400  # more cells than screen pixels: blend, don't skip
        ax.imshow(image, origin="upper", aspect="auto", interpolation="antialiased" if shrink else "nearest",
                  extent=(0, row_span, rows * row_span, 0))
        refs = np.zeros(rows * width, dtype=np.int64)
        refs[: -(-len(snap.state) // stride)] = snap.ref_count[::stride]
        present = hatch_shared(ax, refs.reshape(rows, width), np.arange(width + 1) * stride,
                               np.arange(rows + 1) * row_span)
        shared = {k: shared[k] or present[k] for k in shared}
        ax.set_xlim(0, row_span)
        ax.set_ylim(rows * row_span, 0)
        if rows <= 16:  # few rows: tick each row start; many: round numbers read better
            ax.yaxis.set_major_locator(MultipleLocator(row_span * -(-rows // 8)))
        blocks_per_row = width // bs
        if alloc.is_paged and stride == 1 and blocks_per_row <= 48:
            ax.vlines(np.arange(1, blocks_per_row) * bs, 0, rows * row_span, colors="white",
                      linewidth=0.5, alpha=0.9)
        used = float(np.mean(snap.state != SLOT_FREE) - np.mean(snap.state == SLOT_HOLE))
        when = "peak usage" if at is None else "requested time"
        ax.set_title(f"{allocator_label(alloc.name)}: t = {snap.at_s:.4g} s ({when}), {used:.0%} held",
                     fontsize="medium", color=allocator_color(alloc.name))
        per = f"{row_span} slots per row" + (f", every {stride}th slot drawn" if stride > 1 else "")
        ax.set_xlabel(f"slot offset within row ({per})")
        ax.set_ylabel("first slot of row")
    fig.suptitle(figure_title(f"KV pool snapshot: {run.label}", [run]))
    handles = [OwnerSwatch(), Patch(color=STATE_COLORS["reservation"]),
               Patch(color=STATE_COLORS["internal_fragmentation"]),
               Patch(color=STATE_COLORS["external_fragmentation"]),
               Patch(facecolor=FREE_RGB, edgecolor="0.5")]
    labels = [f"tokens ({OWNER_FAMILY}: one shade per request)", "reserved, not yet filled",
              "internal fragmentation", "hole (external fragmentation)", "free"]
    more_handles, more_labels = shared_legend(shared)
    handles, labels = handles + more_handles, labels + more_labels
    legend_below(fig, handles, labels, ncol=3)
    return FigureResult(name, fig, snaps)

"""The data of `pagelab view`: a level-of-detail summary of a whole run, and full detail for time windows.

The page shows a run at any moment, so it needs every tenure held then. A million-request run has far too
many tenures to embed, so the page carries, per allocator, the memory curve and queue counts binned over
the whole run (`SUMMARY_BINS` points) and, for a few windows, every tenure, memory row, request and
transition inside them. The default window is centred on the first allocator's peak and sized to hold
`TENURE_BUDGET` tenures; `pagelab view --serve` loads other windows on demand with `window_detail`.

Columns travel as base64 of little-endian typed arrays: compact, and decoded in the browser without a
JSON parse of millions of numbers.
"""
from __future__ import annotations

import base64
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from pagelab.parquet_parts import PartedFile, table_exists
from pagelab.run_format import REFCOUNT_COLUMNS
from viz.downsample import downsample_chunks, downsample_steps
from viz.errors import VizError
from viz.load import WINDOW_READ_ROWS, AllocatorRun, Run
from viz.palette import (
    ALLOCATOR_LABELS,
    FREE_RGB,
    OWNER_COLORS,
    OWNER_STRIDE,
    PART_HATCH_COLORS,
    PART_LABELS,
    PART_OF,
    PHASE_COLORS,
    QUEUE_COLORS,
    STATE_COLORS,
    STATE_ORDER,
    allocator_color,
)
from viz.perfetto import run_end
from viz.snapshot import peak_time
from viz.transitions import has_table, read_batches, read_transitions

SUMMARY_BINS = 1500
TENURE_BUDGET = 300_000  # tenures per window, all allocators together: most of the page's bytes
DETAIL_MEMORY_ROWS = 20_000  # memory rows of one window, at most (more are binned)
COUNT_COLUMNS = ("num_running", "num_waiting", "num_swapped")
EVENT_FIELDS = ("request_id", "start", "size", "t_start_s", "t_end_s", "max_ref_count", "filled",
                "prefix_key", "seq_id")
_INT64_FIELDS = ("prefix_key", "seq_id")
WAITING_ROWS = 2_000  # requests still waiting at a window's end that the page carries (the earliest)
ZOOM_LIFETIMES = 8  # the default window's first width, in median service times
REQUEST_FIELDS = ("request_id", "arrival_s", "admitted_s", "first_token_s", "finish_s", "prompt_len",
                  "output_len", "num_preemptions")
_TYPED = {"f8": "<f8", "i4": "<i4", "i8": "<i8"}


def packed(values, kind: str) -> dict:
    """A column as {"t": kind, "b": base64 of its little-endian bytes} (kind: f8, i4)."""
    arr = np.ascontiguousarray(np.asarray(values), dtype=_TYPED[kind])
    return {"t": kind, "b": base64.b64encode(arr.tobytes()).decode("ascii")}


@dataclass(frozen=True)
class Window:
    """A span of the run, in seconds."""

    start: float
    end: float


def _memory_columns(alloc: AllocatorRun) -> tuple[str, ...]:
    return ("t_s", "dt_s", *STATE_ORDER, *COUNT_COLUMNS, *alloc.parts)


def summary_series(alloc: AllocatorRun, bins: int = SUMMARY_BINS) -> dict:
    """The memory states (time-weighted means), queue counts and the parts of states the run carries,
    over the whole run, in `bins` bins."""
    cols = _memory_columns(alloc)
    chunks = ((m["t_s"].to_numpy(float), m["dt_s"].to_numpy(float), m[list(cols[2:])].to_numpy(float))
              for m in alloc.memory_chunks(cols))
    binned = downsample_chunks(chunks, alloc.num_memory_rows, alloc.memory_span(), bins)
    return _series(binned.edges, binned.mean, cols[2:])


def _series(edges: np.ndarray, values: np.ndarray, names: tuple[str, ...]) -> dict:
    """Each step's start `t` and values; `t_end` is where the last step ends (the charts run to it)."""
    t = edges[:-1]
    values = np.nan_to_num(np.asarray(values, float).reshape(len(t), len(names)))
    return {"t": packed(t, "f8"), "t_end": float(edges[-1]),
            **{n: packed(values[:, i], "f8") for i, n in enumerate(names)}}


def _window_memory(alloc: AllocatorRun, w: Window) -> dict:
    cols = _memory_columns(alloc)
    parts = [m[(m["t_s"] + m["dt_s"] > w.start) & (m["t_s"] < w.end)] for m in alloc.memory_chunks(cols)]
    mem = pd.concat(parts) if parts else pd.DataFrame(columns=cols)
    binned = downsample_steps(mem["t_s"].to_numpy(float), mem["dt_s"].to_numpy(float),
                              mem[list(cols[2:])].to_numpy(float), DETAIL_MEMORY_ROWS)
    return _series(binned.edges, binned.mean, cols[2:])


def _window_requests(alloc: AllocatorRun, w: Window) -> dict:
    """The requests admitted before the window ends and not finished before it starts (they hold its
    tenures), plus the WAITING_ROWS earliest still waiting at its end (an overloaded run's queue holds
    most of the trace: the lanes show the earliest requests in the server, never the queue's tail)."""
    req = alloc.request_columns((*REQUEST_FIELDS, "rejected"))
    arrival, admitted = req["arrival_s"].to_numpy(float), req["admitted_s"].to_numpy(float)
    live = (arrival <= w.end) & ~(req["finish_s"].to_numpy(float) < w.start) & ~req["rejected"].to_numpy(bool)
    served = live & (admitted <= w.end)
    waiting = np.flatnonzero(live & ~served)[:WAITING_ROWS]  # trace order is arrival order
    keep = np.sort(np.concatenate([np.flatnonzero(served), waiting]))
    req = req.iloc[keep]
    # The trace's ids are int64 (i4 would wrap them); `row` is what the tenures and transitions name.
    kinds = {c: "i8" if c == "request_id" else "i4" if c in ("num_preemptions", "prompt_len", "output_len")
             else "f8" for c in REQUEST_FIELDS}
    return {"row": packed(keep, "i4"), **{c: packed(req[c].to_numpy(), kinds[c]) for c in REQUEST_FIELDS}}


def _window_transitions(alloc: AllocatorRun, w: Window) -> dict:
    frames = [df[(df["t_s"] >= w.start) & (df["t_s"] <= w.end)] for df in read_transitions(alloc)]
    df = pd.concat(frames) if frames else pd.DataFrame({"request_id": [], "t_s": [], "kind": []})
    return {"request_id": packed(df["request_id"], "i4"), "t_s": packed(df["t_s"], "f8"),
            "kind": packed(df["kind"], "i4")}


def events_in(alloc: AllocatorRun, w: Window, columns: tuple[str, ...]) -> pd.DataFrame:
    """`columns` of the tenures held at some time of `w`. A big Parquet table is scanned a row group at a
    time (its time columns first, the rest only where a group has rows in the window), skipping the groups
    released before the window: memory holds the result and one group, whatever the table's length."""
    path = alloc.path / "events.parquet"
    if alloc.num_events <= WINDOW_READ_ROWS or not table_exists(path):
        ev = alloc.events_between(w.start, w.end)
        return ev[[c for c in columns if c in ev.columns]]
    parts = []
    with PartedFile(path) as f:
        names = f.schema_arrow.names
        wanted = [c for c in columns if c in names]
        t_end_col = names.index("t_end_s")
        for g in range(f.metadata.num_row_groups):
            stats = f.metadata.row_group(g).column(t_end_col).statistics
            if stats is not None and stats.has_min_max and stats.max <= w.start:
                continue  # released before the window (rows are in release order)
            times = f.read_row_group(g, columns=["t_start_s", "t_end_s"])
            mask = ((times.column(0).to_numpy() <= w.end) & (times.column(1).to_numpy() > w.start))
            if mask.any():
                parts.append(f.read_row_group(g, columns=wanted).filter(pa.array(mask)).to_pandas())
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame({c: [] for c in wanted})


def _window_tenures(alloc: AllocatorRun, w: Window) -> dict:
    ev = events_in(alloc, w, EVENT_FIELDS)
    ev = ev.sort_values("t_start_s", kind="stable", ignore_index=True)  # the page bisects start times
    kinds = {c: "f8" if c.startswith("t_") else "i8" if c in _INT64_FIELDS else "i4" for c in ev.columns}
    return {**{c: packed(ev[c], kinds[c]) for c in ev.columns}, "count": len(ev),
            "refcounts": tenure_refcounts(alloc, ev, w)}


def tenure_refcounts(alloc: AllocatorRun, ev: pd.DataFrame, w: Window) -> dict | None:
    """The owner-count changes of the window's shared tenures (`ev` rows, by position), sorted by tenure
    then time, so the page reads a block's count at any moment; None when the run lacks the table."""
    if not has_table(alloc, "refcounts"):
        return None
    shared = ev.loc[ev["max_ref_count"] > 1, ["start", "t_start_s", "t_end_s"]]
    rows = pd.DataFrame({"start": [], "t_s": [], "ref_count": []})
    if len(shared):
        starts, t0 = shared["start"].unique(), float(shared["t_start_s"].min())
        parts = [df[(df["t_s"] >= t0) & (df["t_s"] <= w.end) & df["start"].isin(starts)]
                 for df in read_batches(alloc, "refcounts", tuple(REFCOUNT_COLUMNS))]
        rows = pd.concat([rows, *parts]) if parts else rows
    shared = shared.assign(tenure=shared.index).sort_values("t_start_s", kind="stable")
    rows = rows.astype({"start": shared["start"].dtype, "t_s": float}).sort_values("t_s", kind="stable")
    # Each change belongs to the latest tenure of its block that started at or before it.
    m = pd.merge_asof(rows, shared, left_on="t_s", right_on="t_start_s", by="start", direction="backward")
    m = m[m["t_s"] <= m["t_end_s"]].sort_values(["tenure", "t_s"], kind="stable")
    return {"tenure": packed(m["tenure"], "i4"), "t_s": packed(m["t_s"], "f8"),
            "ref_count": packed(m["ref_count"], "i4")}


def window_detail(alloc: AllocatorRun, w: Window) -> dict:
    """Everything the page draws of one allocator inside `w`: tenures, memory rows, requests, transitions."""
    return {"start": w.start, "end": w.end, "tenures": _window_tenures(alloc, w),
            "memory": _window_memory(alloc, w), "requests": _window_requests(alloc, w),
            "transitions": _window_transitions(alloc, w)}


def _median_service(alloc: AllocatorRun) -> float:
    """Median time from admission to finish (what a request holds memory for; queueing left out)."""
    req = alloc.request_columns(("admitted_s", "finish_s"))
    life = (req["finish_s"] - req["admitted_s"]).to_numpy(float)
    life = life[np.isfinite(life) & (life > 0)]
    return float(np.median(life)) if len(life) else 1.0


def _centred(centre: float, width: float, end: float) -> Window:
    """A window of `width` around `centre`, moved inside [0, end]; a narrower one nests inside a wider."""
    lo = float(np.clip(centre - width / 2, 0.0, max(0.0, end - width)))
    return Window(lo, lo + width)


def default_window(run: Run, budget: int = TENURE_BUDGET) -> Window:
    """A window around the first allocator's peak holding at most `budget` tenures (all allocators; never
    fewer than are held at the peak), or the whole run when it holds fewer."""
    allocs = list(run.allocators.values())
    end = max(run_end(a) for a in allocs)
    if sum(a.num_events for a in allocs) <= budget:
        return Window(0.0, end)
    centre = peak_time(allocs[0])
    w = _centred(centre, min(end, ZOOM_LIFETIMES * max(_median_service(a) for a in allocs)), end)
    # Tenures grow about linearly with the width: shrink until within the budget, counting on the time
    # columns of the widest window read once (narrower windows nest inside it).
    times = [events_in(a, w, ("t_start_s", "t_end_s")) for a in allocs]
    for _ in range(12):
        count = sum(int(((t["t_start_s"] <= w.end) & (t["t_end_s"] > w.start)).sum()) for t in times)
        if count <= budget or w.end - w.start <= end * 1e-6:
            break
        w = _centred(centre, (w.end - w.start) * 0.9 * budget / count, end)
    return w


def check_windows(texts: list[str], run_end_s: float) -> list[Window]:
    """--window START:END values as windows within the run (VizError naming the bad one)."""
    out = []
    for text in texts:
        try:
            start, end = (float(x) for x in text.split(":"))
        except ValueError:
            raise VizError(f"--window {text!r}: expected START:END in seconds, e.g. 0:60") from None
        if not (math.isfinite(start) and math.isfinite(end)) or start < 0 or end <= start:
            raise VizError(f"--window {text!r}: expected START:END seconds with 0 <= START < END")
        if start >= run_end_s:
            raise VizError(f"--window {text!r} starts after the end of the run ({run_end_s:,.3f} s)")
        out.append(Window(start, min(end, run_end_s)))
    return out


def palette() -> dict:
    """The colours of the static figures (viz/palette.py), for the page."""
    return {"states": list(STATE_ORDER), "state_colors": STATE_COLORS, "owner_colors": list(OWNER_COLORS),
            "owner_stride": OWNER_STRIDE, "phase_colors": PHASE_COLORS, "queue_colors": QUEUE_COLORS,
            "free": "#{:02X}{:02X}{:02X}".format(*(round(255 * c) for c in FREE_RGB))}


def part_palette(parts: list[str]) -> dict:
    """How the page draws each part of a state: inside which state, its hatch colour and legend text."""
    return {p: {"of": PART_OF[p], "hatch": PART_HATCH_COLORS[p], "label": PART_LABELS[p]} for p in parts}


def page_data(run: Run, windows: list[Window] | None = None) -> dict:
    """The page's data: palette, run facts, per allocator its summary and the detail of each window (and
    the parts of states an allocator carries, only where some allocator does)."""
    allocs = list(run.allocators.values())
    windows = windows or [default_window(run)]
    parts = [p for p in PART_OF if any(p in a.parts for a in allocs)]
    return {
        "label": run.label, "palette": {**palette(), **({"parts": part_palette(parts)} if parts else {})},
        "end": max(run_end(a) for a in allocs),
        "windows": [[w.start, w.end] for w in windows], "lane_span": _median_service(allocs[0]),
        "allocators": [{
            "name": a.name, "label": ALLOCATOR_LABELS.get(a.name, a.name), "color": allocator_color(a.name),
            "capacity": a.capacity_slots, "block_size": a.block_size if a.is_paged else 1,
            "paged": a.is_paged, "summary": summary_series(a),
            "windows": [window_detail(a, w) for w in windows],
            **({"parts": list(a.parts)} if a.parts else {}),
        } for a in allocs],
    }

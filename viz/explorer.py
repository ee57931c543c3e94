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

from viz.downsample import downsample_chunks, downsample_steps
from viz.errors import VizError
from viz.load import AllocatorRun, Run
from viz.palette import (
    ALLOCATOR_LABELS,
    FREE_RGB,
    OWNER_COLORS,
    OWNER_STRIDE,
    PHASE_COLORS,
    QUEUE_COLORS,
    STATE_COLORS,
    STATE_ORDER,
    allocator_color,
)
from viz.perfetto import run_end
from viz.snapshot import peak_time
from viz.transitions import read_transitions

SUMMARY_BINS = 1500
TENURE_BUDGET = 300_000  # tenures per window, all allocators together: most of the page's bytes
DETAIL_MEMORY_ROWS = 20_000  # memory rows of one window, at most (more are binned)
COUNT_COLUMNS = ("num_running", "num_waiting", "num_swapped")
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


def _memory_columns() -> tuple[str, ...]:
    return ("t_s", "dt_s", *STATE_ORDER, *COUNT_COLUMNS)


def summary_series(alloc: AllocatorRun, bins: int = SUMMARY_BINS) -> dict:
    """The memory states (time-weighted means) and queue counts over the whole run, in `bins` bins."""
    cols = _memory_columns()
    chunks = ((m["t_s"].to_numpy(float), m["dt_s"].to_numpy(float), m[list(cols[2:])].to_numpy(float))
              for m in alloc.memory_chunks(cols))
    binned = downsample_chunks(chunks, alloc.num_memory_rows, alloc.memory_span(), bins)
    return _series(binned.edges[:-1], binned.mean, cols[2:])


def _series(t: np.ndarray, values: np.ndarray, names: tuple[str, ...]) -> dict:
    values = np.nan_to_num(np.asarray(values, float).reshape(len(t), len(names)))
    return {"t": packed(t, "f8"), **{n: packed(values[:, i], "f8") for i, n in enumerate(names)}}


def _window_memory(alloc: AllocatorRun, w: Window) -> dict:
    cols = _memory_columns()
    parts = [m[(m["t_s"] + m["dt_s"] > w.start) & (m["t_s"] < w.end)] for m in alloc.memory_chunks(cols)]
    mem = pd.concat(parts) if parts else pd.DataFrame(columns=cols)
    binned = downsample_steps(mem["t_s"].to_numpy(float), mem["dt_s"].to_numpy(float),
                              mem[list(cols[2:])].to_numpy(float), DETAIL_MEMORY_ROWS)
    return _series(binned.edges[:-1], binned.mean, cols[2:])


def _window_requests(alloc: AllocatorRun, w: Window) -> dict:
    req = alloc.request_columns(REQUEST_FIELDS)
    end = req["finish_s"].to_numpy(float)
    keep = (req["arrival_s"].to_numpy(float) <= w.end) & ~(end < w.start)
    req = req[keep & ~alloc.request_columns(("rejected",))["rejected"].to_numpy(bool)]
    kinds = {c: "i4" if c in ("request_id", "num_preemptions") else "f8" for c in REQUEST_FIELDS}
    kinds.update(prompt_len="i4", output_len="i4")
    return {c: packed(req[c].to_numpy(), kinds[c]) for c in REQUEST_FIELDS}


def _window_transitions(alloc: AllocatorRun, w: Window) -> dict:
    frames = [df[(df["t_s"] >= w.start) & (df["t_s"] <= w.end)] for df in read_transitions(alloc)]
    df = pd.concat(frames) if frames else pd.DataFrame({"request_id": [], "t_s": [], "kind": []})
    return {"request_id": packed(df["request_id"], "i4"), "t_s": packed(df["t_s"], "f8"),
            "kind": packed(df["kind"], "i4")}


def _window_tenures(alloc: AllocatorRun, w: Window) -> dict:
    ev = alloc.events_between(w.start, w.end)
    ev = ev.sort_values("t_start_s", kind="stable")  # the page finds a moment's tenures by start time
    return {"request_id": packed(ev["request_id"], "i4"), "start": packed(ev["start"], "i4"),
            "size": packed(ev["size"], "i4"), "t_start_s": packed(ev["t_start_s"], "f8"),
            "t_end_s": packed(ev["t_end_s"], "f8"), "max_ref_count": packed(ev["max_ref_count"], "i4"),
            "filled": packed(ev["filled"], "i4"), "count": len(ev),
            **({"prefix_key": packed(ev["prefix_key"], "i8")} if "prefix_key" in ev.columns else {})}


def window_detail(alloc: AllocatorRun, w: Window) -> dict:
    """Everything the page draws of one allocator inside `w`: tenures, memory rows, requests, transitions."""
    return {"start": w.start, "end": w.end, "tenures": _window_tenures(alloc, w),
            "memory": _window_memory(alloc, w), "requests": _window_requests(alloc, w),
            "transitions": _window_transitions(alloc, w)}


def _median_lifetime(alloc: AllocatorRun) -> float:
    req = alloc.request_columns(("arrival_s", "finish_s"))
    life = (req["finish_s"] - req["arrival_s"]).to_numpy(float)
    life = life[np.isfinite(life) & (life > 0)]
    return float(np.median(life)) if len(life) else 1.0


def default_window(run: Run, budget: int = TENURE_BUDGET) -> Window:
    """A window around the first allocator's peak holding at most `budget` tenures (all allocators; never
    fewer than are held at the peak), or the whole run when it holds fewer."""
    allocs = list(run.allocators.values())
    end = max(run_end(a) for a in allocs)
    if sum(a.num_events for a in allocs) <= budget:
        return Window(0.0, end)
    centre = peak_time(allocs[0])
    width = min(end, 8 * max(_median_lifetime(a) for a in allocs))
    for _ in range(8):  # tenures grow about linearly with the width: shrink until within the budget
        lo = float(np.clip(centre - width / 2, 0.0, max(0.0, end - width)))
        count = sum(len(a.events_between(lo, lo + width)) for a in allocs)
        if count <= budget or width <= end * 1e-6:
            return Window(lo, lo + width)
        width *= 0.9 * budget / count
    return Window(lo, lo + width)


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


def page_data(run: Run, windows: list[Window] | None = None) -> dict:
    """The page's data: palette, run facts, per allocator its summary and the detail of each window."""
    allocs = list(run.allocators.values())
    windows = windows or [default_window(run)]
    return {
        "label": run.label, "palette": palette(), "end": max(run_end(a) for a in allocs),
        "windows": [[w.start, w.end] for w in windows], "lane_span": _median_lifetime(allocs[0]),
        "allocators": [{
            "name": a.name, "label": ALLOCATOR_LABELS.get(a.name, a.name), "color": allocator_color(a.name),
            "capacity": a.capacity_tokens, "block_size": a.block_size if a.is_paged else 1,
            "paged": a.is_paged, "summary": summary_series(a),
            "windows": [window_detail(a, w) for w in windows],
        } for a in allocs],
    }

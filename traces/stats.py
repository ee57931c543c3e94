"""Summary statistics of a canonical trace (what `pagelab trace info` shows)."""
from __future__ import annotations

from collections import Counter
from itertools import chain

import numpy as np
import pandas as pd

from pagelab.column_stats import BATCH_ROWS, median_and_percentiles
from traces.batches import FrameBatches, TraceBatches

PERCENTILES = (50, 90, 99)


def _totals(trace: TraceBatches, col: str) -> tuple[int, int, int]:
    """Sum, max and number of values above 1 of a count column, read a block at a time."""
    total = top = above = 0
    for c in trace.iter_batches((col,), BATCH_ROWS):
        values = c[col].astype(np.int64, copy=False)
        total += int(values.sum())
        top = max(top, int(values.max()))
        above += int((values > 1).sum())
    return total, top, above


def _describe(trace: TraceBatches, col: str) -> tuple[dict[str, float], int]:
    """Mean, p50/p90/p99 and max of a length column (and its sum), read a block at a time: the
    percentiles are np.percentile's, by selection over the batches (pagelab/column_stats.py)."""
    total, top, _ = _totals(trace, col)
    batches = lambda: ((c[col], None) for c in trace.iter_batches((col,), BATCH_ROWS))  # noqa: E731
    _, pct = median_and_percentiles(batches, trace.num_rows, PERCENTILES)
    out = {"mean": total / trace.num_rows}
    out.update({f"p{p}": v for p, v in zip(PERCENTILES, pct, strict=True)})
    out["max"] = top
    return out, total


def _uses(trace: TraceBatches, col: str) -> dict[str, float | int]:
    """Mean, max and number of requests above 1 of the n or beam_width column (1 where absent)."""
    if col not in trace.columns:
        return {"mean": 1.0, "max": 1, "requests_above_1": 0}
    total, top, above = _totals(trace, col)
    return {"mean": total / trace.num_rows, "max": top, "requests_above_1": above}


def mean_rate(arrival_s: np.ndarray) -> float | None:
    """Mean arrival rate (N - 1) / duration in requests/s; None for a single request or a burst."""
    if len(arrival_s) < 2:
        return None
    duration = float(arrival_s.max() - arrival_s.min())
    return (len(arrival_s) - 1) / duration if duration > 0 else None


def prefix_reuse(trace: pd.DataFrame) -> dict | None:
    """Prefix block references, distinct keys and the fraction of references that repeat a key; the block
    size keys are recorded at (None when requests record them at several: see `block_sizes`)."""
    if "prefix_blocks" not in trace.columns:
        return None
    sizes = trace["prefix_block_size"].to_numpy()
    if len(np.unique(sizes)) == 1:
        total = int(trace["prefix_blocks"].map(len).sum())
        unique = len(set(chain.from_iterable(trace["prefix_blocks"])))
    else:  # keys recorded at different block sizes are different blocks
        refs = Counter((s, k) for s, keys in zip(sizes.tolist(), trace["prefix_blocks"], strict=True)
                       for k in keys)
        total, unique = sum(refs.values()), len(refs)
    keyed = trace["prefix_blocks"].map(len).to_numpy() > 0
    # Sizes of the requests that carry keys (as `trace reuse` reads them); mixed sizes get no single label.
    used = sorted(int(s) for s in np.unique(sizes[keyed] if keyed.any() else sizes))
    return {
        "block_size": used[0] if len(used) == 1 else None,
        "block_sizes": used,
        "requests_with_prefix": int(keyed.sum()),
        "references": total,
        "unique_blocks": unique,
        "repeat_fraction": (total - unique) / total if total else 0.0,
    }


def trace_info(trace: pd.DataFrame | TraceBatches) -> dict:
    """Count, duration, mean rate, length percentiles, n / beam use and prefix reuse (JSON-ready).

    Columns are read a block at a time (a TraceBatches from its file), so a 10M-request trace is never
    held whole: reading four of its columns whole takes 0.25 GB, which would be a 10M run's largest
    allocation.
    """
    chunked = isinstance(trace, TraceBatches)
    rows = trace if chunked else FrameBatches(trace)
    num = rows.num_rows
    if num == 0:
        raise ValueError("trace_info of an empty trace")
    if chunked:  # sorted arrivals: the first and the last are the extremes (traces/batches.py)
        first = last = None
        for c in trace.iter_batches(("arrival_s",)):
            first = c["arrival_s"][0] if first is None else first
            last = c["arrival_s"][-1]
        duration = float(last - first)
        rate = (num - 1) / duration if num > 1 and duration > 0 else None
    else:
        arrival = trace["arrival_s"].to_numpy().astype(np.float64, copy=False)
        duration = float(arrival.max() - arrival.min())
        rate = mean_rate(arrival)
        del arrival
    info = {"num_requests": int(num), "duration_s": duration, "mean_rate_per_s": rate}
    total = 0
    for col in ("prompt_len", "output_len"):
        info[col], tokens = _describe(rows, col)
        total += tokens
    info["total_tokens"] = total
    for col in ("n", "beam_width"):
        info[col] = _uses(rows, col)
    if chunked:
        info["prefix"] = None  # chunked traces carry no prefix keys (traces/batches.py)
        return info
    info["prefix"] = prefix_reuse(trace)
    return info

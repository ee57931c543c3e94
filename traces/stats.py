"""Summary statistics of a canonical trace (what `pagelab trace info` shows)."""
from __future__ import annotations

from collections import Counter
from itertools import chain

import numpy as np
import pandas as pd

from traces.chunks import TraceChunks

PERCENTILES = (50, 90, 99)


def _describe(values: np.ndarray) -> dict[str, float]:
    """Mean, p50/p90/p99 and max of a length column."""
    pct = np.percentile(values, PERCENTILES)
    out = {"mean": float(values.mean())}
    out.update({f"p{p}": float(v) for p, v in zip(PERCENTILES, pct, strict=True)})
    out["max"] = int(values.max())
    return out


def mean_rate(arrival_s: np.ndarray) -> float | None:
    """Mean arrival rate (N - 1) / duration in requests/s; None for a single request or a burst."""
    if len(arrival_s) < 2:
        return None
    duration = float(arrival_s.max() - arrival_s.min())
    return (len(arrival_s) - 1) / duration if duration > 0 else None


def prefix_reuse(trace: pd.DataFrame) -> dict[str, float | int] | None:
    """Prefix block references, distinct keys and the fraction of references that repeat a key."""
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
    return {
        "block_size": int(np.bincount(sizes).argmax()) if sizes.min() >= 0 else int(sizes[0]),
        "requests_with_prefix": int((trace["prefix_blocks"].map(len) > 0).sum()),
        "references": total,
        "unique_blocks": unique,
        "repeat_fraction": (total - unique) / total if total else 0.0,
    }


def trace_info(trace: pd.DataFrame | TraceChunks) -> dict:
    """Count, duration, mean rate, length percentiles, n / beam use and prefix reuse (JSON-ready); a
    TraceChunks is read a column at a time."""
    chunked = isinstance(trace, TraceChunks)
    num = trace.num_rows if chunked else len(trace)
    column = trace.column if chunked else (lambda c: trace[c].to_numpy())
    if chunked:  # sorted arrivals: the first and the last are the extremes (traces/chunks.py)
        first = last = None
        for c in trace.iter_chunks(("arrival_s",)):
            first = c["arrival_s"][0] if first is None else first
            last = c["arrival_s"][-1]
        duration = float(last - first) if num else 0.0
        rate = (num - 1) / duration if num > 1 and duration > 0 else None
    else:
        arrival = column("arrival_s").astype(np.float64, copy=False)
        duration = float(arrival.max() - arrival.min()) if num else 0.0
        rate = mean_rate(arrival)
        del arrival
    info = {"num_requests": int(num), "duration_s": duration, "mean_rate_per_s": rate}
    total = 0
    for col in ("prompt_len", "output_len"):
        values = column(col).astype(np.int64, copy=False)
        info[col] = _describe(values)
        total += int(values.sum())
    info["total_tokens"] = total
    for col in ("n", "beam_width"):
        values = column(col).astype(np.int64, copy=False) if col in trace.columns else np.ones(num, np.int64)
        info[col] = {"mean": float(values.mean()), "max": int(values.max()),
                     "requests_above_1": int((values > 1).sum())}
    if chunked:
        info["prefix"] = None  # chunked traces carry no prefix keys (traces/chunks.py)
        return info
    info["prefix"] = prefix_reuse(trace)
    return info

"""Serving metrics in the conventions of `vllm bench serve`: ms latencies, throughputs, goodput, warnings.

Computed from a run's per-request table (in memory, or read from a run folder's file a column at a
time), so the simulator and the engine report the same numbers. The simulator records each request's
first and last token times, not every token's: the mean ITL is exact (the sum of a request's gaps is
finish - first token), while ITL percentiles weight each request's mean gap by its number of gaps (see
docs/run-format.md).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simulator.request_log import RequestColumns, output_tokens

Requests = pd.DataFrame | RequestColumns  # a request table, in memory or streamed to a file
METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_METRICS = ("ttft", "tpot", "itl")
DEFAULT_PERCENTILES = (99.0,)
SLO_METRICS = ("ttft", "tpot", "e2el")
_COLUMN = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2e_s"}


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`ttft:200 tpot:50` (ms, repeated or comma-separated) as {metric: ms}; ValueError names a bad item."""
    slos: dict[str, float] = {}
    for item in (x for v in items or [] for x in v.replace(",", " ").split()):
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput {item!r}: the metric must be one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: expected METRIC:MILLISECONDS, e.g. ttft:200") from None
        if not (math.isfinite(ms) and ms > 0):
            raise ValueError(f"--goodput {item!r}: the SLO must be a positive number of milliseconds")
        slos[name] = ms
    return slos


def _col(requests: Requests, name: str) -> np.ndarray:
    """One column of a request table in memory, or of a streamed one (read from its file)."""
    if isinstance(requests, RequestColumns):
        return requests.column(name)
    return requests[name].to_numpy()


def _gaps(requests: Requests) -> tuple[np.ndarray, np.ndarray]:
    """Each finished request's mean inter-token gap (s) and its number of gaps (output tokens - 1)."""
    count = _col(requests, "output_len").astype(np.float64)
    count -= 1
    tpot = _col(requests, "tpot_s").astype(np.float64, copy=False)
    ok = np.isfinite(tpot) & (count > 0)
    return tpot[ok], count[ok]


def _weighted_percentiles(values: np.ndarray, weights: np.ndarray, qs) -> list[float]:
    """The qs-th percentiles of `values` repeated `weights` times (inverted CDF, as numpy's
    'inverted_cdf'); one sort for all of them (a streamed 10M-request table is sorted once)."""
    order = np.argsort(values, kind="stable")
    cum = weights[order]
    np.cumsum(cum, out=cum)
    idx = np.minimum(np.searchsorted(cum, np.asarray(qs, np.float64) / 100 * cum[-1], side="left"),
                     len(order) - 1)
    return [float(values[order[i]]) for i in idx]


def latency_stats(requests: Requests, metric: str, percentiles=DEFAULT_PERCENTILES) -> dict:
    """mean, median, std and the percentiles of one metric in ms (None when no request defines it)."""
    keys = ["mean", "median", "std", *(f"p{q:g}" for q in percentiles)]
    if metric == "itl":
        values, weights = _gaps(requests)
        if values.size == 0:
            return dict.fromkeys(keys)
        mean = float(np.dot(values, weights) / weights.sum())
        var = float(np.dot((values - mean) ** 2, weights) / weights.sum())
        median, *pcts = _weighted_percentiles(values, weights, [50, *percentiles])
        stats = {"mean": mean, "median": median, "std": math.sqrt(var)}
        stats |= {f"p{q:g}": v for q, v in zip(percentiles, pcts, strict=True)}
    else:
        values = _col(requests, _COLUMN[metric]).astype(np.float64, copy=False)
        values = values[~np.isnan(values)]  # a copy: median and percentiles may reorder it in place
        if values.size == 0:
            return dict.fromkeys(keys)
        mean, std = float(values.mean()), float(values.std())
        stats = {"mean": mean, "median": float(np.median(values, overwrite_input=True)), "std": std}
        stats |= {f"p{q:g}": float(np.percentile(values, q, overwrite_input=True)) for q in percentiles}
    return {k: 1e3 * v for k, v in stats.items()}


def _meets(requests: Requests, slos: dict[str, float]) -> np.ndarray:
    """Which requests finished within every SLO (a request with one output token has no TPOT: it passes)."""
    ok = ~np.isnan(_col(requests, "finish_s"))
    for name, ms in slos.items():
        v = _col(requests, _COLUMN[name]).astype(np.float64) * 1e3
        ok &= np.where(np.isnan(v), name == "tpot", v <= ms)
    return ok


def bench_metrics(requests: Requests, duration_s: float, *, metrics=DEFAULT_METRICS,
                  percentiles=DEFAULT_PERCENTILES, goodput: dict[str, float] | None = None) -> dict:
    """The `vllm bench serve` result of one run: counts, throughputs, goodput and latency statistics."""
    done = ~np.isnan(_col(requests, "finish_s"))
    # Column by column (not requests[done]): a 10M-request table is not copied whole.
    out_tokens = output_tokens(_col(requests, "output_len")[done], _col(requests, "n")[done],
                               _col(requests, "beam_width")[done])
    in_tokens = int(_col(requests, "prompt_len")[done].sum())
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    result = {
        "duration_s": float(duration_s),
        "completed": int(done.sum()),
        "rejected": int(_col(requests, "rejected").sum()),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": per_s(int(done.sum())),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
    }
    if goodput:
        result["goodput_slos_ms"] = dict(goodput)
        result["request_goodput"] = per_s(int(_meets(requests, goodput).sum()))
    for m in metrics:
        for stat, value in latency_stats(requests, m, percentiles).items():
            result[f"{stat}_{m}_ms"] = value
    return result


def rejection_warning(requests: Requests, max_model_len: int, capacity_tokens: int) -> str | None:
    """Why and how many requests were refused, or None when none was."""
    rejected = _col(requests, "rejected").astype(bool, copy=False)
    if not rejected.any():
        return None
    num_rejected = int(rejected.sum())
    too_long = int(((_col(requests, "prompt_len")[rejected] + _col(requests, "output_len")[rejected])
                    > max_model_len).sum())
    reasons = []
    if too_long:
        reasons.append(f"{too_long:,} longer than max_model_len {max_model_len:,} (prompt + output)")
    if too_long < num_rejected:
        reasons.append(f"{num_rejected - too_long:,} need more KV slots than the pool's {capacity_tokens:,}")
    return (f"{num_rejected:,} of {len(requests):,} requests were rejected ({'; '.join(reasons)}); "
            "their latencies are not in the statistics")


def queue_lengths(requests: Requests, times: np.ndarray) -> np.ndarray:
    """Requests waiting for their first admission at each time (rejected requests are left out)."""
    kept = ~_col(requests, "rejected").astype(bool, copy=False)
    arrival = _col(requests, "arrival_s").astype(np.float64, copy=False)[kept]
    arrival.sort()  # in place (a copy already): a 10M-request table's columns are 80 MB each
    left = _col(requests, "admitted_s").astype(np.float64, copy=False)[kept]
    left[np.isnan(left)] = np.inf
    left.sort()
    return np.searchsorted(arrival, times, side="right") - np.searchsorted(left, times, side="right")


def overload_warning(requests: Requests, duration_s: float) -> str | None:
    """A warning when the waiting queue still grows at the end of the trace (arrivals outpace service)."""
    last = float(_col(requests, "arrival_s").max())
    if last <= 0 or len(requests) < 10:
        return None
    half, three_q, end = queue_lengths(requests, np.array([0.5, 0.75, 1.0]) * last)
    if not (half < three_q < end and end >= max(10, len(requests) // 100)):
        return None
    return (f"overloaded: the waiting queue grew from {half:,} to {three_q:,} to {end:,} requests at 50%, "
            f"75% and 100% of the trace's {last:,.0f} s, and the run took {duration_s:,.0f} s of simulated "
            "time; lower the rate (--request-rate) or give a larger pool")

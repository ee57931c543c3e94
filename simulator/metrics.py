"""Serving metrics in the conventions of `vllm bench serve`: ms latencies, throughputs, goodput, warnings.

Computed from a run's per-request table (simulator.results.request_table or a measured replay's), so the
simulator and the engine report the same numbers. The simulator records each request's first and last
token times, not every token's: the mean ITL is exact (the sum of a request's gaps is finish - first
token), while ITL percentiles weight each request's mean gap by its number of gaps (see docs/run-format.md).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

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


def _gaps(requests: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Each finished request's mean inter-token gap (s) and its number of gaps (output tokens - 1)."""
    tpot = requests["tpot_s"].to_numpy(np.float64)
    count = (requests["output_len"].to_numpy(np.float64) - 1).clip(min=0)
    ok = np.isfinite(tpot) & (count > 0)
    return tpot[ok], count[ok]


def _weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The q-th percentile of `values` repeated `weights` times (inverted CDF, as numpy's 'inverted_cdf')."""
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    idx = int(np.searchsorted(cum, q / 100 * cum[-1], side="left"))
    return float(values[order][min(idx, len(order) - 1)])


def latency_stats(requests: pd.DataFrame, metric: str, percentiles=DEFAULT_PERCENTILES) -> dict:
    """mean, median, std and the percentiles of one metric in ms (None when no request defines it)."""
    keys = ["mean", "median", "std", *(f"p{q:g}" for q in percentiles)]
    if metric == "itl":
        values, weights = _gaps(requests)
        if values.size == 0:
            return dict.fromkeys(keys)
        mean = float(np.dot(values, weights) / weights.sum())
        var = float(np.dot((values - mean) ** 2, weights) / weights.sum())
        stats = {"mean": mean, "median": _weighted_percentile(values, weights, 50), "std": math.sqrt(var)}
        stats |= {f"p{q:g}": _weighted_percentile(values, weights, q) for q in percentiles}
    else:
        values = requests[_COLUMN[metric]].dropna().to_numpy(np.float64)
        if values.size == 0:
            return dict.fromkeys(keys)
        stats = {"mean": float(values.mean()), "median": float(np.median(values)), "std": float(values.std())}
        stats |= {f"p{q:g}": float(np.percentile(values, q)) for q in percentiles}
    return {k: 1e3 * v for k, v in stats.items()}


def _meets(requests: pd.DataFrame, slos: dict[str, float]) -> np.ndarray:
    """Which requests finished within every SLO (a request with one output token has no TPOT: it passes)."""
    ok = requests["finish_s"].notna().to_numpy().copy()
    for name, ms in slos.items():
        v = requests[_COLUMN[name]].to_numpy(np.float64) * 1e3
        ok &= np.where(np.isnan(v), name == "tpot", v <= ms)
    return ok


def bench_metrics(requests: pd.DataFrame, duration_s: float, *, metrics=DEFAULT_METRICS,
                  percentiles=DEFAULT_PERCENTILES, goodput: dict[str, float] | None = None) -> dict:
    """The `vllm bench serve` result of one run: counts, throughputs, goodput and latency statistics."""
    done = requests["finish_s"].notna().to_numpy()
    fin = requests[done]
    samples = fin["n"].where(fin["beam_width"] <= 1, 1)
    out_tokens = int((fin["output_len"] * samples).sum())
    in_tokens = int(fin["prompt_len"].sum())
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    result = {
        "duration_s": float(duration_s),
        "completed": int(done.sum()),
        "rejected": int(requests["rejected"].sum()),
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


def rejection_warning(requests: pd.DataFrame, max_model_len: int, capacity_tokens: int) -> str | None:
    """Why and how many requests were refused, or None when none was."""
    rejected = requests["rejected"].to_numpy(bool)
    if not rejected.any():
        return None
    rej = requests[rejected]
    too_long = int(((rej["prompt_len"] + rej["output_len"]) > max_model_len).sum())
    reasons = []
    if too_long:
        reasons.append(f"{too_long:,} longer than max_model_len {max_model_len:,} (prompt + output)")
    if too_long < len(rej):
        reasons.append(f"{len(rej) - too_long:,} need more KV slots than the pool's {capacity_tokens:,}")
    return (f"{len(rej):,} of {len(requests):,} requests were rejected ({'; '.join(reasons)}); "
            "their latencies are not in the statistics")


def queue_lengths(requests: pd.DataFrame, times: np.ndarray) -> np.ndarray:
    """Requests waiting for their first admission at each time (rejected requests are left out)."""
    requests = requests[~requests["rejected"].to_numpy(bool)]
    arrival = np.sort(requests["arrival_s"].to_numpy(np.float64))
    admitted = requests["admitted_s"].to_numpy(np.float64)
    left = np.sort(np.where(np.isnan(admitted), np.inf, admitted))
    return np.searchsorted(arrival, times, side="right") - np.searchsorted(left, times, side="right")


def overload_warning(requests: pd.DataFrame, duration_s: float) -> str | None:
    """A warning when the waiting queue still grows at the end of the trace (arrivals outpace service)."""
    last = float(requests["arrival_s"].max())
    if last <= 0 or len(requests) < 10:
        return None
    half, three_q, end = queue_lengths(requests, np.array([0.5, 0.75, 1.0]) * last)
    if not (half < three_q < end and end >= max(10, len(requests) // 100)):
        return None
    return (f"overloaded: the waiting queue grew from {half:,} to {three_q:,} to {end:,} requests at 50%, "
            f"75% and 100% of the trace's {last:,.0f} s, and the run took {duration_s:,.0f} s of simulated "
            "time; lower the rate (--request-rate) or give a larger pool")

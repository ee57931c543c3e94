"""A run's statistics: its summary (`run_summary`, `add_latencies`) and serving metrics in the conventions
of `vllm bench serve` (ms latencies, throughputs, goodput, warnings).

Computed from a run's per-request table (in memory, or read from a run folder's file a column at a
time), so the simulator and the engine report the same numbers; the ITL from the run's every
inter-token gap, pooled as vLLM pools them (GapHistogram, filled by the loop). The request table holds
first and last token times only: the per-second peaks space a request's tokens evenly (see
docs/run-format.md).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from pagelab.column_stats import (
    BATCH_ROWS,
    Batches,
    GapHistogram,
    median_and_percentiles,
)
from simulator.output.memory_rows import frame_means, weighted_means
from simulator.output.request_rows import RequestColumns, RequestTotals, output_tokens
from simulator.slo import Limit
from traces.batches import FrameBatches

if TYPE_CHECKING:
    from simulator.output import Kept

Requests = pd.DataFrame | RequestColumns  # a request table, in memory or streamed to a file
METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_METRICS = ("ttft", "tpot", "itl")
DEFAULT_PERCENTILES = (99.0,)
_COLUMN = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2e_s"}


def request_batches(requests: Requests, names: tuple[str, ...]) -> Iterator[dict[str, np.ndarray]]:
    """Columns of a request table in memory or streamed to a file, a batch of rows at a time: a
    10M-request table is never read whole (column_stats.py)."""
    if isinstance(requests, RequestColumns):
        return requests.batches(names)
    return FrameBatches(requests).iter_batches(names, BATCH_ROWS)


def _finite(requests: Requests, name: str) -> Batches:
    """The column's defined (non-NaN) values, batch by batch, unweighted."""
    def read():
        for b in request_batches(requests, (name,)):
            v = b[name].astype(np.float64, copy=False)
            yield v[~np.isnan(v)], None
    return read


def _moments(read: Batches, spread: bool = True) -> tuple[int, float, float, float]:
    """(count, count as a float, mean, std) of the values (std NaN without `spread`)."""
    count, weight, total = 0, 0.0, 0.0
    for v, _ in read():
        count += len(v)
        weight += float(len(v))
        total += float(v.sum())
    if count == 0:
        return 0, 0.0, math.nan, math.nan
    mean = total / weight
    if not spread:
        return count, weight, mean, math.nan
    squares = 0.0
    for v, _ in read():
        squares += float(((v - mean) ** 2).sum())
    return count, weight, mean, math.sqrt(squares / weight)


def _written_totals(requests: Requests) -> RequestTotals | None:
    """The totals summed as a streamed request table was written (None for a frame, or none kept)."""
    if isinstance(requests, RequestColumns) and requests.totals.num_requests:
        return requests.totals
    return None


def _column_moments(requests: Requests, name: str, spread: bool) -> tuple[int, float, float, float]:
    """`_moments` of a column's defined values; a file-backed table computes them (spread included) once."""
    if not isinstance(requests, RequestColumns):
        return _moments(_finite(requests, name), spread)
    key = ("moments", name)
    if key not in requests.memo:
        requests.memo[key] = _moments(_finite(requests, name), spread=True)
    return requests.memo[key]


def _column_percentiles(requests: Requests, name: str, count: int, qs) -> tuple[float, list[float]]:
    """`median_and_percentiles` of a column's defined values; a file-backed table keeps the values it
    selected, so a later call selects only ranks not asked before (a 10M-row column takes ~1 s a pass)."""
    known = requests.memo.setdefault(("ranks", name), {}) if isinstance(requests, RequestColumns) else None
    return median_and_percentiles(_finite(requests, name), count, qs, known)


def column_summary(requests: Requests, name: str) -> dict:
    """Mean, p50, p90 and p99 of a latency column in seconds (None when no request defines it)."""
    count, _, mean, _ = _column_moments(requests, name, spread=False)
    if count == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    _, (p50, p90, p99) = _column_percentiles(requests, name, count, (50, 90, 99))
    return {"mean": mean, "p50": p50, "p90": p90, "p99": p99}


def latency_stats(requests: Requests, metric: str, percentiles=DEFAULT_PERCENTILES,
                  gaps: GapHistogram | None = None) -> dict:
    """mean, median, std and the percentiles of one metric in ms (None when no request defines it); the
    ITL's from the run's pooled `gaps` (None without them: a request table holds no gaps)."""
    keys = ["mean", "median", "std", *(f"p{q:g}" for q in percentiles)]
    if metric == "itl":
        count, mean, std = gaps.moments() if gaps is not None else (0, math.nan, math.nan)
    else:
        count, _, mean, std = _column_moments(requests, _COLUMN[metric], spread=True)
    if count == 0:
        return dict.fromkeys(keys)
    if metric == "itl":
        median, pcts = gaps.median_and_percentiles(percentiles)
    else:
        median, pcts = _column_percentiles(requests, _COLUMN[metric], count, percentiles)
    stats = {"mean": mean, "median": median, "std": std}
    stats |= {f"p{q:g}": v for q, v in zip(percentiles, pcts, strict=True)}
    return {k: 1e3 * v for k, v in stats.items()}


def _num_meeting(requests: Requests, limits: tuple[Limit, ...]) -> int:
    """Requests that finished within every limit (a request with one output token has no TPOT: it passes)."""
    num = 0
    for b in request_batches(requests, ("finish_s", *(limit.column for limit in limits))):
        ok = ~np.isnan(b["finish_s"])
        for limit in limits:
            v = b[limit.column].astype(np.float64)
            ok &= np.where(np.isnan(v), limit.metric == "tpot", limit.within(v))
        num += int(ok.sum())
    return num


def bench_metrics(requests: Requests, duration_s: float, *, metrics=DEFAULT_METRICS,
                  percentiles=DEFAULT_PERCENTILES, goodput: tuple[Limit, ...] = (),
                  gaps: GapHistogram | None = None) -> dict:
    """The `vllm bench serve` result of one run: counts, throughputs, goodput and latency statistics.

    `goodput`: per-request limits (simulator.slo.parse_goodput); saved, as vLLM does, in milliseconds.
    `gaps`: the run's inter-token gaps (RunResult.itl), for the ITL.
    """
    completed = rejected = in_tokens = out_tokens = 0
    totals = _written_totals(requests)
    if totals is not None:  # no pass over the table
        completed, rejected = totals.num_finished, totals.num_rejected
        in_tokens, out_tokens = totals.input_tokens, totals.output_tokens
    else:
        names = ("finish_s", "rejected", "prompt_len", "output_len", "n", "beam_width")
        for b in request_batches(requests, names):
            done = ~np.isnan(b["finish_s"])
            completed += int(done.sum())
            rejected += int(b["rejected"].sum())
            in_tokens += int(b["prompt_len"][done].sum())
            out_tokens += output_tokens(b["output_len"][done], b["n"][done], b["beam_width"][done])
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    result = {
        "duration_s": float(duration_s),
        "completed": completed,
        "rejected": rejected,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": per_s(completed),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        **peak_metrics(requests),
    }
    if goodput:
        result["goodput_slos_ms"] = {limit.metric: limit.in_unit("ms") for limit in goodput}
        result["request_goodput"] = per_s(_num_meeting(requests, goodput))
    for m in metrics:
        for stat, value in latency_stats(requests, m, percentiles, gaps).items():
            result[f"{stat}_{m}_ms"] = value
    return result


def peak_metrics(requests: Requests) -> dict:
    """`vllm bench serve`'s peak output tokens per second and peak concurrent requests (peaks.py)."""
    from simulator import peaks  # loaded when a run ends, not when the CLI starts

    return peaks.peak_metrics(lambda names: request_batches(requests, names))


# The options that grow a pool the GPU sizes (a pool given in GiB or token slots ignores the last two).
GPU_POOL_OPTIONS = "--kv-memory-gb, --gpu-memory-utilization or a larger --gpu"


def rejection_warning(requests: Requests, max_model_len: int, pool: str, model_limit: int | None = None,
                      pool_options: str = GPU_POOL_OPTIONS, source: str | None = None) -> str | None:
    """How many requests were refused, why, and what to change so that they are not (None when none was).

    `pool`: the KV pool in words ("6 blocks of 16 tokens"); `model_limit`: the model's own context, when
    max_model_len was set below it; `pool_options`: the options that would make the pool larger; `source`:
    "replay" for a run that clipped its prompts to fit max_model_len (only an output can be too long then).
    """
    # A clipped prompt keeps one token at least, so a replay needs max_model_len >= the output length.
    clipped = source == "replay"
    num_rejected = too_long = 0
    longest = 0
    for b in request_batches(requests, ("rejected", "prompt_len", "output_len")):
        rejected = b["rejected"].astype(bool, copy=False)
        num_rejected += int(rejected.sum())
        total = b["output_len"][rejected].astype(np.int64)
        if not clipped:  # the last output token is sampled, never stored: prompt + output - 1 KV slots
            total = total + b["prompt_len"][rejected].astype(np.int64) - 1
        too_long += int((total > max_model_len).sum())
        longest = max(longest, int(total.max(initial=0)))
    if not num_rejected:
        return None
    reasons = []
    if too_long and clipped:
        allowed = 1 << (longest - 1).bit_length()
        fits = model_limit is not None and model_limit >= longest
        reasons.append(f"{too_long:,} with an output longer than max_model_len {max_model_len:,} (prompts "
                       f"are clipped, outputs are not): the longest needs {longest:,}; give --max-model-len "
                       f"{min(allowed, model_limit) if fits else allowed}"
                       + (f" (the model allows {model_limit:,})" if fits else ""))
    elif too_long:
        reasons.append(f"{too_long:,} longer than max_model_len {max_model_len:,} (prompt + output - 1): "
                       f"{_longer_context(longest, max_model_len, model_limit)}")
    if too_long < num_rejected:
        reasons.append(f"{num_rejected - too_long:,} need more KV memory than the pool's {pool}: "
                       f"give a larger pool ({pool_options})")
    share = 100 * num_rejected / len(requests)
    return (f"{num_rejected:,} of {len(requests):,} requests ({share:.1f}%) were rejected "
            f"({'; '.join(reasons)}); their latencies are not in the statistics")


SUGGESTED_MODELS = 3  # a warning names the shortest contexts that fit; `pagelab presets` lists the rest


def _longer_context(longest: int, max_model_len: int, model_limit: int | None) -> str:
    """What serves a request of `longest` tokens: a longer --max-model-len where the model allows it, the
    registry checkpoints whose context holds it, or --max-model-len beyond every model's own limit."""
    from simulator.core.models import MODELS

    if model_limit is not None and model_limit > max_model_len:
        allowed = min(model_limit, 1 << (longest - 1).bit_length())
        return (f"the longest needs {longest:,}; give --max-model-len {allowed} (the model allows "
                f"{model_limit:,})")
    fits = sorted((m.max_model_len, m.name) for m in MODELS.values()
                  if m.max_model_len >= longest and m.hf_id is not None)
    models = ", ".join(f"{name} ({length:,})" for length, name in fits[:SUGGESTED_MODELS])
    if len(fits) > SUGGESTED_MODELS:
        models += f" or {len(fits) - SUGGESTED_MODELS} more (pagelab presets)"
    return (f"the longest needs {longest:,}; use a model whose context holds it, {models}" if fits else
            f"the longest needs {longest:,}, more than any registry model's context; --max-model-len "
            f"{longest} simulates it anyway")


def queue_lengths(requests: Requests, times: np.ndarray) -> np.ndarray:
    """Requests waiting for their first admission at each time (rejected requests are left out)."""
    t = np.asarray(times, np.float64)
    waiting = np.zeros(len(t), np.int64)
    for b in request_batches(requests, ("rejected", "arrival_s", "admitted_s")):
        kept = ~b["rejected"].astype(bool, copy=False)
        arrival, admitted = b["arrival_s"][kept], b["admitted_s"][kept]
        if len(t) <= 8:  # a few times: count directly (a sort per batch costs ~1 s at 10M rows)
            waiting += (arrival[:, None] <= t).sum(0) - (admitted[:, None] <= t).sum(0)  # NaN: never
        else:
            arrival, admitted = np.sort(arrival), np.sort(admitted)  # NaN sorts last
            waiting += np.searchsorted(arrival, t, side="right") - np.searchsorted(admitted, t, side="right")
    return waiting


def overload_warning(requests: Requests, duration_s: float) -> str | None:
    """A warning when the waiting queue still grows at the end of the trace (arrivals outpace service)."""
    totals = _written_totals(requests)
    if totals is not None:  # no pass over the table
        last = totals.last_arrival_s
    else:
        arrivals = request_batches(requests, ("arrival_s",))
        last = max((float(b["arrival_s"].max()) for b in arrivals), default=0.0)
    if last <= 0 or len(requests) < 10:
        return None
    half, three_q, end = queue_lengths(requests, np.array([0.5, 0.75, 1.0]) * last)
    if not (half < three_q < end and end >= max(10, len(requests) // 100)):
        return None
    return (f"overloaded: the waiting queue grew from {half:,} to {three_q:,} to {end:,} requests at 50%, "
            f"75% and 100% of the trace's {last:,.0f} s, and the run took {duration_s:,.0f} s of simulated "
            "time; lower the rate (--request-rate) or give a larger pool")


LATENCY_COLUMNS = ("ttft_s", "tpot_s", "e2e_s")  # the summary's latency statistics, in its order


def run_summary(run, kept: Kept, wall_s: float) -> dict:
    """The run's SUMMARY (docs/run-format.md) but for the latency columns' statistics (None until
    `add_latencies`): what needs the run's state, so that a long run can free that state before its
    request table is read again. `run` is the finished RunState."""
    duration = run.now
    totals = kept.requests.totals
    mem, token_occ, block_occ = frame_means(kept.memory) if kept.memory is not None \
        else weighted_means(kept.memory_sums)
    stats = getattr(run.alloc, "stats", None)
    hit_rate = None  # vLLM's: prompt tokens found cached over prompt tokens looked up, first admissions
    if stats is not None and run.enable_prefix_caching and stats.prefix_query_tokens:
        hit_rate = stats.prefix_hit_tokens / stats.prefix_query_tokens
    summary = {
        "allocator": run.allocator,
        "capacity_tokens": int(run.alloc.capacity_tokens),
        "capacity_slots": int(run.alloc.capacity_slots),
        "block_size": int(run.block_size),
        "num_blocks": int(getattr(run.alloc, "num_blocks", run.alloc.capacity_tokens)),
        "num_requests": totals.num_requests,
        "num_finished": totals.num_finished,
        "num_rejected": totals.num_rejected,
        "num_preemptions": totals.num_preemptions,
        "num_steps": int(run.step),
        "sim_duration_s": float(duration),
        "wall_s": float(wall_s),
        "mean_batch_size": float(run.batch_s / run.busy_s) if run.busy_s > 0 else 0.0,
        "throughput_tokens_per_s": float(totals.output_tokens / duration) if duration > 0 else 0.0,
        "normalized_latency_s_per_token": totals.normalized_sum / totals.num_finished
        if totals.num_finished else None,
        **{name: None for name in LATENCY_COLUMNS},
        "memory": mem,
        "token_occupancy": token_occ,
        "block_occupancy": block_occ,
        "prefix_cache_hit_rate": hit_rate,
        "allocator_stats": stats.as_dict() if stats is not None else {},
    }
    tiers = getattr(run.alloc, "tiers", None)
    if tiers is not None:  # tokens by source and each tier's counters, only for runs with tiers
        summary["kv_tiers"] = tiers.summary(stats.prefix_query_tokens, stats.prefix_hit_tokens)
    return summary


def add_latencies(summary: dict, requests: RequestColumns) -> dict:
    """Fill in `run_summary`'s latency statistics (mean, p50, p90, p99 of each column) from the requests."""
    for name in LATENCY_COLUMNS:
        summary[name] = column_summary(requests, name)
    return summary

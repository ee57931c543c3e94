"""Per-request table and run summary from a finished simulation (or a measured replay)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from simulator.core.allocator import MemoryBreakdown
from simulator.metrics import column_summary
from simulator.request_log import RequestColumns, RequestTotals, derived_columns
from simulator.run_state import RunState

STATES = MemoryBreakdown.STATES
LATENCY_COLUMNS = ("ttft_s", "tpot_s", "e2e_s")  # the summary's latency statistics, in its order


def request_table(run: RunState) -> pd.DataFrame:
    """One row per request with times and derived latencies (NaN where undefined), from a run that kept
    per-request arrays (a measured replay; a simulation hands its rows to a RequestLog instead)."""
    t = run.trace
    df = pd.DataFrame({
        "request_id": t["request_id"].to_numpy(np.int64),
        "arrival_s": run.arrival,
        "prompt_len": run.prompt,
        "output_len": run.output,
        "n": run.n,
        "beam_width": run.beam,
        "admitted_s": run.admitted,
        "first_token_s": run.first_token,
        "finish_s": run.finish,
        "num_preemptions": run.preemptions,
        "rejected": run.rejected,
        "prefix_hit_tokens": run.hit_tokens,
        **derived_columns(run.arrival, run.output, run.admitted, run.first_token, run.finish),
    }, copy=False)  # the run's arrays become the table's columns
    return df


def memory_summary(memory: pd.DataFrame) -> dict:
    """Time-weighted means of the taxonomy fractions (and occupancies) over the whole run."""
    w = memory["dt_s"].to_numpy()
    total = w.sum()
    if total <= 0:
        return {**{s: float("nan") for s in STATES}, "cached_free": float("nan")}, float("nan"), float("nan")
    mean = {s: float(np.dot(memory[s].to_numpy(), w) / total) for s in STATES}
    mean["cached_free"] = float(np.dot(memory["cached_free"].to_numpy(), w) / total)
    return (mean, float(np.dot(memory["token_occupancy"].to_numpy(), w) / total),
            float(np.dot(memory["block_occupancy"].to_numpy(), w) / total))


def summarize(run: RunState, requests: RequestColumns, memory: pd.DataFrame | None,
              wall_s: float) -> dict:
    """The run's SUMMARY (see docs/run-format.md); `memory` None: the rows were streamed to a file and
    the memory log kept the time-weighted sums."""
    return add_latencies(run_summary(run, requests.totals, memory, wall_s), requests)


def run_summary(run: RunState, totals: RequestTotals, memory: pd.DataFrame | None, wall_s: float) -> dict:
    """The SUMMARY but for the latency columns' statistics (None until `add_latencies`): what needs the
    run's state, so that a long run can free that state before its request table is read again."""
    duration = run.now
    mem, token_occ, block_occ = memory_summary(memory) if memory is not None else run.mem.weighted_means()
    stats = getattr(run.alloc, "stats", None)
    hit_rate = None
    if stats is not None and run.enable_prefix_caching and stats.prefix_queries:
        hit_rate = stats.prefix_hits / stats.prefix_queries
    return {
        "allocator": run.allocator,
        "capacity_tokens": int(run.alloc.capacity_tokens),
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


def add_latencies(summary: dict, requests: RequestColumns) -> dict:
    """Fill in `run_summary`'s latency statistics (mean, p50, p90, p99 of each column) from the requests."""
    for name in LATENCY_COLUMNS:
        summary[name] = column_summary(requests, name)
    return summary

"""Simulated vs measured: per-request latency errors, throughput error, per-step time and memory differences.

`compare_runs(sim, real)` takes two runs' tables (requests, memory, summary) and answers how far the
simulation is from the measurement. Relative errors are (simulated - measured) / measured, per request
over the requests both runs finished; "abs" statistics are of their absolute values.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simulator.timing.calibrate import check_steps
from simulator.timing.step_latency import DECODE_FEATURE, FEATURES, LatencyModel, stall_mask

LATENCIES = ("ttft_s", "tpot_s", "e2e_s")
# Memory columns compared step for step (not the clock, and not cached_free: the engine hashes every full
# block's real tokens, the simulator knows only the trace's prefix blocks, so their caches keep different
# evictable blocks without changing any decision).
MEMORY_COMPARED = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free",
                   "block_occupancy", "num_running", "num_waiting", "num_swapped", "num_batched_tokens",
                   "blocks_used")


@dataclass
class RunTables:
    """What compare needs of one run folder's allocator."""

    summary: dict
    requests: pd.DataFrame | None  # None: the table cannot be read (what needs it is not compared)
    memory: pd.DataFrame | None
    steps: pd.DataFrame | None = None  # a replay's steps table (docs/run-format.md)


def rel_error_stats(sim: np.ndarray, real: np.ndarray) -> dict:
    """Median and p90 of |relative error|, the signed median, and the count, over finite pairs."""
    sim, real = np.asarray(sim, np.float64), np.asarray(real, np.float64)
    ok = np.isfinite(sim) & np.isfinite(real) & (real > 0)
    if not ok.any():
        return {"count": 0, "median_abs": None, "p90_abs": None, "median": None}
    rel = (sim[ok] - real[ok]) / real[ok]
    return {"count": int(ok.sum()), "median_abs": float(np.median(np.abs(rel))),
            "p90_abs": float(np.percentile(np.abs(rel), 90)), "median": float(np.median(rel))}


def per_step_times(memory: pd.DataFrame) -> np.ndarray:
    """Duration of every step in order; a fast-mode span's steps each get the span's mean."""
    busy = memory[memory["num_steps"] > 0].sort_values("step", kind="stable")
    counts = busy["num_steps"].to_numpy(np.int64)
    return np.repeat(busy["dt_s"].to_numpy(np.float64) / counts, counts)


def memory_difference(sim: pd.DataFrame, real: pd.DataFrame) -> dict:
    """Per-step memory difference of two step-by-step runs: max |difference| per column, steps that differ."""
    s = sim[sim["num_steps"] > 0].sort_values("step", kind="stable").reset_index(drop=True)
    r = real[real["num_steps"] > 0].sort_values("step", kind="stable").reset_index(drop=True)
    if (s["num_steps"] != 1).any() or (r["num_steps"] != 1).any():
        return {"step_aligned": False, "reason": "a run has multi-step rows (fast mode); simulate with "
                                                 "--mode step or --step-times-from to compare memory"}
    n = min(len(s), len(r))
    diff = np.abs(s.loc[: n - 1, list(MEMORY_COMPARED)].to_numpy(np.float64)
                  - r.loc[: n - 1, list(MEMORY_COMPARED)].to_numpy(np.float64))
    max_diff = {c: float(diff[:, j].max()) if n else 0.0 for j, c in enumerate(MEMORY_COMPARED)}
    differing = int((diff > 1e-12).any(axis=1).sum()) if n else 0
    return {"step_aligned": True, "num_steps_sim": int(len(s)), "num_steps_real": int(len(r)),
            "num_steps_differing": differing, "max_abs_difference": max_diff,
            "equal": differing == 0 and len(s) == len(r)}


def step_time_error(sim: RunTables, real: RunTables, latency: LatencyModel | None = None) -> dict:
    """Per-step time error. With the simulation's latency model and the measured run's steps table: the
    model's time for each measured step against its measured time (what a step of that shape costs, even
    when the two runs batch differently). Otherwise step k of one run against step k of the other, which
    means something only when the runs made the same decisions (`--step-times-from`)."""
    st_s, st_r = per_step_times(sim.memory), per_step_times(real.memory)
    out = {"num_steps_sim": int(len(st_s)), "num_steps_real": int(len(st_r))}
    if latency is not None and real.steps is not None:
        check_steps(real.steps, "measured run")  # the columns calibrate fits: its check
        busy = real.steps[real.steps["num_batched_tokens"] > 0]
        predicted = latency.step_times(*(busy[f].to_numpy(np.float64) for f in (*FEATURES, DECODE_FEATURE)))
        measured = busy["dt_s"].to_numpy(np.float64)
        return {**out, "basis": "latency model on the measured steps", **rel_error_stats(predicted, measured),
                "total_rel_error": float((predicted.sum() - measured.sum()) / measured.sum())
                if measured.sum() > 0 else None,
                "stalls": stalls(busy["step"].to_numpy(), predicted, measured)}
    n = min(len(st_s), len(st_r))
    return {**out, "basis": "step index", **rel_error_stats(st_s[:n], st_r[:n]),
            "total_rel_error": float((st_s.sum() - st_r.sum()) / st_r.sum()) if st_r.sum() > 0 else None}


def stalls(steps: np.ndarray, predicted: np.ndarray, measured: np.ndarray) -> dict:
    """The measured steps that are stalls against their modelled times (step_latency.stall_mask): how
    many, which, and what share of the measured busy time their excess is."""
    excess = measured - predicted
    hit = stall_mask(predicted, measured)
    total = float(measured.sum())
    return {"count": int(hit.sum()), "steps": [int(k) for k in steps[hit]],
            "excess_s": float(excess[hit].sum()),
            "busy_share": float(excess[hit].sum() / total) if total > 0 else None}


def request_mismatch(sim: RunTables, real: RunTables, partial: bool = False) -> str | None:
    """Why the two runs did not serve the same requests (request ids, prompt and output lengths), or None:
    their errors would compare unrelated requests. `partial`: a run stopped early may lack some ids."""
    if sim.requests is None or real.requests is None:
        return None
    a = sim.requests.set_index("request_id")[["prompt_len", "output_len"]]
    b = real.requests.set_index("request_id")[["prompt_len", "output_len"]]
    common = a.index.intersection(b.index)
    if not partial and (len(common) < len(a) or len(common) < len(b)):
        return (f"they served different requests: {len(a):,} and {len(b):,} requests, {len(common):,} "
                f"request ids in common")
    differ = int((a.loc[common] != b.loc[common]).any(axis=1).sum())
    if differ or not len(common):
        return (f"they served different requests: {differ:,} of the {len(common):,} request ids in common "
                f"have other prompt or output lengths")
    return None


def compare_runs(sim: RunTables, real: RunTables, latency: LatencyModel | None = None) -> dict:
    """Every error `pagelab compare` reports (docs/calibration.md); `latency` is the simulation's model.
    What needs a table one of the runs lacks (None) is reported as not compared."""
    if sim.requests is not None and real.requests is not None:
        a = sim.requests.set_index("request_id")
        b = real.requests.set_index("request_id")
        common = a.index.intersection(b.index)
        a, b = a.loc[common], b.loc[common]
        finished = {"sim": int(a["finish_s"].notna().sum()), "real": int(b["finish_s"].notna().sum())}
        out: dict = {"num_requests": int(len(common)), "num_finished": finished}
        out["latency"] = {m: rel_error_stats(a[m].to_numpy(), b[m].to_numpy()) for m in LATENCIES}
    else:
        out = {"num_requests": None, "num_finished": None,
               "latency": {m: rel_error_stats(np.empty(0), np.empty(0)) for m in LATENCIES}}
    thr_s = sim.summary.get("throughput_tokens_per_s")
    thr_r = real.summary.get("throughput_tokens_per_s")
    out["throughput"] = {"sim": thr_s, "real": thr_r,
                         "rel_error": (thr_s - thr_r) / thr_r if thr_s is not None and thr_r else None}
    dur_s, dur_r = sim.summary.get("sim_duration_s"), real.summary.get("sim_duration_s")
    out["duration"] = {"sim": dur_s, "real": dur_r,
                       "rel_error": (dur_s - dur_r) / dur_r if dur_s is not None and dur_r else None}
    if sim.memory is None or real.memory is None:
        out["step_time"] = {"num_steps_sim": None, "num_steps_real": None, "basis": "not compared",
                            **rel_error_stats(np.empty(0), np.empty(0)), "total_rel_error": None}
        out["memory"] = {"step_aligned": False, "reason": "a memory table cannot be read"}
        return out
    out["step_time"] = step_time_error(sim, real, latency)
    out["memory"] = memory_difference(sim.memory, real.memory)
    return out

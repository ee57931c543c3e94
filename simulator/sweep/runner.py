"""Run a whole sweep: the grid, then the max-rate search, then the tables and the summary.

Layout of a sweep folder (docs/sweeps.md): trace.parquet (the trace every worker reads), points/<name>/
(one run folder per point), sweep.parquet (one row per point), max_rates.parquet (one row per
configuration) and summary.json. Tables and summary are rewritten atomically at the end; points are
written as they finish, so a re-run reuses every finished point (matched by config hash). A point whose
worker died twice has no folder and a row with its cause in `error`: the sweep goes on without it, and a
re-run runs it again.
"""
from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from pagelab.atomic import atomic_write
from pagelab.run_folder import write_json
from pagelab.writes import write_parquet
from simulator.slo import Limit
from simulator.sweep.axes import SweepAxes, SweepError
from simulator.sweep.points import POINTS_DIR, PointFailed, PointSpec, finished_summary, trace_fingerprint
from simulator.sweep.search import DEFAULT_SEARCH_RUNS, DEFAULT_TOLERANCE, SearchState, search_state
from simulator.sweep.table import failed_row, max_rate_rows, point_row, points_table

TRACE_FILE = "trace.parquet"


@dataclass(frozen=True)
class SweepPlan:
    """What to sweep and how to search."""

    axes: SweepAxes
    slo: Limit
    search: bool = True
    tolerance: float = DEFAULT_TOLERANCE
    max_search_runs: int = DEFAULT_SEARCH_RUNS

    def __post_init__(self) -> None:
        if not 1e-4 <= self.tolerance < 1:
            raise SweepError(f"--tolerance must be in [0.0001, 1), got {self.tolerance}")
        if self.max_search_runs < 0:
            raise SweepError(f"--search-runs must be >= 0, got {self.max_search_runs}")


@dataclass(frozen=True)
class PointDone:
    """Progress report for one point (finished now, reused from an earlier run, or failed: `error`)."""

    spec: PointSpec
    summary: dict
    reused: bool
    done: int
    total: int
    error: str | None = None  # why the point failed (its summary is then empty)


@dataclass
class SweepResult:
    """The sweep's tables and counts."""

    points: pd.DataFrame
    max_rates: pd.DataFrame
    num_run: int
    num_reused: int
    num_failed: int = 0


def write_trace(out: Path, trace: pd.DataFrame) -> Path:
    """The shared trace file the local workers load once (atomic, so a worker never reads half of it)."""
    return atomic_write(out / TRACE_FILE, lambda tmp: write_parquet(tmp, trace))


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Delete hidden half-written point folders left by a killed sweep (SIGKILL/SIGTERM skip the cleanup).

    One sweep writes a folder at a time: a temporary folder here belongs to a process that is gone.
    """
    stale = sorted((out / POINTS_DIR).glob(".*.tmp-*")) + sorted((out / POINTS_DIR).glob(".*.old-*"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def run_sweep(trace: pd.DataFrame, source: str, plan: SweepPlan, out: Path, executor,
              progress: Callable[[PointDone], None] | None = None) -> SweepResult:
    """Run the grid and the search with `executor`, reusing finished points; write tables and summary."""
    axes = plan.axes
    trace_hash = trace_fingerprint(trace)
    configs = axes.configs()
    sims = [axes.sim_config(c) for c in configs]
    write_trace(out, trace)
    remove_stale_temporaries(out)
    results: dict[str, tuple[PointSpec, dict, str]] = {}  # point hash -> (spec, summary, kind)
    failed: dict[str, tuple[PointSpec, str, str]] = {}  # point hash -> (spec, cause, kind)
    counts = {"run": 0, "reused": 0, "failed": 0, "total": 0}

    def run_batch(specs: list[PointSpec], kind: str) -> None:
        fresh = [s for s in dict.fromkeys(specs) if s.key not in results and s.key not in failed]
        counts["total"] += len(fresh)
        todo = []
        for spec in fresh:
            summary = finished_summary(out, spec)
            if summary is None:
                todo.append(spec)
                continue
            results[spec.key] = (spec, summary, kind)
            counts["reused"] += 1
            _report(progress, spec, summary, True, results, counts, None, len(failed))
        for spec, summary in executor.run(todo, source, out):
            if isinstance(summary, PointFailed):
                failed[spec.key] = (spec, summary.cause, kind)
                counts["failed"] += 1
                _report(progress, spec, {}, False, results, counts, summary.cause, len(failed))
                continue
            results[spec.key] = (spec, summary, kind)
            counts["run"] += 1
            _report(progress, spec, summary, False, results, counts, None, len(failed))

    def spec(i: int, rate: float) -> PointSpec:
        return PointSpec(tuple(configs[i].items()), rate, sims[i], trace_hash)

    run_batch([spec(i, r) for i in range(len(configs)) for r in axes.rates], "grid")
    search_runs = [0] * len(configs)
    while True:
        states = [_state(plan, results, spec(i, 0.0), search_runs[i]) for i in range(len(configs))]
        # A configuration whose next rate failed cannot search on: it stops, marked in its status.
        states = [dataclasses.replace(st, status="point_failed", next_rate=None)
                  if not st.done and spec(i, st.next_rate).key in failed else st
                  for i, st in enumerate(states)]
        batch = [spec(i, st.next_rate) for i, st in enumerate(states) if plan.search and not st.done]
        if not batch:
            break
        for i, st in enumerate(states):
            search_runs[i] += int(plan.search and not st.done)
        run_batch(batch, "search")
    if not plan.search:  # the grid is all there is: a bracket wider than the tolerance stays as it is
        states = [dataclasses.replace(st, status="grid") if st.status == "searching" else st for st in states]
    rows = [point_row(s, summary, kind, plan.slo, out) for s, summary, kind in results.values()]
    rows += [failed_row(s, cause, kind) for s, cause, kind in failed.values()]
    points = points_table(rows, list(configs[0]))
    runs = [sum(1 for s, _, _ in results.values() if s.config == spec(i, 0.0).config)
            for i in range(len(configs))]
    max_rates = pd.DataFrame(max_rate_rows(configs, states, runs, search_runs))
    _write_tables(out, points, max_rates, source, plan, counts)
    return SweepResult(points, max_rates, counts["run"], counts["reused"], counts["failed"])


def _state(plan: SweepPlan, results: dict, probe: PointSpec, search_runs: int) -> SearchState:
    """The search state of the configuration `probe` belongs to."""
    met = {s.rate: plan.slo.met(summary) for s, summary, _ in results.values() if s.config == probe.config}
    return search_state(met, plan.axes.bounds, search_runs, plan.tolerance, plan.max_search_runs)


def _report(progress, spec, summary, reused, results, counts, error, num_failed) -> None:
    if progress is not None:
        progress(PointDone(spec, summary, reused, len(results) + num_failed, counts["total"], error))


def _write_tables(out: Path, points: pd.DataFrame, max_rates: pd.DataFrame, source: str,
                  plan: SweepPlan, counts: dict) -> None:
    """sweep.parquet, max_rates.parquet and summary.json, each replaced atomically."""
    atomic_write(out / "sweep.parquet", lambda tmp: write_parquet(tmp, points))
    atomic_write(out / "max_rates.parquet", lambda tmp: write_parquet(tmp, max_rates))
    axes = plan.axes
    summary = {
        "trace": source,
        "slo": {"metric": plan.slo.name, "bound": plan.slo.seconds, "text": plan.slo.describe(),
                "spec": plan.slo.format()},
        "axes": {"rate": list(axes.rates), "allocator": list(axes.allocators),
                 **{k: list(v) for k, v in axes.axes.items()}},
        "rate_bounds": list(axes.bounds),
        "search": {"enabled": plan.search, "tolerance": plan.tolerance,
                   "max_search_runs": plan.max_search_runs},
        "base": {k: v for k, v in axes.base.items() if k != "extra"},
        "points": {"total": len(points), "run_now": counts["run"], "reused": counts["reused"],
                   "failed": counts["failed"]},
        "configurations": max_rates.to_dict(orient="records"),
    }
    atomic_write(out / "summary.json", lambda tmp: write_json(tmp, summary))

"""Sweep overhead benchmark: a sweep's wall time against the summed wall time of its points run one by one.

`python -m bench.sweep [--jobs 2] [--repeats 3] [--ray]` runs one fixed setting (azure-conv, paged and
contiguous-max, 16 rates 0.5-8 req/s, grid only) and prints one JSON record per measurement:
  singles_in_process: each point simulated and written in this process, one after another (no start-up);
  singles_cli: each point as its own `pagelab simulate` process (what a user without sweeps would run);
  sweep_local / sweep_ray: `run_sweep` into a fresh folder (pool or Ray start-up included).
Besides wall seconds, `cpu_s` is the CPU time (user + system) of this process and its reaped children
(pool workers, CLI processes; not Ray's workers): less sensitive than wall time to other jobs on the machine.
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ALLOCATORS = ("paged", "contiguous-max")
RATES = "0.5:8:0.5"


def _plan():
    from simulator.slo import DEFAULT_SLO, parse_slo
    from simulator.sweep import parse_rates
    from simulator.sweep.axes import SweepAxes
    from simulator.sweep.runner import SweepPlan

    rates, bounds = parse_rates(RATES)
    return SweepPlan(SweepAxes(rates, bounds, ALLOCATORS, {}, {}), parse_slo(DEFAULT_SLO),
                     search=False)


def singles_in_process(trace, plan, work: Path) -> float:
    """Seconds to simulate and write every point serially in this process."""
    from simulator.sweep.executors import SerialExecutor
    from simulator.sweep.runner import run_sweep

    t0 = time.perf_counter()
    run_sweep(trace, "azure-conv", plan, work, SerialExecutor(trace))
    return time.perf_counter() - t0


def singles_cli(plan, work: Path) -> float:
    """Seconds for one `pagelab simulate -a A --rate R --no-events --out ...` process per point."""
    total = 0.0
    for allocator in plan.axes.allocators:
        for rate in plan.axes.rates:
            cmd = [sys.executable, "-c", "from cli import main; main()", "simulate", "azure-conv", "-a",
                   allocator, "--rate", str(rate), "--no-events", "--out", str(work / f"{allocator}-{rate}")]
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            total += time.perf_counter() - t0
    return total


def sweep_with(trace, plan, work: Path, executor: str, jobs: int) -> float:
    """Seconds for a whole sweep into a fresh folder, executor start-up and shutdown included."""
    from simulator.sweep.executors import LocalExecutor, RayExecutor
    from simulator.sweep.runner import TRACE_FILE, run_sweep

    t0 = time.perf_counter()
    if executor == "ray":
        runner = RayExecutor(trace, num_cpus=jobs)
    else:
        runner = LocalExecutor(jobs, work / TRACE_FILE)
    try:
        run_sweep(trace, "azure-conv", plan, work, runner)
    finally:
        runner.close()
    return time.perf_counter() - t0


def _cpu_s() -> float:
    """User + system CPU seconds of this process and its reaped children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    """Run the measurements and print JSON lines."""
    from traces import load_trace

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ray", action="store_true", help="also time the Ray executor")
    parser.add_argument("--cli", action="store_true", help="also time one CLI process per point")
    args = parser.parse_args()
    trace, plan = load_trace("azure-conv"), _plan()
    kinds = ["singles_in_process", "sweep_local"] + (["sweep_ray"] if args.ray else []) + \
        (["singles_cli"] if args.cli else [])
    for repeat in range(args.repeats):
        for kind in kinds:
            work = Path(tempfile.mkdtemp(prefix="pagelab-bench-sweep-"))
            cpu0 = _cpu_s()
            try:
                if kind == "singles_in_process":
                    seconds = singles_in_process(trace, plan, work)
                elif kind == "singles_cli":
                    seconds = singles_cli(plan, work)
                else:
                    seconds = sweep_with(trace, plan, work, kind.removeprefix("sweep_"), args.jobs)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            cpu = None if kind == "sweep_ray" else round(_cpu_s() - cpu0, 2)
            print(json.dumps({"kind": kind, "repeat": repeat, "jobs": args.jobs, "points": 32,
                              "seconds": round(seconds, 2), "cpu_s": cpu}), flush=True)


if __name__ == "__main__":
    main()

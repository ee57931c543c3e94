"""`pagelab calibrate` (fit a latency profile to measured replays) and `pagelab compare` (sim vs real)."""
from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from cli.common import UserError, console, err_console, user_errors, warn


@user_errors
def calibrate_cmd(
    runs: list[Path] = typer.Argument(..., metavar="RUN...", help="Run folders written by pagelab replay."),
    out: Path = typer.Option(..., "--out", "-o", help="Write the fitted profile (JSON) here."),
    gpu: str = typer.Option(None, help="Device preset the runs were measured on (default: cpu for CPU runs; "
                                       "required for GPU runs, e.g. h100-80gb)."),
    allocator: str = typer.Option(None, help="Fit only this allocator's folder of each run."),
    min_steps: int = typer.Option(20, help="Fewest measured steps a fit accepts."),
    objective: str = typer.Option("absolute", help="absolute (least squares in seconds: total time right) or "
                                                   "relative (every step weighs alike, then scaled to the "
                                                   "measured total time)."),
    sqrt_decode: bool = typer.Option(False, "--sqrt-decode/--no-sqrt-decode",
                                     help="Add a sixth term, c5 * sqrt(decode sequences): per-sequence "
                                          "decode cost falling as batches grow (docs/calibration.md)."),
    prefill_step: bool = typer.Option(False, "--prefill-step/--no-prefill-step",
                                      help="Add a seventh term, c6 per step that prefills: the kernel "
                                           "launches that a GPU's graphed decode steps hide "
                                           "(docs/calibration.md)."),
) -> None:
    """Fit the step-latency model to measured replays; print the fit quality and write a profile."""
    from bench.run_tools import measured_steps, write_profile
    from simulator.timing.step_latency import STALL_FACTOR

    measured = measured_steps(runs, allocator, warn=warn)
    if objective not in ("absolute", "relative"):
        raise UserError(f"--objective must be absolute or relative, got {objective!r}")
    profile = write_profile(measured, out, gpu=gpu, min_steps=min_steps, relative=objective == "relative",
                            sqrt_decode=sqrt_decode, prefill_step=prefill_step)
    fit = profile.meta["fit"]
    coefs = ", ".join(f"{k}={v:.3g}" for k, v in profile.to_dict()["coefficients"].items())
    console.print(f"fitted {profile.model.name} on {profile.gpu.name} (block size {profile.block_size}) "
                  f"to {fit['num_steps']} steps: {coefs}")
    console.print(f"fit quality: R² {fit['r2']:.3f}, RMS {1e3 * fit['rms_s']:.3f} ms, median |rel error| "
                  f"{100 * fit['median_abs_rel_error']:.1f}%, p90 {100 * fit['p90_abs_rel_error']:.1f}%, "
                  f"total time error {100 * fit['total_time_rel_error']:+.1f}%")
    stalled = profile.meta["stalls_excluded"]
    if stalled["count"]:
        console.print(f"left out {stalled['count']} stalls ({stalled['seconds']:.2f} s: steps >= "
                      f"{STALL_FACTOR:g}x the fit's price, first-use compiles or pauses; "
                      "docs/calibration.md)")
    err_console.print(f"wrote {out}")


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def comparison_report(result: dict) -> Table:
    """The table `pagelab compare` prints."""
    t = Table(title="simulated vs measured (relative error = (sim - real) / real)")
    for c in ("metric", "median |err|", "p90 |err|", "median err", "n"):
        t.add_column(c, justify="left" if c == "metric" else "right")
    for metric, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end latency")):
        s = result["latency"][metric]
        t.add_row(label, _pct(s["median_abs"]), _pct(s["p90_abs"]), _pct(s["median"]), str(s["count"]))
    s = result["step_time"]
    basis = "model" if s["basis"].startswith("latency") else "index"
    t.add_row(f"step time (by {basis})", _pct(s["median_abs"]), _pct(s["p90_abs"]), _pct(s["median"]),
              str(s["count"]))
    thr = result["throughput"]
    t.add_row("output throughput", _pct(None if thr["rel_error"] is None else abs(thr["rel_error"])), "-",
              _pct(thr["rel_error"]), "1")
    return t


@user_errors
def compare_cmd(
    sim_run: Path = typer.Argument(..., metavar="SIM_RUN", help="Run folder from pagelab simulate."),
    real_run: Path = typer.Argument(..., metavar="REAL_RUN", help="Run folder from pagelab replay."),
    allocator: str = typer.Option(None, help="Allocator to compare (default: the first both runs have)."),
    out: Path = typer.Option(None, "--out", "-o", help="Write comparison.json and the latency CDF overlay "
                                                       "here."),
    fmt: str = typer.Option("png", "--format", "-f", help="Figure format: png, svg or pdf."),
) -> None:
    """Latency, throughput, step-time and per-step memory differences of a simulation and a replay."""
    from bench.run_tools import compare_folders, write_comparison
    from simulator.timing.step_latency import STALL_FACTOR

    result, sim_folder, real_folder = compare_folders(sim_run, real_run, allocator)
    for message in result.get("warnings", []):
        warn(message)
    console.print(comparison_report(result))
    st, mem = result["step_time"], result["memory"]
    console.print(f"steps: {st['num_steps_sim']} simulated, {st['num_steps_real']} measured; total step "
                  f"time error {_pct(st['total_rel_error'])}; run duration error "
                  f"{_pct(result['duration']['rel_error'])}")
    stalled = st.get("stalls") or {"count": 0}
    if stalled["count"]:
        shown = ", ".join(map(str, stalled["steps"][:8])) + (", ..." if stalled["count"] > 8 else "")
        console.print(f"stalls: {stalled['count']} measured steps took >= {STALL_FACTOR:g}x what the model "
                      f"prices them (+{stalled['excess_s']:.2f} s, {_pct(stalled['busy_share'])} of the "
                      f"measured busy time; steps {shown}): first-use kernel compiles or pauses no step "
                      "model can price (docs/calibration.md)")
    if mem["step_aligned"]:
        verdict = "equal at every step" if mem["equal"] else f"differs at {mem['num_steps_differing']} steps"
        console.print(f"memory breakdown: {verdict} (largest difference "
                      f"{max(mem['max_abs_difference'].values(), default=0):.3g})")
    else:
        console.print(f"memory breakdown: not compared ({mem['reason']})")
    if out is not None:
        path = write_comparison(out, result, sim_folder, real_folder, fmt)
        err_console.print(f"wrote {out / 'comparison.json'}" + (f" and {path}" if path else ""))

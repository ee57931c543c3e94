"""`pagelab calibrate`: fit a latency profile to measured replays (cli/compare.py judges a profile)."""
from __future__ import annotations

from pathlib import Path

import typer

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

    if len({run.resolve() for run in runs}) < len(runs):
        raise UserError("a RUN is given twice: each measured run counts once")
    if min_steps < 1:
        raise UserError(f"--min-steps must be at least 1, got {min_steps}")
    from cli.runs import check_out_file

    check_out_file(out, f"--out {out}")
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

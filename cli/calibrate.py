"""`pagelab calibrate` (fit a latency profile to measured replays) and `pagelab compare` (sim vs real)."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import typer
from rich.table import Table

from cli.common import UserError, atomic_write_bytes, console, err_console, user_errors
from pagelab.errors import PagelabError


def allocator_dirs(run: Path, allocator: str | None = None) -> list[tuple[str, Path]]:
    """The allocator folders of a run folder (or the folder itself when it holds config.json)."""
    from viz.load import load_run

    loaded = load_run(Path(run))
    found = [(name, a.path) for name, a in loaded.allocators.items()]
    if allocator is not None:
        found = [(n, p) for n, p in found if n == allocator]
        if not found:
            raise UserError(f"{run}: no allocator {allocator!r} (has {', '.join(loaded.allocators)})")
    return found


def read_steps(folder: Path) -> pd.DataFrame:
    """A run's steps table (steps.parquet or steps.csv); its absence is a one-line error."""
    for path, reader in ((folder / "steps.parquet", pd.read_parquet), (folder / "steps.csv", pd.read_csv)):
        if path.is_file():
            try:
                return reader(path)
            except (OSError, ValueError) as exc:
                raise UserError(f"{path}: cannot read steps table ({exc})") from None
    raise UserError(f"{folder}: no steps table (steps.parquet); calibrate needs a run written by "
                    "pagelab replay")


def read_config(folder: Path) -> dict:
    """config.json of an allocator folder."""
    from viz.load import read_json

    return read_json(folder / "config.json")


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
                                          "decode cost falling as batches grow (docs/latency-model.md)."),
    prefill_step: bool = typer.Option(False, "--prefill-step/--no-prefill-step",
                                      help="Add a seventh term, c6 per step that prefills: the kernel "
                                           "launches that a GPU's graphed decode steps hide "
                                           "(docs/latency-model.md)."),
) -> None:
    """Fit the step-latency model to measured replays; print the fit quality and write a profile."""
    from simulator.timing.calibrate import calibrate
    from simulator.timing.step_latency import STALL_FACTOR

    measured = []
    for run in runs:
        for name, folder in allocator_dirs(run, allocator):
            measured.append((f"{run}/{name}", read_config(folder), read_steps(folder)))
    if objective not in ("absolute", "relative"):
        raise UserError(f"--objective must be absolute or relative, got {objective!r}")
    profile = calibrate(measured, gpu=gpu, min_steps=min_steps, relative=objective == "relative",
                        sqrt_decode=sqrt_decode, prefill_step=prefill_step)
    payload = json.dumps(profile.to_dict(), indent=2) + "\n"
    atomic_write_bytes(out, payload.encode())
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


def _tables(folder: Path):
    from simulator.timing.compare import RunTables
    from viz.load import load_allocator

    a = load_allocator(folder)
    has_steps = (folder / "steps.parquet").is_file() or (folder / "steps.csv").is_file()
    return RunTables(a.summary, a.requests, a.memory, read_steps(folder) if has_steps else None)


def _sim_latency(folder: Path):
    """The latency model a simulation ran with (None when its config does not name one we can rebuild)."""
    from simulator.timing.step_latency import make_latency_model

    cfg = read_config(folder)
    if cfg.get("source") == "replay" or "latency" not in cfg or "step_times_from" in (cfg.get("extra") or {}):
        return None  # measured, or timed by a replay's step times rather than its latency model
    fitted = cfg["latency"] != "roofline"
    try:
        return make_latency_model("fitted" if fitted else "roofline", cfg["model"], cfg["gpu"],
                                  path=cfg["latency"] if fitted else None)
    except PagelabError:
        return None  # e.g. a profile file since moved: the step-index comparison still applies


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
    from simulator.timing.compare import compare_runs
    from simulator.timing.step_latency import STALL_FACTOR

    sims = dict(allocator_dirs(sim_run, allocator))
    reals = dict(allocator_dirs(real_run, allocator))
    common = [n for n in reals if n in sims]
    if not common:
        raise UserError(f"{sim_run} and {real_run} share no allocator "
                        f"({', '.join(sims)} vs {', '.join(reals)})")
    name = common[0]
    result = {"allocator": name, "sim_run": str(sim_run), "real_run": str(real_run),
              **compare_runs(_tables(sims[name]), _tables(reals[name]), _sim_latency(sims[name]))}
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
        from cli.runs import write_json
        from viz.common import save_figure
        from viz.compare import plot_latency_overlay
        from viz.load import load_allocator

        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "comparison.json", result)
        fig = plot_latency_overlay(load_allocator(sims[name]).requests, load_allocator(reals[name]).requests)
        path = save_figure(fig.figure, out / f"{fig.name}.{fmt.lower().lstrip('.')}", fmt.lower().lstrip("."))
        err_console.print(f"wrote {out / 'comparison.json'} and {path}")


# Replay config keys that are not the simulator's to copy (the rest that SimConfig has are copied).
_NOT_COPIED = {"model", "gpu", "latency", "mode", "record_events", "extra", "kv_memory_gb",
               "gpu_memory_utilization", "swap_space_gb", "debug"}


def replay_twin(real_run: Path, trace_df: pd.DataFrame | None, base, step_times: bool = True):
    """(allocator name, trace as run, SimConfig, MeasuredSteps or None) of a simulation of a replay's run.

    The pool, block size and scheduler options come from the replay's config.json; the trace is the
    replay's (its `trace` and `limit`, unless `trace_df` is given) with the arrival times and (clipped)
    prompt lengths the replay ran; with `step_times`, the step times are the replay's too
    (simulator/measured_steps.py, step mode), else the latency model of `base` times the steps.
    """
    import dataclasses

    from simulator.timing.measured_steps import MeasuredSteps
    from simulator.specs import GIB, sim_model_name
    from traces import load_trace
    from viz.load import load_allocator

    dirs = allocator_dirs(real_run)
    if len(dirs) != 1:
        raise UserError(f"{real_run}: holds {len(dirs)} allocators; point --step-times-from at one "
                        "allocator folder")
    name, folder = dirs[0]
    run = load_allocator(folder)
    cfg = run.config
    if cfg.get("source") != "replay":
        raise UserError(f"{folder / 'config.json'}: not a measured run (source {cfg.get('source')!r})")
    if trace_df is None:
        if cfg.get("trace") is None:
            raise UserError(f"{folder / 'config.json'}: no 'trace' recorded; give the TRACE argument")
        recorded = str(cfg["trace"])
        if Path(recorded).suffix and not Path(recorded).is_file():  # a file of the replaying machine
            raise UserError(f"{folder / 'config.json'}: the replay ran trace {recorded}, which is not here; "
                            "give that trace as the TRACE argument")
        trace_df = load_trace(recorded)
        if cfg.get("limit"):
            trace_df = trace_df.iloc[: int(cfg["limit"])].reset_index(drop=True)
    req = run.requests.sort_values("request_id")
    if len(trace_df) != len(req) or (trace_df["request_id"].to_numpy() != req["request_id"].to_numpy()).any():
        raise UserError(f"{folder}: the trace has {len(trace_df)} requests that do not match the replay's "
                        f"{len(req)}; give the trace the replay ran")
    trace_df = trace_df.copy()
    trace_df["arrival_s"] = req["arrival_s"].to_numpy()
    trace_df["prompt_len"] = req["prompt_len"].to_numpy()
    fields = {f.name for f in dataclasses.fields(base)} - _NOT_COPIED
    copied = {k: v for k, v in cfg.items() if k in fields}
    swap = (run.summary.get("measured") or {}).get("swap_pool_bytes")
    config = dataclasses.replace(base, **copied, model=sim_model_name(str(cfg["model"])),
                                 gpu="cpu" if str(cfg.get("device", "")).startswith("cpu") else base.gpu,
                                 kv_memory_gb=None, mode="step" if step_times else base.mode,
                                 swap_space_gb=swap / GIB if swap else base.swap_space_gb,
                                 extra={**base.extra, ("step_times_from" if step_times else "config_from"):
                                        str(folder)})
    measured = MeasuredSteps.from_memory(run.memory, source=str(folder)) if step_times else None
    return name, trace_df, config, measured

"""Run folders as the `pagelab` commands and the calibration tools both use them (no printing, no options).

The serving metrics every run folder's summary.json carries; the simulation loop that `pagelab simulate`
streams into a run folder; the allocator folders, configs and steps tables of measured runs (`pagelab
calibrate`); a simulation of a replay's own run (`simulate --config-from / --step-times-from`); and the
comparison of a simulation with a replay (`pagelab compare`). `cli` prints
and checks options around these; `bench.calibration` and `bench.profile` call them directly. Heavy
modules (pandas readers, viz, the simulator's fitting) are imported where they are used, so the CLI's
start does not pay for them.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from pagelab.errors import PagelabError
from simulator.metrics import DEFAULT_METRICS, DEFAULT_PERCENTILES, bench_metrics


class RunFolderError(PagelabError):
    """A run folder that is not what was asked of it; the message names the folder or file."""


def serving_metrics(results: dict, kinds=DEFAULT_METRICS, percentiles=DEFAULT_PERCENTILES,
                    goodput=None) -> dict[str, dict]:
    """bench_metrics of every allocator's result (summary.json's `serving_metrics`); the defaults are the
    commands' defaults (no --percentile-metrics, --metric-percentiles or --goodput)."""
    return {name: bench_metrics(res.request_data(), res.summary["sim_duration_s"], metrics=kinds,
                                percentiles=percentiles, goodput=goodput, gaps=res.itl)
            for name, res in results.items()}


def simulation_labels(info: dict, max_concurrency: int | None = None) -> dict:
    """The labels a simulation's config records under `extra`: its trace, rate override, concurrency cap
    and the pagelab version (`info` is the run's trace entry)."""
    from pagelab.run_folder import versions

    return {"trace": info["source"], "rate": info["rate_override"], "max_concurrency": max_concurrency,
            "pagelab_version": versions()["pagelab"]}


def simulation_metadata(config, names: list[str], source: str) -> dict:
    """run.json of a simulation of `source`: the command line, versions, the trace's hash, the config and
    its allocators."""
    from pagelab.run_folder import run_metadata
    from traces.loaders import trace_hash

    return {**run_metadata("simulate"), "trace_sha256": trace_hash(source),
            "config": config.to_dict() | {"allocators": names}}


def simulate_runs(df, configs: dict, tmp: Path | None, num_requests: int, table_format: str = "parquet", *,
                  step_times=None, progress_of: Callable[[str], Callable | None] | None = None) -> dict:
    """Simulate `df` once per allocator config. With `tmp` (a run folder being written, e.g. by
    `pagelab.atomic.atomic_dir`) each run streams its tables into tmp/NAME as it goes; without, the
    results hold them. `progress_of(name)`, called as each run starts, gives its progress callback."""
    from simulator.loop import simulate
    from simulator.output import RunFolder

    results = {}
    for name, cfg in configs.items():
        progress = progress_of(name) if progress_of is not None else None
        output = None
        if tmp is not None:
            (tmp / name).mkdir()
            output = RunFolder(tmp / name, table_format, num_requests=num_requests,
                               record_events=cfg.record_events)
        results[name] = simulate(df, cfg, output, progress=progress, step_times=step_times)
    return results


def allocator_dirs(run: Path, allocator: str | None = None) -> list[tuple[str, Path]]:
    """The allocator folders of a run folder (or the folder itself when it holds config.json)."""
    from viz.load import load_run

    loaded = load_run(Path(run))
    found = [(name, a.path) for name, a in loaded.allocators.items()]
    if allocator is not None:
        found = [(n, p) for n, p in found if n == allocator]
        if not found:
            raise RunFolderError(f"{run}: no allocator {allocator!r} (has {', '.join(loaded.allocators)})")
    return found


def read_steps(folder: Path) -> pd.DataFrame:
    """A run's steps table (steps.parquet or steps.csv); its absence is a one-line error, and a file that
    cannot be read a viz.errors.TableError naming it."""
    from viz.load import unreadable

    for path, reader in ((folder / "steps.parquet", pd.read_parquet), (folder / "steps.csv", pd.read_csv)):
        if path.is_file():
            try:
                return reader(path)
            except (OSError, ValueError) as exc:
                raise unreadable(folder, "steps", exc) from None
    raise RunFolderError(f"{folder}: no steps table (steps.parquet); calibrate needs a run written by "
                         "pagelab replay")


def read_config(folder: Path) -> dict:
    """config.json of an allocator folder."""
    from viz.load import read_json

    return read_json(folder / "config.json")


def measured_steps(runs: list[Path], allocator: str | None = None, warn: Callable[[str], None] | None = None
                   ) -> list[tuple[str, dict, pd.DataFrame]]:
    """(label RUN/NAME, config, steps table) of every allocator folder of `runs`: what a fit reads.

    With `warn`, a steps table that cannot be read is left out with a warning naming its file (an error
    when no table is left), and an incomplete replay is fitted as far as it ran, with a warning.
    """
    from viz.errors import TableError

    found, unreadable = [], []
    for run in runs:
        for name, folder in allocator_dirs(run, allocator):
            try:
                steps = read_steps(folder)
            except TableError as exc:
                if warn is None:
                    raise
                warn(f"{exc}: calibrate leaves out {run}/{name}")
                unreadable.append(str(exc.path))
                continue
            config = read_config(folder)
            stopped = _incomplete(folder)
            if stopped and warn is not None:
                warn(f"{folder}: {stopped}; calibrate fits the steps it ran")
            found.append((f"{run}/{name}", config, steps))
    if not found and unreadable:
        raise RunFolderError(f"no steps table could be read ({', '.join(unreadable)})")
    return found


def _incomplete(folder: Path) -> str | None:
    """'an incomplete run, stopped at step N (why)' when the allocator folder's run stopped early."""
    from viz.load import load_allocator

    stopped = load_allocator(folder).incomplete
    if not stopped:
        return None
    return (f"an incomplete run, stopped at step {stopped.get('num_steps', '?')} "
            f"({stopped.get('reason', 'no reason recorded')})")


def write_profile(measured: list, out: Path, *, gpu: str | None = None, min_steps: int = 20,
                  relative: bool = False, sqrt_decode: bool = False, prefill_step: bool = False):
    """Fit the step-latency model to `measured` (as `measured_steps` gives it), write the profile JSON to
    `out` atomically and return the fitted profile."""
    from pagelab.atomic import atomic_write_bytes
    from simulator.timing.calibrate import calibrate

    profile = calibrate(measured, gpu=gpu, min_steps=min_steps, relative=relative, sqrt_decode=sqrt_decode,
                        prefill_step=prefill_step)
    atomic_write_bytes(out, (json.dumps(profile.to_dict(), indent=2) + "\n").encode())
    return profile


def run_tables(folder: Path, warnings: list[str] | None = None):
    """An allocator folder's summary, requests, memory and (replays) steps, as the comparison takes them.

    With `warnings`, a table that cannot be read is None, and a line naming its file is appended.
    """
    from simulator.timing.compare import RunTables
    from viz.errors import TableError
    from viz.load import load_allocator

    a = load_allocator(folder)

    def table(read):
        try:
            return read()
        except TableError as exc:
            if warnings is None:
                raise
            warnings.append(f"{exc}: compare leaves out what needs the {exc.table} table")
            return None

    has_steps = (folder / "steps.parquet").is_file() or (folder / "steps.csv").is_file()
    return RunTables(a.summary, table(lambda: a.requests), table(lambda: a.memory),
                     table(lambda: read_steps(folder)) if has_steps else None)


def sim_latency(folder: Path):
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


def compare_folders(sim_run: Path, real_run: Path, allocator: str | None = None) -> tuple[dict, Path, Path]:
    """The comparison of a simulation with a replay (comparison.json's content) on the first allocator
    both runs have (or `allocator`), with the two allocator folders it compared."""
    from simulator.timing.compare import compare_runs, request_mismatch

    sims = dict(allocator_dirs(sim_run, allocator))
    reals = dict(allocator_dirs(real_run, allocator))
    common = [n for n in reals if n in sims]
    if not common:
        raise RunFolderError(f"{sim_run} and {real_run} share no allocator "
                             f"({', '.join(sims)} vs {', '.join(reals)})")
    name = common[0]
    warnings = [f"{folder}: {stopped}; compared as far as it ran" for folder in (sims[name], reals[name])
                if (stopped := _incomplete(folder))]
    sim, real = run_tables(sims[name], warnings), run_tables(reals[name], warnings)
    if (problem := request_mismatch(sim, real, partial=bool(warnings))) is not None:
        raise RunFolderError(f"{sims[name]} and {reals[name]}: {problem} (compare runs of one trace: "
                             "simulate --config-from REPLAY_RUN)")
    result = {"allocator": name, "sim_run": str(sim_run), "real_run": str(real_run),
              **compare_runs(sim, real, sim_latency(sims[name]))}
    if warnings:
        result["warnings"] = warnings  # what was left out or incomplete; `pagelab compare` prints them
    return result, sims[name], reals[name]


def write_comparison(out: Path, result: dict, sim_folder: Path, real_folder: Path, fmt: str = "png"
                     ) -> Path | None:
    """comparison.json and the latency CDF overlay of the two allocator folders into `out`; the figure's
    path (None when a request table cannot be read)."""
    from pagelab.run_folder import write_json
    from viz.common import save_figure
    from viz.compare import plot_latency_overlay
    from viz.errors import TableError
    from viz.load import load_allocator

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "comparison.json", result)
    try:
        fig = plot_latency_overlay(load_allocator(sim_folder).requests, load_allocator(real_folder).requests)
    except TableError:
        return None  # a request table cannot be read (result["warnings"] says which): no overlay
    fmt = fmt.lower().lstrip(".")
    return save_figure(fig.figure, out / f"{fig.name}.{fmt}", fmt)


# Replay config keys that are not the simulator's to copy (the rest that SimConfig has are copied).
_NOT_COPIED = {"model", "gpu", "latency", "mode", "record_events", "extra", "kv_memory_gb",
               "gpu_memory_utilization", "swap_space_gb", "debug"}


_KINDS = {"bool": "true or false", "int": "a whole number", "float": "a number", "str": "a string"}


def _is_kind(value, annotation: str) -> bool:
    """Whether a config.json value fits a SimConfig field annotated `annotation` (e.g. 'int | None')."""
    names = [t.strip() for t in annotation.split("|")]
    if value is None:
        return "None" in names
    if isinstance(value, bool):
        return "bool" in names
    if isinstance(value, int):
        return "int" in names or "float" in names
    if isinstance(value, float):
        return "float" in names
    return isinstance(value, str) and "str" in names


def replay_twin(real_run: Path, trace_df: pd.DataFrame | None, base, step_times: bool = True):
    """(allocator name, trace as run, SimConfig, MeasuredSteps or None, the trace the replay recorded) of a
    simulation of a replay's run.

    The pool, block size and scheduler options come from the replay's config.json; the trace is the
    replay's (its `trace` and `limit`, unless `trace_df` is given) with the arrival times and (clipped)
    prompt lengths the replay ran; with `step_times`, the step times are the replay's too
    (simulator/timing/measured_steps.py, step mode), else the latency model of `base` times the steps.
    """
    from simulator.core.models import canonical_name
    from simulator.presets import GIB
    from simulator.timing.measured_steps import MeasuredSteps
    from traces import load_trace
    from viz.load import load_allocator

    dirs = allocator_dirs(real_run)
    if len(dirs) != 1:
        option = "--step-times-from" if step_times else "--config-from"
        raise RunFolderError(f"{real_run}: holds {len(dirs)} allocators; point {option} at one allocator "
                             "folder")
    name, folder = dirs[0]
    run = load_allocator(folder)
    cfg = run.config
    if cfg.get("source") != "replay":
        raise RunFolderError(f"{folder}: a simulation, not a measured run: give the folder of a "
                             "`pagelab replay` run")
    if trace_df is None:
        if cfg.get("trace") is None:
            raise RunFolderError(f"{folder / 'config.json'}: no 'trace' recorded; give the TRACE argument")
        recorded = str(cfg["trace"])
        if Path(recorded).suffix and not Path(recorded).is_file():  # a file of the replaying machine
            raise RunFolderError(f"{folder / 'config.json'}: the replay ran trace {recorded}, which is not "
                                 "here; give that trace as the TRACE argument")
        trace_df = load_trace(recorded)
        if cfg.get("limit"):
            trace_df = trace_df.iloc[: int(cfg["limit"])].reset_index(drop=True)
    req = run.requests.sort_values("request_id")
    if len(trace_df) != len(req) or (trace_df["request_id"].to_numpy() != req["request_id"].to_numpy()).any():
        raise RunFolderError(f"{folder}: the trace has {len(trace_df)} requests that do not match the "
                             f"replay's {len(req)}; give the trace the replay ran")
    trace_df = trace_df.copy()
    trace_df["arrival_s"] = req["arrival_s"].to_numpy()
    trace_df["prompt_len"] = req["prompt_len"].to_numpy()
    fields = {f.name for f in dataclasses.fields(base)} - _NOT_COPIED
    copied = {k: v for k, v in cfg.items() if k in fields}
    for f in dataclasses.fields(base):
        if f.name in copied and not _is_kind(copied[f.name], str(f.type)):
            kinds = " or ".join(_KINDS.get(t.strip(), "null") for t in str(f.type).split("|"))
            raise RunFolderError(f"{folder / 'config.json'}: field {f.name!r}: expected {kinds}, got "
                                 f"{copied[f.name]!r}")
    swap = (run.summary.get("measured") or {}).get("swap_pool_bytes")
    config = dataclasses.replace(base, **copied, model=canonical_name(str(cfg["model"])),
                                 gpu="cpu" if str(cfg.get("device", "")).startswith("cpu") else base.gpu,
                                 kv_memory_gb=None, mode="step" if step_times else base.mode,
                                 swap_space_gb=swap / GIB if swap else base.swap_space_gb,
                                 extra={**base.extra, ("step_times_from" if step_times else "config_from"):
                                        str(folder)})
    measured = MeasuredSteps.from_memory(run.memory, source=str(folder)) if step_times else None
    return name, trace_df, config, measured, str(cfg.get("trace"))


def twin_info(trace_df: pd.DataFrame, source: str) -> dict:
    """The trace entry of a simulation of a replay (`replay_twin`): the trace as the replay ran it."""
    from traces.stats import trace_info

    return {"source": source, **trace_info(trace_df), "rate_override": None, "burstiness": None,
            "limit": None}

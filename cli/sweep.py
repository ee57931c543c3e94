"""`pagelab sweep`: simulate a grid of rates and configurations, and find each one's capacity."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Literal, get_args

import typer
from rich import box
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cli.common import UserError, check_seed, console, err_console, printing_warnings, user_errors, warn
from cli.help import OUTPUT, POOL, SCHEDULER, TRACE
from cli.report import short
from cli.simulate import KvDtype, Placement, Preemption
from pagelab.run_format import is_sweep_folder
from simulator.core.config import ALLOCATORS
from simulator.sweep.search import DEFAULT_SEARCH_RUNS, DEFAULT_TOLERANCE
from traces import TraceError
from traces.synthetic import rescale_rate

SEARCH, EXECUTION = "Capacity search", "Execution"
Executor = Literal["local", "ray"]

STATUS_TEXT = {"found": "", "above_range": " (meets the SLO at the top of the range)",
               "below_range": " (misses the SLO at the lowest rate)", "budget": " (search budget spent)",
               "searching": " (search off: grid only)",
               "point_failed": " (stopped: a point it needs failed, see sweep.parquet's error column)"}

# SimConfig fields with an option of their own, and the option (one left at the field's default may be set
# by a one-value --axis instead).
OPTION_FLAGS = {"capacity_tokens": "--capacity-tokens", "max_model_len": "--max-model-len",
                "max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
                "preemption_mode": "--preemption", "placement": "--placement", "latency": "--latency",
                "seed": "--seed"}


def _list(name: str, text: str | None, kind: type) -> tuple | None:
    """A comma-separated option value as a tuple (None when not given); errors name the option."""
    from simulator.sweep import parse_axis_values
    return None if text is None else parse_axis_values(name, text, kind, what=f"--{name.replace('_', '-')}")


def _check_kv_dtypes(spec: str, name: str, values: tuple) -> None:
    """Refuse a KV cache dtype `simulate --kv-cache-dtype` refuses (SimConfig also takes the CPU replays'
    float32 and aliases, which no simulate run can be given)."""
    choices = get_args(KvDtype)
    bad = [v for v in values if v not in choices] if name == "kv_cache_dtype" else []
    if bad:
        raise UserError(f"--axis {spec!r}: {bad[0]!r} is not a KV cache dtype; choose from "
                        f"{', '.join(choices)}")


def max_rate_table(max_rates, slo_text: str) -> Table:
    """The capacity table printed at the end of a sweep (axes in their short names, to fit 80 columns)."""
    from simulator.sweep.axes import labelled_axes, short_name

    t = Table(title=f"Maximum sustainable request rate under {slo_text}", box=box.SIMPLE_HEAD,
              pad_edge=False, collapse_padding=True)
    results = ("max_rate", "first_miss_rate", "status", "monotone", "runs", "search_runs", "paged_advantage")
    config_cols = [c for c in max_rates.columns if c not in results]
    for c in config_cols:  # spaced names wrap on words in a narrow console
        t.add_column(short_name(c).replace("_", " "), justify="left")
    for c in ("max req/s", "first miss", "paged x", "runs", "note"):
        t.add_column(c, justify="left" if c == "note" else "right", no_wrap=c != "note")
    for _, row in max_rates.iterrows():
        def num(x, fmt=".3f"):
            return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)
        note = STATUS_TEXT.get(row["status"], row["status"]).strip(" ()")
        if not row["monotone"]:
            note = (note + "; " if note else "") + "not monotone"
        shown = labelled_axes(row.to_dict())
        t.add_row(*[short(str(row[c])) if c == "allocator" else str(row[c]) if c in shown else "-"
                    for c in config_cols],
                  num(row["max_rate"]), num(row["first_miss_rate"]),
                  num(row["paged_advantage"], ".2f"), str(row["runs"]), note)
    return t


@user_errors
def sweep_cmd(
    trace: str = typer.Argument(None, metavar="TRACE", rich_help_panel=TRACE,
                                help="Trace file or bundled name (default: azure-conv)."),
    rate: str = typer.Option(..., rich_help_panel=TRACE,
                             help="Request rates: START:STOP:STEP (grid, inclusive), START:STOP (search "
                                  "bounds only) or R1,R2,... Each point rescales the trace's arrival times "
                                  "to that mean rate."),
    limit: int = typer.Option(None, rich_help_panel=TRACE,
                              help="Use only the first N requests (default: all)."),
    seed: int = typer.Option(0, rich_help_panel=TRACE, help="Random seed."),
    allocator: list[str] = typer.Option(None, "--allocator", "-a", rich_help_panel=POOL,
                                        help="Allocators (repeat or comma-separate; default: all four)."),
    model: str = typer.Option("llama-3-8b", rich_help_panel=POOL,
                              help="Models (registry names or Hugging Face ids), e.g. opt-13b,llama-3-8b."),
    gpu: str = typer.Option("a100-80gb", rich_help_panel=POOL, help="GPU presets."),
    kv_memory_gb: str = typer.Option(None, rich_help_panel=POOL,
                                     help="KV cache sizes in GiB, e.g. 12,24 (default: what the GPU leaves "
                                          "at 0.9 utilization)."),
    block_size: str = typer.Option("16", rich_help_panel=POOL, help="Paged block sizes, e.g. 8,16,32."),
    capacity_tokens: int = typer.Option(None, rich_help_panel=POOL,
                                        help="KV cache size in token slots (overrides everything)."),
    max_model_len: int = typer.Option(None, rich_help_panel=POOL,
                                      help="Longest sequence (default: the model's)."),
    placement: Placement = typer.Option(None, rich_help_panel=POOL,
                                        help="Contiguous placement; only with a contiguous allocator "
                                             "(default: buddy)."),
    axis: list[str] = typer.Option(None, "--axis", rich_help_panel=POOL,
                                   help="Any other SimConfig field: NAME=V1,V2 (repeat), e.g. "
                                        "kv_cache_dtype=auto,fp8 or gpu_memory_utilization=0.8,0.9."),
    max_num_seqs: int = typer.Option(256, rich_help_panel=SCHEDULER, help="Most requests running at once."),
    max_num_batched_tokens: int = typer.Option(None, rich_help_panel=SCHEDULER,
                                               help="Token budget of one step (default: max(max-model-len, "
                                                    "2048) + max-num-seqs)."),
    preemption: Preemption = typer.Option("recompute", rich_help_panel=SCHEDULER,
                                          help="What a preempted request loses."),
    latency: str = typer.Option("roofline", rich_help_panel=SCHEDULER,
                                help="Step-time model: roofline, or the path of a fitted profile (JSON)."),
    slo: str = typer.Option(None, rich_help_panel=SEARCH,
                            help="The latency limit a rate must keep: METRIC_pPCT:VALUE UNIT with METRIC "
                                 "ttft, tpot or e2el, PCT 50, 90 or 99, UNIT ms or s (e.g. ttft_p99:0.2s), "
                                 "or norm_latency:VALUE s/token (mean end-to-end latency / output tokens); "
                                 "default norm_latency:0.2s/token. A unit is required."),
    search: bool = typer.Option(True, rich_help_panel=SEARCH,
                                help="Refine each configuration's max rate beyond the grid."),
    tolerance: float = typer.Option(DEFAULT_TOLERANCE, rich_help_panel=SEARCH,
                                    help="Relative precision of the max-rate search."),
    search_runs: int = typer.Option(DEFAULT_SEARCH_RUNS, rich_help_panel=SEARCH,
                                    help="Most extra points the search adds per configuration."),
    executor: Executor = typer.Option("local", rich_help_panel=EXECUTION,
                                      help="local (worker processes) or ray."),
    jobs: int = typer.Option(None, "--jobs", "-j", rich_help_panel=EXECUTION,
                             help="Local worker processes (default: all cores)."),
    address: str = typer.Option(None, rich_help_panel=EXECUTION,
                                help="Ray cluster address (HOST:PORT, ray://HOST:PORT or auto); default: "
                                     "start a local Ray instance."),
    out: Path = typer.Option(..., "--out", "-o", rich_help_panel=OUTPUT,
                             help="Sweep folder (re-running reuses finished points)."),
    events: bool = typer.Option(False, rich_help_panel=OUTPUT,
                                help="Record pool tenures in each point (for block maps; slower)."),
    plot: bool = typer.Option(False, rich_help_panel=OUTPUT,
                              help="Draw Fig. 12 and the max-rate bars into OUT/figures."),
    as_json: bool = typer.Option(False, "--json", rich_help_panel=OUTPUT,
                                 help="Print the max-rate results as JSON instead of the table."),
) -> None:
    """Sweep request rates and configurations; report each configuration's max sustainable rate."""
    from simulator.config import SimConfig
    from simulator.slo import DEFAULT_SLO, parse_slo
    from simulator.sweep import SweepError, parse_rates
    from simulator.sweep.axes import SweepAxes, parse_axis
    from simulator.sweep.executors import LocalExecutor, RayExecutor, SerialExecutor, default_jobs
    from simulator.sweep.runner import TRACE_FILE, SweepPlan
    from traces import load_trace

    check_seed(seed)
    if not search and (tolerance != DEFAULT_TOLERANCE or search_runs != DEFAULT_SEARCH_RUNS):
        raise UserError("--tolerance and --search-runs shape the max-rate search: they do not apply with "
                        "--no-search")
    try:
        names = tuple(dict.fromkeys(n.strip() for item in allocator or list(ALLOCATORS)
                                    for n in item.split(",") if n.strip()))
        for name in names:
            if name not in ALLOCATORS:
                raise UserError(f"unknown allocator {name!r}; choose from {', '.join(ALLOCATORS)}")
        if placement is not None and all(ALLOCATORS[n] is None for n in names):
            raise UserError("--placement only applies to contiguous allocators (-a contiguous-max, ...); "
                            "the paged allocator places blocks anywhere")
        rates, bounds = parse_rates(rate)
        axes_values = {"block_size": _list("block_size", block_size, int),
                       "kv_memory_gb": _list("kv_memory_gb", kv_memory_gb, float),
                       "model": _list("model", model, str), "gpu": _list("gpu", gpu, str)}
        given_axes: set[str] = set()
        for spec in axis or []:
            name, values = parse_axis(spec)
            if axes_values.get(name) is not None and name in ("block_size", "kv_memory_gb", "model", "gpu"):
                raise UserError(f"--axis {spec!r}: use --{name.replace('_', '-')} for this axis")
            if name in given_axes:  # the later one would replace the earlier: one --axis per field
                raise UserError(f"--axis {name} given twice: list its values in one, --axis {name}=A,B")
            given_axes.add(name)
            axes_values[name] = values
            _check_kv_dtypes(spec, name, values)
        options = {"capacity_tokens": capacity_tokens, "max_model_len": max_model_len,
                   "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                   "preemption_mode": preemption, "placement": placement or "buddy", "latency": latency,
                   "seed": seed}
        defaults = {f.name: f.default for f in dataclasses.fields(SimConfig)}
        for name, value in options.items():
            if axes_values.get(name) is not None and value != defaults[name]:
                raise UserError(f"{OPTION_FLAGS[name]} and --axis {name}=... both set {name}; "
                                "give one of them")
        # The pool's size in tokens wins over its size in GiB: swept beside it, every GiB would be one pool.
        pool_tokens = capacity_tokens is not None or axes_values.get("capacity_tokens") is not None
        if pool_tokens and len(axes_values.get("kv_memory_gb") or ()) > 1:
            raise UserError("--capacity-tokens sizes the pool, so the --kv-memory-gb values would all run "
                            "the same pool: give one of them")
        if axes_values.get("placement") is not None and all(ALLOCATORS[n] is None for n in names):
            raise UserError("--axis placement=... only applies to contiguous allocators (-a contiguous-max, "
                            "...); the paged allocator places blocks anywhere")
        # Axes with one value are shared options, not columns of the sweep; they replace the option's default.
        swept = {k: v for k, v in axes_values.items() if v is not None and len(v) > 1}
        base = {**options, **{k: v[0] for k, v in axes_values.items() if v is not None and len(v) == 1},
                "record_events": events}
        axes = SweepAxes(rates, bounds, names, swept, base)
        axes.check()
        plan = SweepPlan(axes, parse_slo(slo or DEFAULT_SLO), search, tolerance, search_runs)
        if jobs is not None and jobs < 1:
            raise UserError(f"--jobs must be >= 1, got {jobs}")
        if address is not None and executor != "ray":
            raise UserError("--address needs --executor ray")
        if limit is not None and limit < 2:
            raise UserError(f"--limit must be >= 2 (a rate needs two arrivals), got {limit}")
        with printing_warnings() as trace_warnings:
            df = load_trace(trace or "azure-conv", warnings=trace_warnings)
        if limit is not None:
            df = df.iloc[:limit].reset_index(drop=True)
        if len(df) < 2 or df["arrival_s"].max() <= df["arrival_s"].min():
            raise UserError(f"{trace or 'azure-conv'}: a sweep needs a trace with at least two distinct "
                            "arrival times (rates rescale the gaps)")
        from cli.runs import check_out_folder, lock_out

        check_out_folder(out, f"--out {out}")
        lock_out(out)  # one sweep at a time writes a sweep folder
        held = sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) if out.is_dir() else []
        if held and not is_sweep_folder(out):
            shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
            raise UserError(f"--out {out} is a folder that is not a sweep's (it holds {shown}); choose a new "
                            "or empty folder, or an earlier sweep's to resume it")
        from cli.pool_options import pool_problem
        from simulator.sweep.axes import config_label

        for config in axes.configs():  # a pool the trace cannot fill, refused before anything is written
            problem = pool_problem(df, axes.sim_config(config))
            if problem:
                raise UserError(f"configuration {config_label(config)}: {problem}")
        try:  # the lowest rate re-timed as every point re-times the trace, before any is run
            rescale_rate(df, min(axes.bounds[0], *rates))
        except TraceError as exc:
            raise UserError(f"--rate: {exc}") from None
        # Start the executor before writing anything, so a cluster that does not answer leaves no files.
        if executor == "ray":
            runner = RayExecutor(df, address, num_cpus=jobs)
        else:
            n = jobs or default_jobs()
            runner = SerialExecutor(df) if n == 1 else LocalExecutor(n, out / TRACE_FILE)
    except SweepError as exc:
        raise UserError(str(exc)) from None
    source = trace or "azure-conv"
    num_configs = len(axes.configs())
    bound = num_configs * (len(rates) + (search_runs if search else 0))
    searched = f", then at most {search_runs} search points each" if search else ""
    err_console.print(f"sweep on {source} ({runner.name} executor), SLO {plan.slo.describe()}: "
                      f"{num_configs} configurations x {len(rates)} rates{searched}; at most {bound} points",
                      highlight=False)
    try:
        result = _run(df, source, plan, out, runner, bound)
    finally:
        runner.close()
    if as_json:
        typer.echo(json.dumps({"trace": source, "slo": plan.slo.format(),
                               "configurations": json.loads(result.max_rates.to_json(orient="records"))}))
    else:
        console.print(max_rate_table(result.max_rates, plan.slo.describe()))
    failed = f", {result.num_failed} failed" if result.num_failed else ""
    err_console.print(f"wrote {out} ({result.num_run} points run, {result.num_reused} reused{failed})",
                      highlight=False)
    if not result.points["met_slo"].any():
        err_console.print(f"no point meets the SLO {plan.slo.describe()}: lower the rates or loosen --slo",
                          highlight=False)
    if plot:
        from viz.capacity import plot_sweep_folder
        paths = plot_sweep_folder(out, out / "figures")
        err_console.print(f"drew {len(paths)} figures into {out / 'figures'}", highlight=False)
    if result.num_failed:
        warn(f"{result.num_failed} point(s) failed (their causes are in the error column of "
             f"{out / 'sweep.parquet'}); run the same sweep again to retry them")
        raise typer.Exit(code=1)


def point_line(p, slo, bound: int) -> str:
    """One log line per finished point: which point of how many at most, its statistic against the SLO's
    bound, and where the result came from."""
    from simulator.slo import UNITS
    from simulator.sweep.axes import config_label

    where = f"{config_label(p.spec.config_dict)} at {p.spec.rate:g} req/s"
    if p.error is not None:
        return f"point {p.done} of at most {bound}: {where}: failed: {p.error}"
    value = slo.summary_value(p.summary) * UNITS[slo.unit]
    met = slo.met(p.summary)
    if met or not math.isfinite(value) or value > slo.value:
        verdict = f"{'<=' if met else '>'} {slo.value:g}: {'meets' if met else 'misses'} the SLO"
    else:
        verdict = "misses the SLO: requests left unfinished"
    how = "reused from an earlier run" if p.reused else \
        f"simulated in {p.summary.get('wall_s', float('nan')):.1f} s"
    rejected = p.summary.get("num_rejected") or 0
    if rejected:  # longer than max_model_len or the pool: refused at every rate, out of the SLO's count
        how += f"; rejected at every rate: {rejected:,} (longer than max_model_len or the pool)"
    return f"point {p.done} of at most {bound}: {where}: {slo.name} {value:.4g} {slo.unit} ({verdict}); {how}"


def _run(df, source, plan, out, runner, bound: int):
    """Run the sweep with a progress bar on a terminal, one log line per point otherwise."""
    from simulator.sweep.runner import run_sweep

    if not err_console.is_terminal:
        return run_sweep(df, source, plan, out, runner,
                         progress=lambda p: err_console.print(escape(point_line(p, plan.slo, bound)),
                                                              highlight=False))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as bar:
        task = bar.add_task(f"sweeping (at most {bound} points)", total=bound)
        return run_sweep(df, source, plan, out, runner,
                         progress=lambda p: bar.update(task, completed=p.done))

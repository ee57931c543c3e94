"""`pagelab sweep`: simulate a grid of rates and configurations, and find each one's capacity."""
from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cli.common import UserError, console, err_console, user_errors
from simulator.core.config import ALLOCATORS

STATUS_TEXT = {"found": "", "above_range": " (meets the SLO at the top of the range)",
               "below_range": " (misses the SLO at the lowest rate)", "budget": " (search budget spent)",
               "searching": " (search off: grid only)",
               "point_failed": " (stopped: a point it needs failed, see sweep.parquet's error column)"}


def _list(name: str, text: str | None, kind: type) -> tuple | None:
    """A comma-separated option value as a tuple (None when not given)."""
    from simulator.sweep import parse_axis_values
    return None if text is None else parse_axis_values(name, text, kind)


def max_rate_table(max_rates, slo_text: str) -> Table:
    """The capacity table printed at the end of a sweep."""
    t = Table(title=f"Maximum sustainable request rate under {slo_text}")
    results = ("max_rate", "first_miss_rate", "status", "monotone", "runs", "search_runs", "paged_advantage")
    config_cols = [c for c in max_rates.columns if c not in results]
    for c in [*config_cols, "max req/s", "first miss", "paged x", "runs", "note"]:
        t.add_column(c, justify="left" if c in config_cols or c == "note" else "right")
    for _, row in max_rates.iterrows():
        def num(x, fmt=".3f"):
            return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)
        note = STATUS_TEXT.get(row["status"], row["status"]).strip(" ()")
        if not row["monotone"]:
            note = (note + "; " if note else "") + "not monotone"
        t.add_row(*[str(row[c]) for c in config_cols], num(row["max_rate"]), num(row["first_miss_rate"]),
                  num(row["paged_advantage"], ".2f"), str(row["runs"]), note)
    return t


@user_errors
def sweep_cmd(
    trace: str = typer.Argument(None, help="Trace file or bundled name (default: azure-conv)."),
    rate: str = typer.Option(..., help="Request rates: START:STOP:STEP (grid, inclusive), START:STOP "
                                       "(search bounds only) or R1,R2,... Each point rescales the trace's "
                                       "arrival times to that mean rate."),
    allocator: list[str] = typer.Option(None, "--allocator", "-a",
                                        help="Allocators (repeat or comma-separate; default: all four)."),
    block_size: str = typer.Option("16", help="Paged block sizes, e.g. 8,16,32."),
    kv_memory_gb: str = typer.Option(None, help="KV-cache sizes in GiB, e.g. 12,24."),
    model: str = typer.Option("llama-3-8b", help="Model presets, e.g. opt-13b,llama-3-8b."),
    gpu: str = typer.Option("a100-80gb", help="GPU presets."),
    axis: list[str] = typer.Option(None, "--axis", help="Any other SimConfig field: NAME=V1,V2 (repeat)."),
    capacity_tokens: int = typer.Option(None, help="KV capacity in token slots (overrides everything)."),
    max_model_len: int = typer.Option(None, help="Longest sequence (default: the model's)."),
    max_num_seqs: int = typer.Option(256, help="Most requests running at once."),
    max_num_batched_tokens: int = typer.Option(None, help="Token budget of one step."),
    preemption: str = typer.Option("recompute", help="recompute or swap."),
    placement: str = typer.Option("buddy", help="Contiguous placement: buddy or first-fit."),
    latency: str = typer.Option("roofline", help="roofline, or a fitted latency profile (JSON)."),
    limit: int = typer.Option(None, help="Use only the first N requests."),
    seed: int = typer.Option(0, help="Random seed."),
    slo: str = typer.Option(None, help="The latency limit a rate must keep: METRIC_pPCT:VALUE UNIT with "
                                       "METRIC ttft, tpot or e2el, PCT 50, 90 or 99, UNIT ms or s (e.g. "
                                       "ttft_p99:0.2s), or norm_latency:VALUE s/token (mean end-to-end "
                                       "latency / output tokens); default norm_latency:0.2s/token. A unit "
                                       "is required."),
    search: bool = typer.Option(True, help="Refine each configuration's max rate beyond the grid."),
    tolerance: float = typer.Option(0.05, help="Relative precision of the max-rate search."),
    search_runs: int = typer.Option(10, help="Most extra runs the search adds per configuration."),
    executor: str = typer.Option("local", help="local (worker processes) or ray."),
    jobs: int = typer.Option(None, "--jobs", "-j", help="Local worker processes (default: all cores)."),
    address: str = typer.Option(None, help="Ray cluster address (HOST:PORT, ray://HOST:PORT or auto); "
                                           "default: start a local Ray instance."),
    events: bool = typer.Option(False, help="Record pool tenures in each point (for block maps; slower)."),
    out: Path = typer.Option(..., "--out", "-o", help="Sweep folder (re-running reuses finished points)."),
    plot: bool = typer.Option(False, help="Draw Fig. 12 and the max-rate bars into OUT/figures."),
) -> None:
    """Sweep request rates and configurations; report each configuration's max sustainable rate."""
    from simulator.slo import DEFAULT_SLO, parse_slo
    from simulator.sweep import SweepError, parse_rates
    from simulator.sweep.axes import SweepAxes, parse_axis
    from simulator.sweep.executors import LocalExecutor, RayExecutor, SerialExecutor, default_jobs
    from simulator.sweep.runner import TRACE_FILE, SweepPlan
    from traces import load_trace

    try:
        names = tuple(dict.fromkeys(n.strip() for item in allocator or list(ALLOCATORS)
                                    for n in item.split(",") if n.strip()))
        for name in names:
            if name not in ALLOCATORS:
                raise UserError(f"unknown allocator {name!r}; choose from {', '.join(ALLOCATORS)}")
        rates, bounds = parse_rates(rate)
        axes_values = {"block_size": _list("block_size", block_size, int),
                       "kv_memory_gb": _list("kv_memory_gb", kv_memory_gb, float),
                       "model": _list("model", model, str), "gpu": _list("gpu", gpu, str)}
        for spec in axis or []:
            name, values = parse_axis(spec)
            if axes_values.get(name) is not None and name in ("block_size", "kv_memory_gb", "model", "gpu"):
                raise UserError(f"--axis {spec!r}: use --{name.replace('_', '-')} for this axis")
            axes_values[name] = values
        # Axes with one value are shared options, not columns of the sweep.
        swept = {k: v for k, v in axes_values.items() if v is not None and len(v) > 1}
        base = {k: v[0] for k, v in axes_values.items() if v is not None and len(v) == 1}
        base.update(capacity_tokens=capacity_tokens, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, preemption_mode=preemption,
                    placement=placement, latency=latency, seed=seed, record_events=events)
        axes = SweepAxes(rates, bounds, names, swept, base)
        axes.check()
        plan = SweepPlan(axes, parse_slo(slo or DEFAULT_SLO), search, tolerance, search_runs)
        if executor not in ("local", "ray"):
            raise UserError(f"--executor must be local or ray, got {executor!r}")
        if jobs is not None and jobs < 1:
            raise UserError(f"--jobs must be >= 1, got {jobs}")
        if address is not None and executor != "ray":
            raise UserError("--address needs --executor ray")
        if limit is not None and limit < 2:
            raise UserError(f"--limit must be >= 2 (a rate needs two arrivals), got {limit}")
        df = load_trace(trace or "azure-conv")
        if limit is not None:
            df = df.iloc[:limit].reset_index(drop=True)
        if len(df) < 2 or df["arrival_s"].max() <= df["arrival_s"].min():
            raise UserError(f"{trace or 'azure-conv'}: a sweep needs a trace with at least two distinct "
                            "arrival times (rates rescale the gaps)")
        if out.exists() and not out.is_dir():
            raise UserError(f"--out {out}: exists and is not a folder")
        from cli.runs import lock_out
        lock_out(out)  # one sweep at a time writes a sweep folder
        # Start the executor before writing anything, so a cluster that does not answer leaves no files.
        if executor == "ray":
            runner = RayExecutor(df, address, num_cpus=jobs)
        else:
            n = jobs or default_jobs()
            runner = SerialExecutor(df) if n == 1 else LocalExecutor(n, out / TRACE_FILE)
    except SweepError as exc:
        raise UserError(str(exc)) from None
    source = trace or "azure-conv"
    err_console.print(f"sweep: {len(axes.configs())} configurations x {len(rates)} rates on {source} "
                      f"({runner.name} executor), SLO {plan.slo.describe()}", highlight=False)
    try:
        result = _run(df, source, plan, out, runner)
    finally:
        runner.close()
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
        from cli.common import warn
        warn(f"{result.num_failed} point(s) failed (their causes are in the error column of "
             f"{out / 'sweep.parquet'}); run the same sweep again to retry them")
        raise typer.Exit(code=1)


def _run(df, source, plan, out, runner):
    """Run the sweep with a progress bar on a terminal, one log line per point otherwise."""
    from simulator.slo import UNITS
    from simulator.sweep.axes import config_label
    from simulator.sweep.runner import run_sweep

    def line(p) -> str:
        head = f"[{p.done}/{p.total}] {config_label(p.spec.config_dict)} rate={p.spec.rate:g}"
        if p.error is not None:
            return f"{head}: failed: {p.error}"
        value = plan.slo.summary_value(p.summary) * UNITS[plan.slo.unit]
        verdict = "meets" if plan.slo.met(p.summary) else "misses"
        how = "reused" if p.reused else f"{p.summary.get('wall_s', float('nan')):.1f}s"
        return f"{head}: {plan.slo.name} {value:.4g} {plan.slo.unit} ({verdict} SLO, {how})"

    if not err_console.is_terminal:
        return run_sweep(df, source, plan, out, runner,
                         progress=lambda p: err_console.print(escape(line(p)), highlight=False))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as bar:
        task = bar.add_task("sweeping", total=None)
        return run_sweep(df, source, plan, out, runner,
                         progress=lambda p: bar.update(task, completed=p.done, total=p.total))

"""`pagelab simulate`: replay a trace against the paged and contiguous allocators side by side."""
from __future__ import annotations

import contextlib
import dataclasses
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cli import app
from cli.common import UserError, atomic_dir, console, err_console, user_errors
from simulator.core.cache_config import ALLOCATORS

ALL_ALLOCATORS = list(ALLOCATORS)


def _version() -> str:
    try:
        return version("pagelab")
    except PackageNotFoundError:
        return "unknown"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _num(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def comparison_table(summaries: dict[str, dict]) -> Table:
    """The side-by-side table printed after a run."""
    t = Table(title="KV-cache memory and serving metrics (time-weighted over the run)")
    cols = ["allocator", "token%", "resv%", "intern%", "extern%", "free%", "batch",
            "out tok/s", "norm s/tok", "TTFT p50", "TTFT p99", "preempt", "reject"]
    for c in cols:
        t.add_column(c, justify="left" if c == "allocator" else "right")
    for name, s in summaries.items():
        m = s["memory"]
        t.add_row(name, _pct(m["token_states"]), _pct(m["reservation"]), _pct(m["internal_fragmentation"]),
                  _pct(m["external_fragmentation"]), _pct(m["free"]), _num(s["mean_batch_size"]),
                  _num(s["throughput_tokens_per_s"], ".0f"), _num(s["normalized_latency_s_per_token"], ".4f"),
                  _num(s["ttft_s"]["p50"], ".3f"), _num(s["ttft_s"]["p99"], ".3f"),
                  str(s["num_preemptions"]), str(s["num_rejected"]))
    return t


@app.command("simulate")
@user_errors
def simulate_cmd(
    trace: str = typer.Argument(None, help="Trace file or bundled name (default: azure-conv)."),
    allocator: list[str] = typer.Option(None, "--allocator", "-a",
                                        help="paged, contiguous-max, contiguous-pow2, contiguous-oracle "
                                             "(repeat; default: all four)."),
    model: str = typer.Option("llama-3-8b", help="Model preset."),
    gpu: str = typer.Option("a100-80gb", help="GPU preset."),
    kv_memory_gb: float = typer.Option(None, help="KV-cache size in GiB (overrides the GPU arithmetic)."),
    capacity_tokens: int = typer.Option(None, help="KV capacity in token slots (overrides everything)."),
    block_size: int = typer.Option(16, help="Paged block size in tokens."),
    max_model_len: int = typer.Option(None, help="Longest sequence (default: the model's)."),
    max_num_seqs: int = typer.Option(256, help="Most requests running at once."),
    max_num_batched_tokens: int = typer.Option(None, help="Token budget of one step."),
    chunked_prefill: bool = typer.Option(False, help="Split long prompts across steps."),
    preemption: str = typer.Option("recompute", help="recompute or swap."),
    prefix_caching: bool = typer.Option(True, help="Reuse cached prefix blocks (paged)."),
    placement: str = typer.Option("buddy", help="Contiguous placement: buddy or first-fit."),
    latency: str = typer.Option("roofline", help="roofline, or a fitted latency profile (JSON)."),
    rate: float = typer.Option(None, help="Rescale arrivals to this mean rate (requests/s)."),
    limit: int = typer.Option(None, help="Use only the first N requests."),
    seed: int = typer.Option(0, help="Random seed (beam search model)."),
    mode: str = typer.Option("fast", help="fast (event-driven spans) or step (reference)."),
    events: bool = typer.Option(True, help="Record pool tenures for block maps."),
    out: Path = typer.Option(None, "--out", "-o", help="Write a run folder here."),
    table_format: str = typer.Option("parquet", "--table-format", help="parquet or csv."),
    plot: bool = typer.Option(False, help="Draw the figures into OUT/figures after simulating."),
    sharing: bool = typer.Option(False, help="Also measure the blocks saved by sharing (paged, step mode)."),
) -> None:
    """Replay a request trace against KV-cache allocators and compare where the memory goes."""
    from simulator.sim_config import SimConfig
    from simulator.simulate import simulate
    from traces import default_trace_path, load_trace, rescale_rate
    from traces.stats import trace_info

    names = allocator or ALL_ALLOCATORS
    for name in names:
        if name not in ALL_ALLOCATORS:
            raise UserError(f"unknown allocator {name!r}; choose from {', '.join(ALL_ALLOCATORS)}")
    if table_format not in ("parquet", "csv"):
        raise UserError(f"--table-format must be parquet or csv, got {table_format!r}")
    if plot and out is None:
        raise UserError("--plot needs --out (the figures go to OUT/figures)")
    warnings: list[str] = []
    source = trace or str(default_trace_path())
    df = load_trace(source if trace else "azure-conv", warnings=warnings)
    for w in warnings:
        err_console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
    if limit is not None:
        if limit < 1:
            raise UserError(f"--limit must be >= 1, got {limit}")
        df = df.iloc[:limit].reset_index(drop=True)
    if rate is not None:
        df = rescale_rate(df, rate)
    info = {"source": trace or "azure-conv", **trace_info(df), "rate_override": rate, "limit": limit}
    base = SimConfig(model=model, gpu=gpu, kv_memory_gb=kv_memory_gb, capacity_tokens=capacity_tokens,
                     block_size=block_size, max_model_len=max_model_len, placement=placement,
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     enable_chunked_prefill=chunked_prefill, preemption_mode=preemption,
                     enable_prefix_caching=prefix_caching, latency=latency, seed=seed, mode=mode,
                     record_events=events and out is not None,
                     extra={"trace": info["source"], "rate": rate, "pagelab_version": _version()})
    if out is not None:
        from cli.runs import clear_stale_temps
        clear_stale_temps(out)
    results = {}
    with contextlib.ExitStack() as stack:
        # The run folder is open while simulating: tenures and memory rows stream into it
        # (tmp/NAME/events.*, memory.*) and it is renamed into place only once everything is written.
        tmp = stack.enter_context(atomic_dir(out)) if out is not None else None
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err_console, transient=True) as progress:
            for name in names:
                task = progress.add_task(f"simulating {name}", total=len(df))
                cfg = dataclasses.replace(base, allocator=name)
                report = lambda done, total, t=task: progress.update(t, completed=done)  # noqa: E731
                sinks = {}
                if tmp is not None:
                    from simulator.recorder import MEMORY_DTYPES
                    from simulator.sinks import open_event_sink, open_memory_sink
                    (tmp / name).mkdir()
                    sinks["memory"] = open_memory_sink(tmp / name / "memory", MEMORY_DTYPES, table_format)
                    if cfg.record_events:
                        sinks["events"] = open_event_sink(tmp / name / "events", table_format)
                results[name] = simulate(df, cfg, progress=report, **sinks)
        console.print(comparison_table({n: r.summary for n, r in results.items()}))
        if sharing:
            from simulator.sharing import sharing_saving
            r = sharing_saving(df, dataclasses.replace(base, allocator="paged"))
            console.print(f"sharing saves {100 * r['saving']:.1f}% of blocks (paged, step average): "
                          f"{r['mean_physical_blocks']:.0f} physical vs "
                          f"{r['mean_logical_blocks']:.0f} logical blocks")
        if tmp is not None:
            from cli.runs import write_run_files
            write_run_files(tmp, info, results, table_format)
    if out is not None:
        err_console.print(f"wrote {out}")
        if plot:
            from viz import plot_runs
            paths = plot_runs([out], out / "figures")
            err_console.print(f"drew {len(paths)} figures into {out / 'figures'}")

"""`pagelab simulate`: replay a trace against the paged and contiguous allocators side by side."""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import typer

from cli.common import UserError, atomic_dir, err_console, finite_float, user_errors
from cli.serving import (
    GOODPUT_HELP,
    Bars,
    allocators,
    cap_concurrency,
    check_metric_options,
    load_workload,
    report,
)
from pagelab.malloc import map_large_allocations

# A paged pool is bookkept with Python objects per block (~80 bytes each): past this many blocks a pool
# that the trace cannot fill is refused instead of built (see pool_problem).
MAX_IDLE_POOL_BLOCKS = 2**21


def pool_problem(df, config) -> str | None:
    """Why the configured pool is absurdly large for this trace, or None.

    A pool is refused when it has more than MAX_IDLE_POOL_BLOCKS blocks AND more slots than the trace
    could ever occupy: at most max_num_seqs requests run at once, each holding at most max_model_len
    slots per sequence (twice that, for the rounding of pow2/buddy reservations).
    """
    capacity = config.capacity()
    blocks = capacity // config.block_size if config.is_paged else capacity // 16
    from traces.batches import FrameBatches, TraceBatches

    rows = df if isinstance(df, TraceBatches) else FrameBatches(df)
    width = max(int(max(c["n"].max(), c["beam_width"].max())) for c in rows.iter_batches(("n", "beam_width")))
    num = rows.num_rows
    bound = 2 * min(num, config.max_num_seqs) * config.resolved_max_model_len * width
    if blocks <= MAX_IDLE_POOL_BLOCKS or capacity <= bound:
        return None
    gib = bound * config.model_spec.bytes_per_token / 2**30
    return (f"the KV pool holds {capacity:,} token slots, but this trace can never use more than {bound:,} "
            f"(at most {min(num, config.max_num_seqs):,} requests at once x max_model_len "
            f"{config.resolved_max_model_len:,} x {width} sequence(s) x 2); give at most "
            f"--kv-memory-gb {gib:.3g} or --capacity-tokens {bound}")


@user_errors
def simulate_cmd(
    trace: str = typer.Argument(None, help="Trace file or bundled name (default: azure-conv)."),
    trace_opt: str = typer.Option(None, "--trace", help="The trace, as an option (same as the argument)."),
    allocator: list[str] = typer.Option(None, "--allocator", "-a",
                                        help="paged, contiguous-max, contiguous-pow2, contiguous-oracle "
                                             "(repeat or comma-separate; default: all four)."),
    model: str = typer.Option(None, help="Model preset (see `pagelab presets`; default: llama-3-8b, or the "
                                         "--profile's)."),
    gpu: str = typer.Option(None, help="GPU preset (see `pagelab presets`; default: a100-80gb, or the "
                                       "--profile's)."),
    kv_memory_gb: float = typer.Option(None, help="KV-cache size in GiB (overrides the GPU arithmetic)."),
    capacity_tokens: int = typer.Option(None, help="KV capacity in token slots (overrides everything)."),
    block_size: int = typer.Option(16, help="Paged block size in tokens."),
    max_model_len: int = typer.Option(None, help="Longest sequence (default: the model's)."),
    max_num_seqs: int = typer.Option(256, help="Most requests running at once."),
    max_concurrency: int = typer.Option(None, help="Most requests in flight (vLLM bench); simulated as a "
                                                   "cap on --max-num-seqs, see docs/run-format.md."),
    max_num_batched_tokens: int = typer.Option(None, help="Token budget of one step."),
    chunked_prefill: bool = typer.Option(False, help="Split long prompts across steps."),
    preemption: str = typer.Option("recompute", help="recompute or swap."),
    prefix_caching: bool = typer.Option(True, help="Reuse cached prefix blocks (paged)."),
    placement: str = typer.Option(None, help="Contiguous placement: buddy (default) or first-fit; "
                                             "only with a contiguous allocator."),
    latency: str = typer.Option("roofline", help="roofline, or a fitted latency profile (JSON)."),
    rate: float = typer.Option(None, "--request-rate", "--rate",
                               help="Re-time arrivals to this mean rate (req/s); inf: all at t=0."),
    burstiness: float = typer.Option(None, help="With --request-rate: fresh gamma gaps of this shape "
                                                "(1 Poisson, <1 burstier), as vLLM bench."),
    limit: int = typer.Option(None, "--limit", help="Use only the first N requests."),
    num_prompts: int = typer.Option(None, "--num-prompts", help="Same as --limit (vLLM's name)."),
    seed: int = typer.Option(0, help="Random seed (beam search model, --burstiness arrivals)."),
    mode: str = typer.Option("fast", help="fast (event-driven spans) or step (reference)."),
    events: bool = typer.Option(True, help="Record pool tenures for block maps."),
    out: Path = typer.Option(None, "--out", "-o", help="Write a run folder here (new, empty, or a run "
                                                        "with --overwrite)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the pagelab run already in --out."),
    table_format: str = typer.Option("parquet", "--table-format", help="parquet or csv."),
    plot: bool = typer.Option(False, help="Draw the figures into OUT/figures after simulating."),
    sharing: bool = typer.Option(False, help="Also measure the blocks saved by sharing (paged, step mode)."),
    percentile_metrics: str = typer.Option(None, help="Metrics with percentiles: ttft,tpot,itl,e2el "
                                                      "(default ttft,tpot,itl)."),
    metric_percentiles: str = typer.Option(None, help="Percentiles to report, e.g. 50,90,99 (default 99)."),
    goodput: list[str] = typer.Option(None, help=GOODPUT_HELP),
    save_result: bool = typer.Option(False, "--save-result", help="Save the metrics as JSON (vLLM bench)."),
    result_dir: Path = typer.Option(None, "--result-dir", help="Folder of the result JSON (default: .)."),
    result_filename: str = typer.Option(None, "--result-filename", help="Name of the result JSON."),
    profile: str = typer.Option(None, help="Fitted latency profile: a bundled name (cpu-tiny) or a JSON file "
                                           "from pagelab calibrate; --model/--gpu default to its own."),
    step_times_from: Path = typer.Option(None, "--step-times-from", metavar="REAL_RUN",
                                         help="Retrace a replay: its pool, scheduler options, trace and "
                                              "measured step times (forces --mode step)."),
    config_from: Path = typer.Option(None, "--config-from", metavar="REAL_RUN",
                                     help="Simulate a replay's run: its pool, scheduler options and trace as "
                                          "run (arrivals, clipped prompts), timed by the latency model."),
) -> None:
    """Replay a request trace against KV-cache allocators and compare where the memory goes."""
    from bench.run_tools import simulate_runs, simulation_labels, simulation_metadata
    from cli.runs import check_out
    from simulator.config import SimConfig
    from simulator.core.config import ALLOCATORS

    names = allocators(allocator, list(ALLOCATORS))
    if placement is not None and all(ALLOCATORS[n] is None for n in names):
        raise UserError("--placement only applies to contiguous allocators (-a contiguous-max, ...); "
                        "the paged allocator places blocks anywhere")
    if sharing and "paged" not in names:
        raise UserError("--sharing measures the blocks the paged allocator shares (the contiguous allocators "
                        "share none); add -a paged, or leave --sharing out")
    if table_format not in ("parquet", "csv"):
        raise UserError(f"--table-format must be parquet or csv, got {table_format!r}")
    if plot and out is None:
        raise UserError("--plot needs --out (the figures go to OUT/figures)")
    finite_float(kv_memory_gb, "--kv-memory-gb")
    max_num_seqs = cap_concurrency(max_num_seqs, max_concurrency)
    kinds, percentiles, slos = check_metric_options(percentile_metrics, metric_percentiles, goodput)
    if out is not None:
        check_out(out, overwrite)
    if step_times_from is not None and config_from is not None:
        raise UserError("give --step-times-from or --config-from, not both")
    # A canonical Parquet trace is read in blocks of rows as the simulation goes (a 10M-request trace is
    # never held whole), unless a replay's run or --sharing needs it in memory.
    stream = step_times_from is None and config_from is None and not sharing
    map_large_allocations()  # before the trace is read: its blocks stay out of the heap (pagelab/malloc.py)
    df, info = load_workload(trace, trace_opt, limit, num_prompts, rate, burstiness, seed, stream=stream)
    model, gpu, latency = _latency_choice(model, gpu, latency, profile)
    base = SimConfig(model=model, gpu=gpu, kv_memory_gb=kv_memory_gb, capacity_tokens=capacity_tokens,
                     block_size=block_size, max_model_len=max_model_len, placement=placement or "buddy",
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     enable_chunked_prefill=chunked_prefill, preemption_mode=preemption,
                     enable_prefix_caching=prefix_caching, latency=latency, seed=seed, mode=mode,
                     record_events=events and out is not None,
                     extra=simulation_labels(info, max_concurrency))
    measured = None
    if step_times_from is not None or config_from is not None:
        from bench.run_tools import replay_twin

        name, df, base, measured = replay_twin(step_times_from or config_from,
                                               df if (trace or trace_opt) else None, base,
                                               step_times=step_times_from is not None)
        names = [name]
    for name in names:
        problem = pool_problem(df, dataclasses.replace(base, allocator=name))
        if problem:
            raise UserError(problem)
    extra = {}
    with contextlib.ExitStack() as stack:
        # The run folder is open while simulating: tenures and memory rows stream into it
        # (tmp/NAME/events.*, memory.*) and it is renamed into place only once everything is written.
        tmp = stack.enter_context(atomic_dir(out)) if out is not None else None
        with Bars("simulating") as bars:
            def progress_of(name: str):
                bars.add(name, info["num_requests"])
                return lambda done, total: bars.update(name, done)

            results = simulate_runs(df, {n: dataclasses.replace(base, allocator=n) for n in names}, tmp,
                                    info["num_requests"], table_format, step_times=measured,
                                    progress_of=progress_of)
        if sharing:
            from simulator.sharing import sharing_saving
            r = sharing_saving(df, dataclasses.replace(base, allocator="paged"))
            extra["sharing"] = r
            err_console.print(f"sharing saves {100 * r['saving']:.1f}% of blocks (paged, step average): "
                              f"{r['mean_physical_blocks']:.0f} physical vs "
                              f"{r['mean_logical_blocks']:.0f} logical blocks")
        metrics = report("simulate", results, info, kinds, percentiles, slos, save=save_result,
                         result_dir=result_dir, result_filename=result_filename, extra=extra)
        if tmp is not None:
            from cli.runs import write_run_files
            meta = simulation_metadata(base, names, info["source"])
            write_run_files(tmp, info, results, table_format, metadata=meta,
                            extra_summary={**extra, "serving_metrics": metrics})
    if out is not None:
        err_console.print(f"wrote {out}", markup=False)
        if plot:
            from viz import plot_runs
            paths = plot_runs([out], out / "figures")
            err_console.print(f"drew {len(paths)} figures into {out / 'figures'}", markup=False)


def _latency_choice(model: str | None, gpu: str | None, latency: str, profile: str | None):
    """(model, gpu, latency) after --profile: a profile fixes the latency model and the default presets."""
    if profile is None:
        return model or "llama-3-8b", gpu or "a100-80gb", latency
    from simulator.timing.step_latency import load_fitted

    fitted = load_fitted(profile)
    return model or fitted.model.name, gpu or fitted.gpu.name, profile

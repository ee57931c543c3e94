"""`pagelab simulate`: replay a trace against the paged and contiguous allocators side by side."""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Literal

import typer

from cli.common import UserError, atomic_dir, err_console, finite_float, user_errors, warn
from cli.help import OUTPUT, POOL, SCHEDULER, TRACE, VLLM
from cli.pool_options import (
    CPU_OFFLOAD_BANDWIDTH_GBPS,
    DISK_OFFLOAD_BANDWIDTH_GBPS,
    HYBRID_KV_CACHE,
    KV_OFFLOADING_BLOCK_SIZE,
    KV_OFFLOADING_DISK_SIZE,
    KV_OFFLOADING_POLICY,
    KV_OFFLOADING_SIZE,
    KV_OFFLOADING_STORE,
    pool_problem,
    tier_fields,
)
from cli.serving import (
    GOODPUT,
    METRIC_PERCENTILES,
    NUM_PROMPTS,
    PERCENTILE_METRICS,
    RESULT_DIR,
    RESULT_FILENAME,
    SAVE_RESULT,
    Bars,
    allocators,
    cap_concurrency,
    load_workload,
    print_capacity,
    report,
    reporting,
)
from pagelab.malloc import map_large_allocations
from simulator.core.models import get_model

KvDtype = Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]
Preemption = Literal["recompute", "swap"]
Mode = Literal["fast", "step"]
TableFormat = Literal["parquet", "csv"]
Placement = Literal["buddy", "first-fit"]

# What a simulation of a replay takes from the replay's run (bench/run_tools.py replay_twin): the model,
# the pool, the scheduler and the trace as it ran; given as well, they would be dropped without a word.
_TWIN_TAKES = ("model", "gpu", "gpu_memory_utilization", "kv_cache_dtype", "kv_memory_gb",
               "capacity_tokens", "block_size", "max_model_len", "allocator", "placement", "prefix_caching",
               "kv_offloading_size", "kv_offloading_disk_size", "kv_offloading_block_size",
               "kv_offloading_policy", "kv_offloading_store", "cpu_offload_bandwidth_gbps",
               "disk_offload_bandwidth_gbps", "hybrid_kv_cache", "max_num_seqs", "max_num_batched_tokens",
               "chunked_prefill", "preemption", "limit", "num_prompts", "rate", "burstiness",
               "max_concurrency")
_STEP_TIMES_TAKE = ("latency", "profile", "mode")  # the measured step times replace the latency model


def _given(ctx: typer.Context, names: tuple[str, ...]) -> list[str]:
    """The options among parameters `names` that the command line gave, as the flags that name them."""
    params = {p.name: p for p in ctx.command.params}
    return [params[n].opts[0] for n in names
            if (source := ctx.get_parameter_source(n)) is not None and source.name == "COMMANDLINE"]


@user_errors
def simulate_cmd(
    ctx: typer.Context,
    trace: str = typer.Argument(None, metavar="TRACE", rich_help_panel=TRACE,
                                help="Trace file or bundled name (default: azure-conv)."),
    trace_opt: str = typer.Option(None, "--trace", rich_help_panel=TRACE,
                                  help="The trace, as an option (same as the argument)."),
    limit: int = typer.Option(None, "--limit", rich_help_panel=TRACE,
                              help="Use only the first N requests (default: all)."),
    rate: float = typer.Option(None, "--request-rate", "--rate", rich_help_panel=TRACE,
                               help="Re-time arrivals to this mean rate (req/s); inf: all at t=0 (default: "
                                    "the trace's own arrival times)."),
    burstiness: float = typer.Option(None, rich_help_panel=TRACE,
                                     help="With --request-rate: fresh gamma gaps of this shape (1 Poisson, "
                                          "<1 burstier), as vLLM bench (default: the trace's gaps scaled)."),
    seed: int = typer.Option(0, rich_help_panel=TRACE, help="Random seed (beam search model, --burstiness "
                                                             "arrivals)."),
    step_times_from: Path = typer.Option(None, "--step-times-from", metavar="REAL_RUN", rich_help_panel=TRACE,
                                         help="Retrace a replay: its pool, scheduler options, trace and "
                                              "measured step times (forces --mode step)."),
    config_from: Path = typer.Option(None, "--config-from", metavar="REAL_RUN", rich_help_panel=TRACE,
                                     help="Simulate a replay's run: its pool, scheduler options and trace as "
                                          "run (arrivals, clipped prompts), timed by the latency model."),
    model: str = typer.Option(None, rich_help_panel=POOL,
                              help="Registry name, Hugging Face id (meta-llama/Meta-Llama-3-8B-Instruct) or "
                                   "local folder with a config.json; see `pagelab presets` (default: "
                                   "llama-3-8b, or the --profile's)."),
    gpu: str = typer.Option(None, rich_help_panel=POOL,
                            help="GPU preset: a100-40gb, a100-80gb, h100-80gb, h200, cpu (default: "
                                 "a100-80gb, or the --profile's)."),
    gpu_memory_utilization: float = typer.Option(0.9, rich_help_panel=POOL,
                                                 help="Share of the GPU's memory for weights, activations "
                                                      "and the KV cache, as vLLM's."),
    kv_cache_dtype: KvDtype = typer.Option("auto", rich_help_panel=POOL,
                                           help="Dtype of the KV cache (auto: the model's; fp8 halves "
                                                "16-bit bytes per token)."),
    kv_memory_gb: float = typer.Option(None, rich_help_panel=POOL,
                                       help="KV cache size in GiB, instead of what the GPU leaves (default: "
                                            "gpu-memory-utilization x GPU memory - weights - 1 GiB)."),
    capacity_tokens: int = typer.Option(None, rich_help_panel=POOL,
                                        help="KV cache size in tokens, vLLM's \"GPU KV cache size\" "
                                             "(overrides --kv-memory-gb)."),
    block_size: int = typer.Option(16, rich_help_panel=POOL, help="Paged block size in tokens."),
    max_model_len: int = typer.Option(None, rich_help_panel=POOL,
                                      help="Longest sequence, prompt + output (default: the model's)."),
    allocator: list[str] = typer.Option(None, "--allocator", "-a", rich_help_panel=POOL,
                                        help="paged, contiguous-max, contiguous-pow2, contiguous-oracle "
                                             "(repeat or comma-separate; default: all four)."),
    placement: Placement = typer.Option(None, rich_help_panel=POOL,
                                        help="Contiguous placement; only with a contiguous allocator "
                                             "(default: buddy)."),
    prefix_caching: bool = typer.Option(True, rich_help_panel=POOL,
                                        help="Reuse cached prefix blocks (paged)."),
    kv_offloading_size: float = KV_OFFLOADING_SIZE,
    kv_offloading_disk_size: float = KV_OFFLOADING_DISK_SIZE,
    kv_offloading_block_size: int = KV_OFFLOADING_BLOCK_SIZE,
    kv_offloading_policy: str = KV_OFFLOADING_POLICY,
    kv_offloading_store: str = KV_OFFLOADING_STORE,
    cpu_offload_bandwidth_gbps: float = CPU_OFFLOAD_BANDWIDTH_GBPS,
    disk_offload_bandwidth_gbps: float = DISK_OFFLOAD_BANDWIDTH_GBPS,
    hybrid_kv_cache: bool = HYBRID_KV_CACHE,
    max_num_seqs: int = typer.Option(256, rich_help_panel=SCHEDULER, help="Most requests running at once."),
    max_num_batched_tokens: int = typer.Option(None, rich_help_panel=SCHEDULER,
                                               help="Token budget of one step (default: max(max-model-len, "
                                                    "2048) + max-num-seqs; 512 with chunked prefill)."),
    chunked_prefill: bool = typer.Option(False, rich_help_panel=SCHEDULER,
                                         help="Split long prompts across steps."),
    preemption: Preemption = typer.Option("recompute", rich_help_panel=SCHEDULER,
                                          help="What a preempted request loses: recompute its KV cache, or "
                                               "swap it to the CPU."),
    latency: str = typer.Option("roofline", rich_help_panel=SCHEDULER,
                                help="Step-time model: roofline, or the path of a fitted profile (JSON)."),
    profile: str = typer.Option(None, rich_help_panel=SCHEDULER,
                                help="Fitted latency profile: a bundled name (cpu-tiny, h200-llama-1b) or a "
                                     "JSON file from pagelab calibrate; --model/--gpu default to its own."),
    mode: Mode = typer.Option("fast", rich_help_panel=SCHEDULER,
                              help="fast: spans of decode steps at once; step: every step (reference)."),
    out: Path = typer.Option(None, "--out", "-o", rich_help_panel=OUTPUT,
                             help="Write a run folder here (new, empty, or a run with --overwrite)."),
    overwrite: bool = typer.Option(False, "--overwrite", rich_help_panel=OUTPUT,
                                   help="Replace the pagelab run already in --out."),
    table_format: TableFormat = typer.Option("parquet", "--table-format", rich_help_panel=OUTPUT,
                                             help="File format of the run folder's tables."),
    events: bool = typer.Option(True, rich_help_panel=OUTPUT, help="Record pool tenures for block maps."),
    plot: bool = typer.Option(False, rich_help_panel=OUTPUT,
                              help="Draw the figures into OUT/figures after simulating."),
    sharing: bool = typer.Option(False, rich_help_panel=OUTPUT,
                                 help="Also measure the blocks saved by sharing (paged, step mode)."),
    as_json: bool = typer.Option(False, "--json", rich_help_panel=OUTPUT,
                                 help="Print the results as JSON, one vLLM-shaped object per allocator and "
                                      "line, instead of the tables."),
    num_prompts: int = NUM_PROMPTS,
    max_concurrency: int = typer.Option(None, rich_help_panel=VLLM,
                                        help="Most requests in flight; simulated as a cap on --max-num-seqs "
                                             "(default: no cap)."),
    percentile_metrics: str = PERCENTILE_METRICS,
    metric_percentiles: str = METRIC_PERCENTILES,
    goodput: list[str] = GOODPUT,
    save_result: bool = SAVE_RESULT,
    result_dir: Path = RESULT_DIR,
    result_filename: str = RESULT_FILENAME,
) -> None:
    """Replay a request trace against KV-cache allocators and compare where the memory goes."""
    from bench.run_tools import simulate_runs, simulation_labels, simulation_metadata, twin_info
    from cli.runs import check_out
    from simulator.config import SimConfig
    from simulator.core.config import ALLOCATORS
    from simulator.timing.step_latency import check_latency

    tiered = kv_offloading_size is not None or kv_offloading_disk_size is not None
    names = allocators(allocator, ["paged"] if tiered else list(ALLOCATORS))
    if placement is not None and all(ALLOCATORS[n] is None for n in names):
        raise UserError("--placement only applies to contiguous allocators (-a contiguous-max, ...); "
                        "the paged allocator places blocks anywhere")
    if sharing and "paged" not in names:
        raise UserError("--sharing measures the blocks the paged allocator shares (the contiguous allocators "
                        "share none); add -a paged, or leave --sharing out")
    if plot and out is None:
        raise UserError("--plot needs --out (the figures go to OUT/figures)")
    if out is None and (overwrite or table_format != "parquet"):  # they shape the run folder alone
        raise UserError(f"{'--overwrite' if overwrite else '--table-format'} needs --out (a run folder)")
    if profile is not None and latency != "roofline":
        raise UserError("give --profile or --latency PROFILE.json, not both (each names the step-time model)")
    finite_float(kv_memory_gb, "--kv-memory-gb")
    if not 0 < gpu_memory_utilization <= 1:
        raise UserError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization:g}")
    max_num_seqs = cap_concurrency(max_num_seqs, max_concurrency)
    how = reporting(percentile_metrics, metric_percentiles, goodput, save=save_result, result_dir=result_dir,
                    result_filename=result_filename, as_json=as_json)
    if out is not None:
        check_out(out, overwrite)
    if step_times_from is not None and config_from is not None:
        raise UserError("give --step-times-from or --config-from, not both")
    if step_times_from is not None or config_from is not None:
        option = "--step-times-from" if step_times_from is not None else "--config-from"
        taken = _given(ctx, _TWIN_TAKES + (_STEP_TIMES_TAKE if step_times_from is not None else ()))
        if step_times_from is not None and mode == "step":  # the mode measured step times force anyway
            taken = [flag for flag in taken if flag != "--mode"]
        if taken:
            raise UserError(f"{', '.join(taken)}: {option} takes the model, pool, scheduler and trace (and "
                            f"--step-times-from the step times) from the replay's run; leave them out")
    # A canonical Parquet trace is read in blocks of rows as the simulation goes (a 10M-request trace is
    # never held whole), unless a replay's run or --sharing needs it in memory.
    stream = step_times_from is None and config_from is None and not sharing
    tiers = tier_fields(kv_offloading_size, kv_offloading_disk_size,
                        kv_offloading_block_size=kv_offloading_block_size,
                        kv_offloading_policy=kv_offloading_policy, kv_offloading_store=kv_offloading_store,
                        cpu_offload_bandwidth_gbps=cpu_offload_bandwidth_gbps,
                        disk_offload_bandwidth_gbps=disk_offload_bandwidth_gbps)
    map_large_allocations()  # before the trace is read: its blocks stay out of the heap (pagelab/malloc.py)
    df, info = load_workload(trace, trace_opt, limit, num_prompts, rate, burstiness, seed, stream=stream)
    typed, gpu, latency = _latency_choice(model, gpu, latency, profile)
    spec = get_model(typed)
    # vLLM's model_id is the checkpoint's Hugging Face id (or folder): the one typed, else the entry's.
    model_id = typed if "/" in typed else spec.hf_id or spec.name
    base = SimConfig(model=spec.name or typed, gpu=gpu, kv_memory_gb=kv_memory_gb,
                     capacity_tokens=capacity_tokens, gpu_memory_utilization=gpu_memory_utilization,
                     kv_cache_dtype=kv_cache_dtype, block_size=block_size, max_model_len=max_model_len,
                     placement=placement or "buddy", max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=chunked_prefill,
                     preemption_mode=preemption, enable_prefix_caching=prefix_caching, latency=latency,
                     disable_hybrid_kv_cache_manager=not hybrid_kv_cache,
                     seed=seed, mode=mode, record_events=events and out is not None,
                     extra=simulation_labels(info, max_concurrency), **tiers)
    measured = None
    if step_times_from is not None or config_from is not None:
        from bench.run_tools import replay_twin

        name, df, base, measured, source = replay_twin(step_times_from or config_from,
                                                       df if (trace or trace_opt) else None, base,
                                                       step_times=step_times_from is not None)
        names = [name]
        # The run is the replay's: its trace as run and its model name the results, not the defaults.
        info = twin_info(df, info["source"] if (trace or trace_opt) else source)
        base = dataclasses.replace(base, extra={**base.extra, **simulation_labels(info)})
        spec = get_model(base.model)
        typed, model_id = base.model, spec.hf_id or spec.name
    if sharing and "paged" in names and dataclasses.replace(base, allocator="paged").kv_layout() is not None:
        raise UserError("--sharing counts one block table per sequence; a model with several KV cache groups "
                        "has one per group: add --disable-hybrid-kv-cache-manager, or leave --sharing out")
    for name in names:
        config = dataclasses.replace(base, allocator=name)
        config.check_runnable()  # what building the run would refuse, before the capacity header
        problem = pool_problem(df, config)
        if problem:
            raise UserError(problem)
    if measured is None:  # measured step times replace the latency model
        check_latency(base.latency, base.model_spec, base.gpu)
    capacity = base.kv_capacity()
    print_capacity(capacity, typed, stderr=as_json)
    labels = {"model_id": model_id, "model": base.model, "gpu": base.gpu, "max_concurrency": max_concurrency,
              "kv_cache": capacity.to_dict()}
    extra = {"kv_cache": capacity.to_dict()}
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
        metrics = report("simulate", results, info, how, labels)
        if tmp is not None:
            from cli.runs import write_run_files
            meta = simulation_metadata(base, names, info["source"])
            write_run_files(tmp, info, results, table_format, metadata=meta,
                            extra_summary={**extra, "serving_metrics": metrics})
    if out is not None:
        err_console.print(f"wrote {out}", markup=False)
        if plot:
            from viz import plot_runs
            paths = plot_runs([out], out / "figures", warn=warn)
            err_console.print(f"drew {len(paths)} figures into {out / 'figures'}", markup=False)


def _latency_choice(model: str | None, gpu: str | None, latency: str, profile: str | None):
    """(model, gpu, latency) after --profile: a profile fixes the latency model and the default presets."""
    if profile is None:
        return model or "llama-3-8b", gpu or "a100-80gb", latency
    from simulator.timing.step_latency import load_fitted

    fitted = load_fitted(profile)
    return model or fitted.model.name, gpu or fitted.gpu.name, profile

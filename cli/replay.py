"""`pagelab replay`: run a trace's requests on the real engine and write a run folder like `simulate`."""
from __future__ import annotations

from pathlib import Path

import typer

from cli.common import UserError, console, err_console, finite_float, user_errors
from cli.serving import (
    GOODPUT_HELP,
    Bars,
    allocators,
    cap_concurrency,
    check_metric_options,
    load_workload,
    report,
)

DEFAULT_LIMIT = 64


@user_errors
def replay_cmd(
    trace: str = typer.Argument(None, help="Trace file or bundled name (default: azure-conv)."),
    trace_opt: str = typer.Option(None, "--trace", help="The trace, as an option (same as the argument)."),
    model: str = typer.Option("tiny", help="Model preset (tiny, tiny-qwen2, llama-1b-shape) or a local "
                                           "Hugging Face directory."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    backend: str = typer.Option("auto", help="Attention backend: auto, torch or triton."),
    dtype: str = typer.Option(None, help="float32, float16 or bfloat16 (default: fp32 on CPU)."),
    allocator: list[str] = typer.Option(None, "--allocator", "-a",
                                        help="paged, contiguous-max, contiguous-pow2, contiguous-oracle "
                                             "(repeat or comma-separate; default: paged)."),
    limit: int = typer.Option(None, "--limit", help=f"Replay only the first N requests (default "
                                                    f"{DEFAULT_LIMIT})."),
    num_prompts: int = typer.Option(None, "--num-prompts", help="Same as --limit (vLLM's name)."),
    rate: float = typer.Option(None, "--request-rate", "--rate",
                               help="Re-time arrivals to this mean rate (req/s); inf: all at t=0."),
    burstiness: float = typer.Option(None, help="With --request-rate: gamma gaps of this shape (vLLM)."),
    time_scale: float = typer.Option(1.0, "--time-scale", help="Multiply arrival times (0: all at once)."),
    block_size: int = typer.Option(16, help="Paged block size in tokens."),
    num_blocks: int = typer.Option(None, help="KV pool size in blocks (default: from --kv-memory-gb)."),
    kv_memory_gb: float = typer.Option(None, help="KV pool size in GiB (default: measured free memory on "
                                                  "a GPU, 0.25 GiB on a CPU)."),
    max_model_len: int = typer.Option(None, help="Longest sequence (default: the model's); longer prompts "
                                                 "are clipped."),
    max_num_seqs: int = typer.Option(256, help="Most sequences running at once."),
    max_concurrency: int = typer.Option(None, help="Most requests in flight (vLLM bench); a cap on "
                                                   "--max-num-seqs, see docs/run-format.md."),
    max_num_batched_tokens: int = typer.Option(None, help="Token budget of one step."),
    preemption: str = typer.Option("recompute", help="recompute or swap."),
    swap_space_gb: float = typer.Option(None, help="CPU swap pool in GiB, allocated on first use (default: "
                                                   "4 GiB, at most the KV pool's size)."),
    prefix_caching: bool = typer.Option(True, help="Reuse cached prefix blocks (paged)."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager",
                                       help="No CUDA graphs for decode steps (they are on by default on "
                                            "CUDA with the Triton backend)."),
    seed: int = typer.Option(0, help="Seed of prompt tokens, weights of presets and sampling."),
    clock: str = typer.Option("wall", help="wall, or cpu: a virtual clock of the process's CPU time that "
                                           "jumps over idle gaps (CPU engine; steadier on a shared machine, "
                                           "see docs/calibration.md)."),
    out: Path = typer.Option(None, "--out", "-o", help="Write a run folder here (new, empty, or a run "
                                                        "with --overwrite)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the pagelab run already in --out."),
    table_format: str = typer.Option("parquet", "--table-format", help="parquet or csv."),
    percentile_metrics: str = typer.Option(None, help="Metrics with percentiles: ttft,tpot,itl,e2el."),
    metric_percentiles: str = typer.Option(None, help="Percentiles to report, e.g. 50,90,99 (default 99)."),
    goodput: list[str] = typer.Option(None, help=GOODPUT_HELP),
    save_result: bool = typer.Option(False, "--save-result", help="Save the metrics as JSON (vLLM bench)."),
    result_dir: Path = typer.Option(None, "--result-dir", help="Folder of the result JSON (default: .)."),
    result_filename: str = typer.Option(None, "--result-filename", help="Name of the result JSON."),
) -> None:
    """Replay a trace on the real engine and measure time and memory (same run folder as simulate)."""
    from cli.runs import check_out, write_run
    from gpu_backend.engine.engine_config import EngineConfig
    from gpu_backend.replay import ReplayConfig
    from gpu_backend.replay_run import replay_configs, replay_metadata, replay_to_dir, run_labels

    names = allocators(allocator, ["paged"])
    if table_format not in ("parquet", "csv"):
        raise UserError(f"--table-format must be parquet or csv, got {table_format!r}")
    if clock not in ("wall", "cpu"):
        raise UserError(f"--clock must be wall or cpu, got {clock!r}")
    finite_float(time_scale, "--time-scale", minimum=0)
    finite_float(kv_memory_gb, "--kv-memory-gb")
    finite_float(swap_space_gb, "--swap-space-gb")
    max_num_seqs = cap_concurrency(max_num_seqs, max_concurrency)
    kinds, percentiles, slos = check_metric_options(percentile_metrics, metric_percentiles, goodput)
    if out is not None:
        check_out(out, overwrite)
    df, info = load_workload(trace, trace_opt, limit, num_prompts, rate, burstiness, seed,
                             default_limit=DEFAULT_LIMIT)
    info["time_scale"] = time_scale
    source, limit = info["source"], info["limit"]
    engine = EngineConfig(block_size=block_size, num_blocks=num_blocks, kv_memory_gb=kv_memory_gb,
                          enable_prefix_caching=prefix_caching, max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          preemption_mode=preemption, swap_space_gb=swap_space_gb,
                          enforce_eager=enforce_eager)
    configs = replay_configs(names, ReplayConfig(model=model, device=device, backend=backend, dtype=dtype,
                                                 engine=engine, time_scale=time_scale, seed=seed, clock=clock,
                                                 extra=run_labels(source, limit, max_concurrency)))

    def show(results: dict) -> dict:
        metrics = report("replay", results, info, kinds, percentiles, slos, save=save_result,
                         result_dir=result_dir, result_filename=result_filename)
        for name, res in results.items():
            m = res.summary["measured"]
            step = m["step_time_s"]
            clipped = m["num_clipped_prompts"]
            console.print(f"{name}: {res.summary['num_steps']} steps on {m['device']} ({m['backend']}), "
                          f"step time p50 {1e3 * (step['p50'] or 0):.1f} ms, "
                          f"KV pool {m['kv_pool_bytes'] / 2**20:.0f} MiB"
                          + (f", {clipped} prompts clipped to max_model_len" if clipped else ""))
        return {"serving_metrics": metrics}

    meta = replay_metadata(configs, source)
    with Bars("replaying") as bars:
        for n in names:
            bars.add(n, len(df))
        try:
            replay_to_dir(df, configs, info, out, table_format, lambda n, done, total: bars.update(n, done),
                          metadata=meta, before_write=show, write=write_run)
        except MemoryError:
            raise UserError("the KV pool (--kv-memory-gb / --num-blocks) does not fit in this machine's "
                            "memory; give a smaller pool") from None
        except RuntimeError as exc:  # torch's allocators (CPU and CUDA out-of-memory) raise RuntimeErrors
            if "out of memory" not in str(exc) and "allocate" not in str(exc):
                raise
            raise UserError(f"the KV pool (--kv-memory-gb / --num-blocks) does not fit on the device: "
                            f"{str(exc).splitlines()[0]}") from None
    if out is not None:
        err_console.print(f"wrote {out}", markup=False)

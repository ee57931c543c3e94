"""`pagelab replay`: run a trace's requests on the real engine and write a run folder like `simulate`."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import typer

from cli.common import UserError, console, err_console, finite_float, user_errors
from cli.help import OUTPUT, POOL, SCHEDULER, TRACE, VLLM
from cli.pool_options import (
    HYBRID_KV_CACHE,
    KV_OFFLOADING_BLOCK_SIZE,
    KV_OFFLOADING_DISK_SIZE,
    KV_OFFLOADING_POLICY,
    KV_OFFLOADING_SIZE,
    KV_OFFLOADING_STORE,
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
from cli.simulate import Preemption, TableFormat

DEFAULT_LIMIT = 64
Clock = Literal["wall", "cpu"]


def replay_capacity(config: dict):
    """The KV pool a replay ran with, as the capacity header reports it (from its config.json)."""
    from simulator.core.scheduler import SchedulerConfig
    from simulator.presets import kv_capacity

    # The engine's scheduler steps by this budget, which bounds what a sliding window holds per request;
    # unset, kv_capacity would assume vLLM's server default instead.
    budget = SchedulerConfig(max_num_seqs=int(config["max_num_seqs"]),
                             max_num_batched_tokens=config.get("max_num_batched_tokens"),
                             max_model_len=int(config["max_model_len"]),
                             enable_chunked_prefill=bool(config.get("enable_chunked_prefill"))).token_budget
    return kv_capacity(str(config["model"]), capacity_tokens=int(config["capacity_tokens"]),
                       kv_cache_dtype=str(config["dtype"]), block_size=int(config["block_size"]),
                       max_model_len=int(config["max_model_len"]), sized_by=str(config["capacity_source"]),
                       device="CPU" if str(config.get("device", "")).startswith("cpu") else "GPU",
                       max_num_batched_tokens=budget,
                       hybrid=not config.get("disable_hybrid_kv_cache_manager", False))


@user_errors
def replay_cmd(
    trace: str = typer.Argument(None, metavar="TRACE", rich_help_panel=TRACE,
                                help="Trace file or bundled name (default: azure-conv)."),
    trace_opt: str = typer.Option(None, "--trace", rich_help_panel=TRACE,
                                  help="The trace, as an option (same as the argument)."),
    limit: int = typer.Option(None, "--limit", rich_help_panel=TRACE,
                              help=f"Replay only the first N requests (default {DEFAULT_LIMIT})."),
    rate: float = typer.Option(None, "--request-rate", "--rate", rich_help_panel=TRACE,
                               help="Re-time arrivals to this mean rate (req/s); inf: all at t=0 (default: "
                                    "the trace's own arrival times)."),
    burstiness: float = typer.Option(None, rich_help_panel=TRACE,
                                     help="With --request-rate: gamma gaps of this shape (vLLM; default: "
                                          "the trace's gaps scaled)."),
    time_scale: float = typer.Option(1.0, "--time-scale", rich_help_panel=TRACE,
                                     help="Multiply arrival times (0: all at once)."),
    seed: int = typer.Option(0, rich_help_panel=TRACE, help="Seed of prompt tokens, weights of presets and "
                                                             "sampling."),
    model: str = typer.Option("tiny", rich_help_panel=POOL,
                              help="Engine preset (tiny, tiny-qwen2, tiny-hybrid, llama-1b-shape) or a local "
                                   "Hugging Face folder."),
    device: str = typer.Option("auto", rich_help_panel=POOL, help="auto, cpu or cuda."),
    backend: str = typer.Option("auto", rich_help_panel=POOL,
                                help="Attention backend: auto, torch or triton."),
    dtype: str = typer.Option(None, rich_help_panel=POOL,
                              help="float32, float16 or bfloat16 (default: fp32 on CPU, bf16 on CUDA)."),
    gpu_memory_utilization: float = typer.Option(0.9, rich_help_panel=POOL,
                                                 help="Share of the GPU's memory the engine may use; the KV "
                                                      "pool gets what weights and activations leave (CUDA)."),
    kv_memory_gb: float = typer.Option(None, rich_help_panel=POOL,
                                       help="KV pool size in GiB (default: measured free memory on a GPU, "
                                            "0.25 GiB on a CPU)."),
    num_blocks: int = typer.Option(None, rich_help_panel=POOL,
                                   help="KV pool size in blocks of every layer (overrides --kv-memory-gb; "
                                        "KV cache groups split those bytes into their pages)."),
    block_size: int = typer.Option(16, rich_help_panel=POOL, help="Paged block size in tokens."),
    max_model_len: int = typer.Option(None, rich_help_panel=POOL,
                                      help="Longest sequence (default: the model's); longer prompts are "
                                           "clipped."),
    allocator: list[str] = typer.Option(None, "--allocator", "-a", rich_help_panel=POOL,
                                        help="paged, contiguous-max, contiguous-pow2, contiguous-oracle "
                                             "(repeat or comma-separate; default: paged)."),
    prefix_caching: bool = typer.Option(True, rich_help_panel=POOL,
                                        help="Reuse cached prefix blocks (paged)."),
    swap_space_gb: float = typer.Option(None, rich_help_panel=POOL,
                                        help="CPU swap pool in GiB, grown as blocks are swapped out "
                                             "(default: 4 GiB; a CPU tier's budget beside one)."),
    kv_offloading_size: float = KV_OFFLOADING_SIZE,
    kv_offloading_disk_size: float = KV_OFFLOADING_DISK_SIZE,
    kv_offloading_block_size: int = KV_OFFLOADING_BLOCK_SIZE,
    kv_offloading_policy: str = KV_OFFLOADING_POLICY,
    kv_offloading_store: str = KV_OFFLOADING_STORE,
    kv_offloading_disk_path: Path = typer.Option(None, rich_help_panel=POOL,
                                                 help="The disk tier's folder (default: a temporary one)."),
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
    enforce_eager: bool = typer.Option(False, "--enforce-eager", rich_help_panel=SCHEDULER,
                                       help="No CUDA graphs for decode steps (they are on by default on "
                                            "CUDA with the Triton backend)."),
    clock: Clock = typer.Option("wall", rich_help_panel=SCHEDULER,
                                help="wall, or cpu: a virtual clock of the process's CPU time that jumps "
                                     "over idle gaps (CPU engine; steadier on a shared machine, see "
                                     "docs/calibration.md)."),
    out: Path = typer.Option(None, "--out", "-o", rich_help_panel=OUTPUT,
                             help="Write a run folder here (new, empty, or a run with --overwrite)."),
    overwrite: bool = typer.Option(False, "--overwrite", rich_help_panel=OUTPUT,
                                   help="Replace the pagelab run already in --out."),
    table_format: TableFormat = typer.Option("parquet", "--table-format", rich_help_panel=OUTPUT,
                                             help="File format of the run folder's tables."),
    num_prompts: int = NUM_PROMPTS,
    max_concurrency: int = typer.Option(None, rich_help_panel=VLLM,
                                        help="Most requests in flight; a cap on --max-num-seqs (default: no "
                                             "cap)."),
    percentile_metrics: str = PERCENTILE_METRICS,
    metric_percentiles: str = METRIC_PERCENTILES,
    goodput: list[str] = GOODPUT,
    save_result: bool = SAVE_RESULT,
    result_dir: Path = RESULT_DIR,
    result_filename: str = RESULT_FILENAME,
) -> None:
    """Replay a trace on the real engine and measure time and memory (same run folder as simulate)."""
    from cli.runs import check_out, write_run
    from gpu_backend.engine.engine_config import EngineConfig
    from gpu_backend.replay import ReplayConfig
    from gpu_backend.replay_run import replay_configs, replay_metadata, replay_to_dir, run_labels

    names = allocators(allocator, ["paged"])
    if out is None and (overwrite or table_format != "parquet"):  # they shape the run folder alone
        raise UserError(f"{'--overwrite' if overwrite else '--table-format'} needs --out (a run folder)")
    finite_float(time_scale, "--time-scale", minimum=0)
    if not 0 < gpu_memory_utilization <= 1:
        raise UserError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization:g}")
    finite_float(kv_memory_gb, "--kv-memory-gb")
    finite_float(swap_space_gb, "--swap-space-gb")
    max_num_seqs = cap_concurrency(max_num_seqs, max_concurrency)
    how = reporting(percentile_metrics, metric_percentiles, goodput, save=save_result, result_dir=result_dir,
                    result_filename=result_filename)
    if out is not None:
        check_out(out, overwrite)
    df, info = load_workload(trace, trace_opt, limit, num_prompts, rate, burstiness, seed,
                             default_limit=DEFAULT_LIMIT)
    info["time_scale"] = time_scale
    source, limit = info["source"], info["limit"]
    engine = EngineConfig(block_size=block_size, num_blocks=num_blocks, kv_memory_gb=kv_memory_gb,
                          enable_prefix_caching=prefix_caching, max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          enable_chunked_prefill=chunked_prefill, preemption_mode=preemption,
                          swap_space_gb=swap_space_gb, enforce_eager=enforce_eager,
                          gpu_memory_utilization=gpu_memory_utilization,
                          disable_hybrid_kv_cache_manager=not hybrid_kv_cache,
                          **tier_fields(kv_offloading_size, kv_offloading_disk_size,
                                        kv_offloading_block_size=kv_offloading_block_size,
                                        kv_offloading_policy=kv_offloading_policy,
                                        kv_offloading_store=kv_offloading_store,
                                        kv_offloading_disk_path=None if kv_offloading_disk_path is None
                                        else str(kv_offloading_disk_path)))
    configs = replay_configs(names, ReplayConfig(model=model, device=device, backend=backend, dtype=dtype,
                                                 engine=engine, time_scale=time_scale, seed=seed, clock=clock,
                                                 extra=run_labels(source, limit, max_concurrency)))

    def show(results: dict) -> dict:
        capacities = {res.config["allocator"]: replay_capacity(res.config) for res in results.values()}
        for capacity in dict.fromkeys(capacities.values()):  # one header per distinct pool
            print_capacity(capacity)
        first = next(iter(capacities.values()))
        labels = {"model_id": model, "model": first.model, "gpu": None, "max_concurrency": max_concurrency,
                  "kv_cache": first.to_dict()}
        metrics = report("replay", results, info, how, labels)
        for name, res in results.items():
            m = res.summary["measured"]
            step = m["step_time_s"]
            clipped = m["num_clipped_prompts"]
            console.print(f"{name}: {res.summary['num_steps']} steps on {m['device']} ({m['backend']}), "
                          f"step time p50 {1e3 * (step['p50'] or 0):.1f} ms, "
                          f"KV pool {m['kv_pool_bytes'] / 2**20:.0f} MiB"
                          + (f", {clipped} prompts clipped to max_model_len" if clipped else ""))
        return {"serving_metrics": metrics, "kv_cache": first.to_dict()}

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

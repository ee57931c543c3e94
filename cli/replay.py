"""`pagelab replay`: run a trace's requests on the real engine and write a run folder like `simulate`."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cli import app
from cli.common import UserError, console, err_console, user_errors

ALL_ALLOCATORS = ["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"]
DEFAULT_LIMIT = 64


def replay_to_dir(df, configs: dict, info: dict, out: Path | None, table_format: str = "parquet",
                  progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Replay `df` once per allocator config, then write every result at once (all or nothing)."""
    from gpu_backend.replay import replay

    results = {}
    for name, cfg in configs.items():
        report = None if progress is None else (lambda done, total, n=name: progress(n, done, total))
        results[name] = replay(df, cfg, progress=report)
    if out is not None:
        from cli.runs import write_run
        write_run(out, info, results, table_format)
    return results


@app.command("replay")
@user_errors
def replay_cmd(
    trace: str = typer.Argument(None, help="Trace file or bundled name (default: azure-conv)."),
    model: str = typer.Option("tiny", help="Model preset (tiny, tiny-qwen2, llama-1b-shape) or a local "
                                           "Hugging Face directory."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    backend: str = typer.Option("auto", help="Attention backend: auto, torch or triton."),
    dtype: str = typer.Option(None, help="float32, float16 or bfloat16 (default: fp32 on CPU)."),
    allocator: list[str] = typer.Option(None, "--allocator", "-a",
                                        help="paged, contiguous-max, contiguous-pow2, contiguous-oracle "
                                             "(repeat; default: paged)."),
    limit: int = typer.Option(DEFAULT_LIMIT, help="Replay only the first N requests."),
    time_scale: float = typer.Option(1.0, "--time-scale", help="Multiply arrival times (0: all at once)."),
    block_size: int = typer.Option(16, help="Paged block size in tokens."),
    num_blocks: int = typer.Option(None, help="KV pool size in blocks (default: from --kv-memory-gb)."),
    kv_memory_gb: float = typer.Option(None, help="KV pool size in GiB (default: measured free memory on "
                                                  "a GPU, 0.25 GiB on a CPU)."),
    max_model_len: int = typer.Option(None, help="Longest sequence (default: the model's); longer prompts "
                                                 "are clipped."),
    max_num_seqs: int = typer.Option(256, help="Most sequences running at once."),
    max_num_batched_tokens: int = typer.Option(None, help="Token budget of one step."),
    preemption: str = typer.Option("recompute", help="recompute or swap."),
    swap_space_gb: float = typer.Option(None, help="CPU swap pool in GiB, allocated on first use (default: "
                                                   "4 GiB, at most the KV pool's size)."),
    prefix_caching: bool = typer.Option(True, help="Reuse cached prefix blocks (paged)."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager",
                                       help="No CUDA graphs for decode steps (they are on by default on "
                                            "CUDA with the Triton backend)."),
    seed: int = typer.Option(0, help="Seed of prompt tokens, weights of presets and sampling."),
    out: Path = typer.Option(None, "--out", "-o", help="Write a run folder here."),
    table_format: str = typer.Option("parquet", "--table-format", help="parquet or csv."),
) -> None:
    """Replay a trace on the real engine and measure time and memory (same run folder as simulate)."""
    from cli.simulate import _version, comparison_table
    from gpu_backend.engine.engine_config import EngineConfig
    from gpu_backend.replay import ReplayConfig
    from traces import load_trace
    from traces.stats import trace_info

    names = allocator or ["paged"]
    for name in names:
        if name not in ALL_ALLOCATORS:
            raise UserError(f"unknown allocator {name!r}; choose from {', '.join(ALL_ALLOCATORS)}")
    if table_format not in ("parquet", "csv"):
        raise UserError(f"--table-format must be parquet or csv, got {table_format!r}")
    if limit < 1:
        raise UserError(f"--limit must be >= 1, got {limit}")
    if time_scale < 0:
        raise UserError(f"--time-scale must be >= 0, got {time_scale}")
    warnings: list[str] = []
    df = load_trace(trace or "azure-conv", warnings=warnings)
    for w in warnings:
        err_console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
    df = df.iloc[:limit].reset_index(drop=True)
    source = trace or "azure-conv"
    info = {"source": source, **trace_info(df), "limit": limit, "time_scale": time_scale}
    configs = {}
    for name in names:
        engine = EngineConfig(block_size=block_size, num_blocks=num_blocks, kv_memory_gb=kv_memory_gb,
                              enable_prefix_caching=prefix_caching, allocator=name,
                              max_model_len=max_model_len,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              preemption_mode=preemption, swap_space_gb=swap_space_gb,
                              enforce_eager=enforce_eager)
        configs[name] = ReplayConfig(model=model, device=device, backend=backend, dtype=dtype, engine=engine,
                                     time_scale=time_scale, seed=seed,
                                     extra={"trace": source, "limit": limit, "pagelab_version": _version()})
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as bar:
        tasks = {n: bar.add_task(f"replaying {n}", total=len(df)) for n in names}
        update = lambda n, done, total: bar.update(tasks[n], completed=done)  # noqa: E731
        results = replay_to_dir(df, configs, info, out, table_format, update)
    console.print(comparison_table({n: r.summary for n, r in results.items()}))
    for name, res in results.items():
        m = res.summary["measured"]
        step = m["step_time_s"]
        clipped = m["num_clipped_prompts"]
        console.print(f"{name}: {res.summary['num_steps']} steps on {m['device']} ({m['backend']}), "
                      f"step time p50 {1e3 * (step['p50'] or 0):.1f} ms, "
                      f"KV pool {m['kv_pool_bytes'] / 2**20:.0f} MiB"
                      + (f", {clipped} prompts clipped to max_model_len" if clipped else ""))
    if out is not None:
        err_console.print(f"wrote {out}")

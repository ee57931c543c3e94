"""`pagelab bench ...`: benchmarks of the memory core, the simulator, the attention kernels and the engine."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import typer

from cli.bench_tables import emit, print_attention
from cli.common import UserError, console, err_console, names_list, pick_one, user_errors
from cli.runs import check_result_options
from cli.runs import save_result as write_result

bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                        help="Benchmarks: memory core, simulator, attention kernels, engine.")


def _int_list(values: list[str] | None, option: str) -> tuple[int, ...] | None:
    """Parse repeated and/or comma-separated integers: --batch 1,16 --batch 64."""
    if not values:
        return None
    try:
        parsed = tuple(int(x) for v in values for x in v.split(",") if x.strip())
    except ValueError:
        raise UserError(f"{option} expects whole numbers, e.g. {option} 1,16,64 (got {values!r})") from None
    if not parsed or min(parsed) <= 0:
        raise UserError(f"{option} values must be positive (got {values!r})")
    return parsed


def _head_pairs(values: list[str] | None) -> tuple[tuple[int, int], ...] | None:
    """Parse --heads HQ:HKV pairs (comma-separated or repeated)."""
    if not values:
        return None
    pairs = []
    for item in (x for v in values for x in v.split(",") if x.strip()):
        try:
            num_heads, num_kv_heads = (int(x) for x in item.split(":"))
        except ValueError:
            raise UserError(f"--heads expects HQ:HKV pairs, e.g. 32:8 (got {item!r})") from None
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise UserError(f"--heads {item}: query heads must be a positive multiple of kv heads")
        pairs.append((num_heads, num_kv_heads))
    return tuple(pairs)


@bench_app.command("attention")
@user_errors
def attention(
    device: str = typer.Option("auto", help="cpu, cuda, cuda:N, or auto (cuda when available)."),
    dtype: str = typer.Option(None, help="float32, float16 or bfloat16 (default: float32 on CPU, "
                                         "bfloat16 on CUDA)."),
    batch: list[str] = typer.Option(None, help="Batch sizes, comma-separated or repeated."),
    context: list[str] = typer.Option(None, help="Context lengths (tokens)."),
    heads: list[str] = typer.Option(None, help="HQ:HKV query/kv head pairs, e.g. 32:8."),
    head_dim: list[str] = typer.Option(None, "--head-dim", help="Head dimensions."),
    block_size: int = typer.Option(16, "--block-size", help="KV block size (tokens)."),
    min_time: float = typer.Option(None, "--min-time", help="Seconds of timing per implementation/shape."),
    seed: int = typer.Option(0, help="Seed of the random inputs."),
    threads: int = typer.Option(None, help="torch CPU threads (default: torch's choice)."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON instead of a table."),
    save_result: bool = typer.Option(False, "--save-result", help="Save the result as JSON (vLLM bench)."),
    result_dir: Path = typer.Option(None, "--result-dir", help="Folder of the result JSON (default: .)."),
    result_filename: str = typer.Option(None, "--result-filename", help="Name of the result JSON."),
) -> None:
    """Paged decode attention (Triton, torch) vs contiguous SDPA over batch x context x heads x head_dim."""
    check_result_options(result_dir, result_filename)  # before the benchmark runs
    import dataclasses

    import torch

    from bench.attention import default_config, run_attention_bench

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch_device = torch.device(device)
    except RuntimeError:
        raise UserError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:0...)") from None
    if block_size <= 0:
        raise UserError(f"--block-size must be positive (got {block_size})")
    # 0 is meaningful (each shape is timed the minimum 3 times); a negative or non-finite budget is not.
    if min_time is not None and not (0 <= min_time < float("inf")):
        raise UserError(f"--min-time must be a finite number of seconds >= 0, got {min_time:g}")
    if threads is not None:
        if threads <= 0:
            raise UserError(f"--threads must be positive (got {threads})")
        torch.set_num_threads(threads)
    overrides = {
        "dtype": dtype, "batches": _int_list(batch, "--batch"), "contexts": _int_list(context, "--context"),
        "heads": _head_pairs(heads), "head_dims": _int_list(head_dim, "--head-dim"), "block_size": block_size,
        "min_time_s": min_time, "seed": seed,
    }
    config = dataclasses.replace(default_config(str(torch_device)),
                                 **{k: v for k, v in overrides.items() if v is not None})
    result = run_attention_bench(config)
    write_result("bench attention", {"result": result.to_dict()}, save=save_result, result_dir=result_dir,
                result_filename=result_filename)
    if as_json:
        console.print_json(json.dumps(result.to_dict()))
        return
    print_attention(result, torch_device.type == "cuda")


@bench_app.command("core")
@user_errors
def core(
    num_seqs: int = typer.Option(256, help="Sequences decoding at once."),
    num_tokens: int = typer.Option(1_000_000, help="Tokens decoded in total."),
    block_size: int = typer.Option(16, help="Block size."),
    chunk: int = typer.Option(64, help="Tokens per bulk append_slot call."),
    repeat: int = typer.Option(5, help="Repetitions (the median is reported)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    save_result: bool = typer.Option(False, "--save-result", help="Save the result as JSON (vLLM bench)."),
    result_dir: Path = typer.Option(None, "--result-dir", help="Folder of the result JSON (default: .)."),
    result_filename: str = typer.Option(None, "--result-filename", help="Name of the result JSON."),
) -> None:
    """BlockManager decode workload: single-token append_slot vs bulk append_slot(seq, chunk)."""
    check_result_options(result_dir, result_filename)  # before the benchmark runs
    from bench.core import DecodeWorkload, bench_core

    for option, value in (("--num-seqs", num_seqs), ("--num-tokens", num_tokens),
                          ("--block-size", block_size), ("--chunk", chunk), ("--repeat", repeat)):
        if value < 1:
            raise UserError(f"{option} must be >= 1, got {value}")
    # Each sequence decodes num_tokens // num_seqs tokens: fewer tokens than sequences would time nothing.
    if num_tokens < num_seqs:
        raise UserError(f"--num-tokens {num_tokens:,} is fewer than --num-seqs {num_seqs:,}: each sequence "
                        "must decode at least one token")
    r = bench_core(DecodeWorkload(num_seqs, num_tokens, block_size, chunk=chunk), repeat=repeat)
    write_result("bench core", {"result": r}, save=save_result, result_dir=result_dir,
                result_filename=result_filename)
    emit([r], "memory core: decode-heavy workload", as_json)


@bench_app.command("simulate")
@user_errors
def simulate_bench(
    sizes: list[str] = typer.Option(None, "--num", help="Request counts (comma-separated or repeated); "
                                                        "default: the whole bundled trace."),
    trace: str = typer.Option("azure-conv", help="Trace path or bundled name; 'synthetic' for generated "
                                                "sharegpt-like traces of each size."),
    allocator: list[str] = typer.Option(None, "--allocator", "-a", help="Allocators (default: paged)."),
    events: str = typer.Option("both", help="on (tenures streamed to Parquet, as `simulate --out` does), "
                                            "off, or both."),
    rate: float = typer.Option(None, help="Arrival rate of --trace synthetic (requests/s; default 15)."),
    repeat: int = typer.Option(3, help="Runs per point (min and median reported)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    save_result: bool = typer.Option(False, "--save-result", help="Save the result as JSON (vLLM bench)."),
    result_dir: Path = typer.Option(None, "--result-dir", help="Folder of the result JSON (default: .)."),
    result_filename: str = typer.Option(None, "--result-filename", help="Name of the result JSON."),
) -> None:
    """Wall time and peak memory of `simulate` (each run in its own process): the scaling curve."""
    check_result_options(result_dir, result_filename)  # before the benchmark runs
    from bench.simulate import DEFAULT_RATE, bench_simulate, summarize_runs
    from cli.trace import MAX_GENERATED

    counts = list(_int_list(sizes, "--num") or [None])
    if trace == "synthetic" and counts == [None]:
        raise UserError("--trace synthetic needs --num")
    if trace == "synthetic" and max(counts) > MAX_GENERATED:
        raise UserError(f"--num {max(counts):,} is more requests than a synthetic trace is made of "
                        f"(at most {MAX_GENERATED:,})")
    if repeat < 1:
        raise UserError(f"--repeat must be >= 1, got {repeat}")
    # A bundled or file trace keeps its own arrival times: a --rate would be silently ignored.
    if rate is not None and trace != "synthetic":
        raise UserError(f"--rate applies to --trace synthetic only (the trace {trace!r} keeps its own "
                        "arrival times)")
    rate = DEFAULT_RATE if rate is None else rate
    if not (rate > 0 and math.isfinite(rate)):
        raise UserError(f"--rate must be a finite number > 0 requests/s, got {rate}")
    modes = {"on": (True,), "off": (False,), "both": (False, True)}
    if events not in modes:
        raise UserError(f"--events must be on, off or both, got {events!r}")
    records = bench_simulate(counts, names_list(allocator) or ["paged"],
                             trace=None if trace == "synthetic" else trace, events=modes[events],
                             repeat=repeat, rate=rate)
    rows = summarize_runs(records)
    write_result("bench simulate", {"result": rows, "runs": records}, save=save_result, result_dir=result_dir,
                result_filename=result_filename)
    emit(rows, "simulate: wall time and peak RSS", as_json)


def _host_rows(batch: list[str] | None, allocator: list[str] | None, steps: int | None,
               host_model: str | None, max_model_len: int | None) -> tuple[list[dict], str]:
    """`bench engine --host`: host work per steady decode step for each model, batch and allocator, and
    the table's title."""
    from bench.engine_host import HOST_MODELS, capacity_tokens, host_time_per_step, kv_bytes_per_token

    host_model = host_model or "both"
    if host_model != "both" and host_model not in HOST_MODELS:
        raise UserError(f"--host-model must be stub, tiny or both, got {host_model!r}")
    models = HOST_MODELS if host_model == "both" else (host_model,)
    steps = 50 if steps is None else steps
    if steps < 1:
        raise UserError(f"--steps must be >= 1, got {steps}")
    batches = _int_list(batch, "--batch") or (16, 64, 256)
    allocators = names_list(allocator) or ["paged", "contiguous-max"]
    length = 4096 if max_model_len is None else max_model_len
    # The engine holds a real KV cache on the CPU: refuse what this machine's memory cannot hold.
    need = max(capacity_tokens(max(batches), steps, a, length) for a in allocators) * kv_bytes_per_token()
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have // 2:
        raise UserError(f"--batch {max(batches):,} at --max-model-len {length:,} needs a "
                        f"{need / 2**30:.1f} GiB KV cache, more than half of this machine's "
                        f"{have / 2**30:.1f} GiB")
    torch_threads_one()
    rows = [host_time_per_step(n, steps=steps, allocator=a, model=m, max_model_len=length)
            for m in models for n in batches for a in allocators]
    return rows, (f"engine host work per steady decode step, p50 and p90 of {steps} steps (CPU; tiny: step "
                  "minus forward)")


def torch_threads_one() -> None:
    """Host work is single-threaded Python: one torch thread keeps its small ops off the thread pool."""
    import torch

    torch.set_num_threads(1)


@bench_app.command("engine")
@user_errors
def engine_bench(
    limit: int = typer.Option(None, "--limit", help="Requests from the trace (default 64)."),
    num_prompts: int = typer.Option(None, "--num-prompts", help="Same as --limit (vLLM's name)."),
    trace: str = typer.Option(None, help="Trace path or bundled name (default azure-conv)."),
    max_model_len: int = typer.Option(None, help="Clip prompts so prompt + output fit in this (default "
                                                 "1024); --host: the engine's max_model_len (default 4096)."),
    host: bool = typer.Option(False, "--host", help="Instead: host work per steady decode step (p50, p90)."),
    host_model: str = typer.Option(None, "--host-model", help="--host: stub (the step's wall time with a "
                                   "forward that returns at once), tiny (the real tiny preset's step minus "
                                   "its forward), or both (default)."),
    batch: list[str] = typer.Option(None, help="--host: running sequences per step (default 16,64,256)."),
    allocator: list[str] = typer.Option(None, help="--host: allocators (default paged, contiguous-max)."),
    steps: int = typer.Option(None, help="--host: timed decode steps per batch size (default 50)."),
    model: str = typer.Option(None, help="Model preset, both sides with the same weights (default tiny)."),
    device: str = typer.Option(None, help="cpu or cuda (default cpu)."),
    dtype: str = typer.Option(None, help="float32, float16 or bfloat16 (default: fp32 CPU, bf16 CUDA)."),
    backend: str = typer.Option(None, help="Attention backend of the engine: auto (default), torch, triton."),
    hf_batch_size: int = typer.Option(None, help="transformers: requests per static batch (default 16)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    save_result: bool = typer.Option(False, "--save-result", help="Save the result as JSON (vLLM bench)."),
    result_dir: Path = typer.Option(None, "--result-dir", help="Folder of the result JSON (default: .)."),
    result_filename: str = typer.Option(None, "--result-filename", help="Name of the result JSON."),
) -> None:
    """Output throughput: the paged engine vs transformers' padded batched generate (CPU tiny by default).

    With --host: the engine's own work per steady decode step (scheduling, packing, sampling,
    bookkeeping) by batch size: median (p50) and p90 over --steps steps, with a stub model whose
    forward returns at once and/or the real tiny model minus its forward.
    """
    check_result_options(result_dir, result_filename)  # before the benchmark runs
    # 0 would fall through to the model's own length in the benchmark, not mean "no room".
    if max_model_len is not None and max_model_len < 1:
        raise UserError(f"--max-model-len must be >= 1, got {max_model_len}")
    # An option the chosen measurement would not read is refused rather than ignored.
    host_only = {"--batch": batch, "--allocator": allocator, "--steps": steps, "--host-model": host_model}
    compare_only = {"--limit": limit, "--num-prompts": num_prompts, "--trace": trace, "--model": model,
                    "--device": device, "--dtype": dtype, "--backend": backend,
                    "--hf-batch-size": hf_batch_size}
    unused = [k for k, v in (compare_only if host else host_only).items() if v is not None]
    if unused:
        raise UserError(f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply "
                        f"{'with' if host else 'without'} --host")
    if host:
        rows, title = _host_rows(batch, allocator, steps, host_model, max_model_len)
        write_result("bench engine", {"result": rows}, save=save_result, result_dir=result_dir,
                     result_filename=result_filename)
        emit(rows, title, as_json)
        return
    from bench.engine import compare
    from gpu_backend.engine.model_setup import resolve_device

    device = str(resolve_device(device or "cpu"))
    limit = pick_one("--limit/--num-prompts", limit, num_prompts)
    limit = 64 if limit is None else limit
    if limit < 1:
        raise UserError(f"--limit/--num-prompts must be >= 1, got {limit}")
    hf_batch_size = 16 if hf_batch_size is None else hf_batch_size
    if hf_batch_size < 1:
        raise UserError(f"--hf-batch-size must be >= 1, got {hf_batch_size}")
    if dtype not in (None, "float32", "float16", "bfloat16"):
        raise UserError(f"--dtype must be float32, float16 or bfloat16, got {dtype!r}")
    max_model_len = 1024 if max_model_len is None else max_model_len
    model = model or "tiny"
    r = compare(model_name=model, trace=trace or "azure-conv", limit=limit, max_model_len=max_model_len,
                device=device, dtype=dtype, backend=backend or "auto", hf_batch_size=hf_batch_size,
                progress=lambda message: err_console.print(f"bench engine: {message}", markup=False))
    row = {"requests": limit, "output_tokens": r["workload"]["output_tokens"],
           "engine_tok_s": r["engine"]["tokens_per_s"],
           "transformers_tok_s": r["transformers"]["tokens_per_s"],
           "speedup": r["speedup"], "threads": r["threads"], "device": r["device"], "dtype": r["dtype"]}
    write_result("bench engine", {"result": r}, save=save_result, result_dir=result_dir,
                result_filename=result_filename)
    emit([row], f"engine vs transformers ({r['device']}, {r['dtype']}, {model})", as_json)


@bench_app.command("calibration")
@user_errors
def calibration_bench(
    profile: str = typer.Option("cpu-tiny", help="Latency profile: a bundled name or a JSON file."),
    out: Path = typer.Option(Path("runs/validate"), "--out", "-o", help="Folder of every run."),
    parts: str = typer.Option("A,B,A-x2,C", help="Held-out runs, comma-separated (A, B, A-x2, C; code: "
                                                 "another trace, Azure code's first 40 requests)."),
    repeat: str = typer.Option("", help="Parts replayed a second time, e.g. B,A,C (the noise floor)."),
    reuse: bool = typer.Option(False, "--reuse", help="Keep replays already in --out (another profile, "
                                                     "same measurements)."),
    replay_only: bool = typer.Option(False, "--replay-only", help="Replay and stop (validate elsewhere "
                                                                  "with --reuse)."),
    device: str = typer.Option("cpu", help="cpu (tiny, torch, CPU-time clock) or cuda (llama-1b-shape, "
                                           "Triton, wall clock)."),
    model: str = typer.Option(None, help="Engine model preset (default: the device's)."),
    backend: str = typer.Option(None, help="torch or triton (default: the device's)."),
    kv_memory_gb: float = typer.Option(None, help="KV pool in GiB (default: 0.25 on cpu, 8 on cuda)."),
) -> None:
    """Held-out validation of a latency profile: replay, simulate and compare Azure parts (minutes)."""
    from bench.calibration import replay_only as replay_and_floor
    from bench.calibration import run_names, split_names, validate
    from bench.replay_setup import ReplaySetup
    from cli.runs import check_out_folder, is_run_folder
    from simulator.timing.step_latency import load_fitted

    try:
        runs = run_names(split_names(parts), split_names(repeat))
        setup = ReplaySetup.for_device(device, model, backend, kv_memory_gb)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if not runs:
        raise UserError(f"--parts {parts!r}: give at least one held-out run (A, B, A-x2, C or code)")
    check_out_folder(out, f"--out {out}")
    if is_run_folder(out):
        raise UserError(f"--out {out} holds a pagelab run: choose a folder for the validation's runs")
    if not replay_only:
        load_fitted(profile)  # a profile that cannot be read is refused before minutes of replays
    if replay_only:
        console.print(replay_and_floor(setup, out, runs, reuse))
    else:
        validate(profile, out, runs, reuse, setup)

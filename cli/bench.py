"""`pagelab bench ...`: benchmarks of the memory core, the simulator, the attention kernels and the engine."""
from __future__ import annotations

import json
from pathlib import Path

import typer
from rich import box
from rich.table import Table

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
    _print_table(result, torch_device.type == "cuda")


_SHORT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _print_table(result, on_gpu: bool) -> None:
    """The machine line, the table of records and what the columns mean."""
    machine = result.machine
    dtypes = sorted({_SHORT_DTYPES.get(r.dtype, r.dtype) for r in result.records})
    console.print(f"decode attention, {'/'.join(dtypes)}, on {machine['name']} ({machine['device']}, torch "
                  f"{machine['torch']}, {machine['threads']} threads); measured copy bandwidth "
                  f"{machine['copy_gb_per_s']} GB/s")
    console.print(attention_table(result.records))
    console.print("GB/s: K+V read + q + out per call / median time; %copy: of the measured copy bandwidth; "
                  "xSDPA: time / contiguous SDPA; err: ||out - SDPA|| / ||SDPA||.")
    if not on_gpu:
        console.print("No CUDA device: Triton rows are skipped (the interpreter only checks correctness).")


def _short(value: float) -> str:
    """Four significant digits, or a whole number with separators from 1,000 up (no exponent)."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def attention_table(records) -> Table:
    """One row per implementation and shape; numbers to four significant digits, so it fits 80 columns."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for name in ("impl", "B", "ctx", "Hq:Hkv*D", "ms", "GB/s", "%copy", "xSDPA", "err"):
        table.add_column(name, justify="left" if name == "impl" else "right", no_wrap=True)
    for r in records:
        table.add_row(
            r.impl.removeprefix("paged-"), str(r.batch), str(r.context),
            f"{r.num_heads}:{r.num_kv_heads}*{r.head_dim}", _short(r.time_ms), _short(r.gb_per_s),
            f"{100 * r.copy_bw_fraction:.0f}" if r.copy_bw_fraction is not None else "-",
            f"{r.vs_sdpa:.3g}" if r.vs_sdpa is not None else "-",
            f"{r.rel_err_vs_sdpa:.1e}" if r.rel_err_vs_sdpa is not None else "-",
        )
    return table


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _fits(table: Table) -> bool:
    """Whether the table's natural width fits the console (so no cell is cut or folded)."""
    from rich.measure import Measurement

    unlimited = console.options.update_width(10**6)  # measured at the console's width, it would always fit
    return Measurement.get(console, unlimited, table).maximum <= console.width


def _emit(rows: list[dict], title: str, as_json: bool) -> None:
    """Print benchmark rows as a table (fields as columns), or, when that is wider than the console,
    as tables with the fields as rows and as many results side by side as fit; as JSON for machines."""
    if as_json:
        console.print_json(json.dumps(rows))
        return
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for key in rows[0]:
        table.add_column(key.replace("_", " "), justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*(_cell(v) for v in row.values()))
    if _fits(table):
        console.print(table)
        return
    per_table = len(rows)
    while per_table > 1:
        if _fits(_fields_as_rows(rows[:per_table], title, 0)):
            break
        per_table -= 1
    for start in range(0, len(rows), per_table):
        console.print(_fields_as_rows(rows[start:start + per_table], title, start))


def _fields_as_rows(rows: list[dict], title: str, first: int) -> Table:
    """One row per field, one column per result (numbered from `first` + 1)."""
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("result", no_wrap=True)
    for i in range(len(rows)):
        table.add_column(f"#{first + i + 1}", justify="right", no_wrap=True)
    for key in rows[0]:
        table.add_row(key.replace("_", " "), *(_cell(row.get(key)) for row in rows))
    return table


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
    r = bench_core(DecodeWorkload(num_seqs, num_tokens, block_size, chunk=chunk), repeat=repeat)
    write_result("bench core", {"result": r}, save=save_result, result_dir=result_dir,
                result_filename=result_filename)
    _emit([r], "memory core: decode-heavy workload", as_json)


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
    rate: float = typer.Option(15.0, help="Arrival rate of --trace synthetic (requests/s)."),
    repeat: int = typer.Option(3, help="Runs per point (min and median reported)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    save_result: bool = typer.Option(False, "--save-result", help="Save the result as JSON (vLLM bench)."),
    result_dir: Path = typer.Option(None, "--result-dir", help="Folder of the result JSON (default: .)."),
    result_filename: str = typer.Option(None, "--result-filename", help="Name of the result JSON."),
) -> None:
    """Wall time and peak memory of `simulate` (each run in its own process): the scaling curve."""
    check_result_options(result_dir, result_filename)  # before the benchmark runs
    from bench.simulate import bench_simulate, summarize_runs
    from cli.trace import MAX_GENERATED

    counts = list(_int_list(sizes, "--num") or [None])
    if trace == "synthetic" and counts == [None]:
        raise UserError("--trace synthetic needs --num")
    if trace == "synthetic" and max(counts) > MAX_GENERATED:
        raise UserError(f"--num {max(counts):,} is more requests than a synthetic trace is made of "
                        f"(at most {MAX_GENERATED:,})")
    modes = {"on": (True,), "off": (False,), "both": (False, True)}
    if events not in modes:
        raise UserError(f"--events must be on, off or both, got {events!r}")
    records = bench_simulate(counts, names_list(allocator) or ["paged"],
                             trace=None if trace == "synthetic" else trace, events=modes[events],
                             repeat=repeat, rate=rate)
    rows = summarize_runs(records)
    write_result("bench simulate", {"result": rows, "runs": records}, save=save_result, result_dir=result_dir,
                result_filename=result_filename)
    _emit(rows, "simulate: wall time and peak RSS", as_json)


def torch_threads_one() -> None:
    """Host work is single-threaded Python: one torch thread keeps its small ops off the thread pool."""
    import torch

    torch.set_num_threads(1)


@bench_app.command("engine")
@user_errors
def engine_bench(
    limit: int = typer.Option(None, "--limit", help="Requests from the trace (default 64)."),
    num_prompts: int = typer.Option(None, "--num-prompts", help="Same as --limit (vLLM's name)."),
    trace: str = typer.Option("azure-conv", help="Trace path or bundled name."),
    max_model_len: int = typer.Option(None, help="Clip prompts so prompt + output fit in this (default "
                                                 "1024); --host: the engine's max_model_len (default 4096)."),
    host: bool = typer.Option(False, "--host", help="Instead: host work per steady decode step (p50, p90)."),
    host_model: str = typer.Option("both", "--host-model", help="--host: stub (the step's wall time with a "
                                   "forward that returns at once), tiny (the real tiny preset's step minus "
                                   "its forward), or both."),
    batch: list[str] = typer.Option(["16,64,256"], help="--host: running sequences per step."),
    allocator: list[str] = typer.Option(["paged", "contiguous-max"], help="--host: allocators."),
    steps: int = typer.Option(50, help="--host: timed decode steps per batch size."),
    model: str = typer.Option("tiny", help="Model preset (both sides get the same weights)."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    dtype: str = typer.Option(None, help="float32, float16 or bfloat16 (default: fp32 CPU, bf16 CUDA)."),
    backend: str = typer.Option("auto", help="Attention backend of the engine (auto, torch, triton)."),
    hf_batch_size: int = typer.Option(16, help="transformers: requests per static batch."),
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
    if host:
        from bench.engine_host import HOST_MODELS, host_time_per_step

        models = HOST_MODELS if host_model == "both" else (host_model,)
        if host_model != "both" and host_model not in HOST_MODELS:
            raise UserError(f"--host-model must be stub, tiny or both, got {host_model!r}")
        if steps < 1:
            raise UserError(f"--steps must be >= 1, got {steps}")
        length = 4096 if max_model_len is None else max_model_len
        torch_threads_one()
        rows = [host_time_per_step(n, steps=steps, allocator=a, model=m, max_model_len=length)
                for m in models for n in _int_list(batch, "--batch") for a in allocator]
        _emit(rows, f"engine host work per steady decode step, p50 and p90 of {steps} steps (CPU; tiny: "
                    "step minus forward)", as_json)
        return
    from bench.engine import compare
    from gpu_backend.engine.model_setup import resolve_device

    device = str(resolve_device(device))
    limit = pick_one("--limit/--num-prompts", limit, num_prompts)
    limit = 64 if limit is None else limit
    if limit < 1:
        raise UserError(f"--limit/--num-prompts must be >= 1, got {limit}")
    if hf_batch_size < 1:
        raise UserError(f"--hf-batch-size must be >= 1, got {hf_batch_size}")
    if dtype not in (None, "float32", "float16", "bfloat16"):
        raise UserError(f"--dtype must be float32, float16 or bfloat16, got {dtype!r}")
    max_model_len = 1024 if max_model_len is None else max_model_len
    r = compare(model_name=model, trace=trace, limit=limit, max_model_len=max_model_len, device=device,
                dtype=dtype, backend=backend, hf_batch_size=hf_batch_size,
                progress=lambda message: err_console.print(f"bench engine: {message}", markup=False))
    row = {"requests": limit, "output_tokens": r["workload"]["output_tokens"],
           "engine_tok_s": r["engine"]["tokens_per_s"],
           "transformers_tok_s": r["transformers"]["tokens_per_s"],
           "speedup": r["speedup"], "threads": r["threads"], "device": r["device"], "dtype": r["dtype"]}
    write_result("bench engine", {"result": r}, save=save_result, result_dir=result_dir,
                result_filename=result_filename)
    _emit([row], f"engine vs transformers ({r['device']}, {r['dtype']}, {model})", as_json)


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

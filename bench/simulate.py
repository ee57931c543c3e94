"""Simulator speed benchmark (`pagelab bench simulate`): wall time and peak memory per size and allocator.

Each measurement runs `simulate` as `pagelab simulate --out` does: a canonical Parquet trace read in blocks
of rows, and the memory rows, request rows and (with events on) tenures streamed to Parquet files in a
temporary folder. Synthetic traces of each size are generated and written to Parquet first, outside the
measurement. By default each run gets a fresh process (multiprocessing "spawn"), so that its peak resident
memory is its own. The library returns records; the CLI prints them (e.g. as a scaling curve).
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from pagelab.malloc import peak_rss_mib
from simulator.config import ALLOCATORS, SimConfig
from simulator.core.errors import ConfigError

DEFAULT_RATE = 15.0  # req/s: with "sharegpt" lengths, about the Azure conversation trace's tokens per second


def _load(trace: str, num_requests: int | None):
    """The trace as the CLI reads it: a canonical Parquet file in blocks of rows (its first
    `num_requests`), anything else (CSV, a bundled name, a file with prefix keys) whole, then cut."""
    from traces import load_trace
    from traces.batches import open_parquet_batches

    path = Path(trace)
    is_parquet = path.suffix == ".parquet" and path.is_file()
    chunks = open_parquet_batches(path, num_requests) if is_parquet else None
    work = chunks if chunks is not None else load_trace(trace)
    have = chunks.num_rows if chunks is not None else len(work)
    if num_requests is not None and have < num_requests:
        raise ConfigError(f"{trace} has {have} requests, fewer than the {num_requests} asked for")
    if chunks is None and num_requests is not None:
        work = work.iloc[:num_requests].reset_index(drop=True)
    return work, min(have, num_requests or have)


def write_synthetic(path: Path, num_requests: int, rate: float, lengths: str, seed: int) -> Path:
    """Generate a synthetic trace (Poisson arrivals at `rate`, `lengths`) and save it as Parquet."""
    from traces import SyntheticConfig, generate_trace, save_trace

    cfg = SyntheticConfig(num_requests=num_requests, rate=rate, lengths=lengths, seed=seed)
    return save_trace(generate_trace(cfg), path)


def measure_once(trace: str, num_requests: int | None, config: SimConfig, label: str | None = None) -> dict:
    """Read the trace and simulate it once in this process, as `simulate --out` does; report wall time
    (reading the trace and writing the tables included) and memory.

    The memory and request rows, and with events on the tenures, stream into Parquet files in a temporary
    folder (a long run pairs and writes its tenures in a child process, which writes the other two tables
    too: `peak_rss_mb` adds its peak);
    `events_mb` is the events table's size.
    """
    from pagelab.parquet_parts import table_bytes
    from simulator.loop import simulate
    from simulator.output import RunFolder

    work, n = _load(trace, num_requests)
    before = peak_rss_mib()
    with tempfile.TemporaryDirectory(prefix="pagelab-bench-") as tmp:
        folder = Path(tmp)
        output = RunFolder(folder, "parquet", num_requests=n, record_events=config.record_events)
        t0 = time.perf_counter()
        result = simulate(work, config, output)
        wall = time.perf_counter() - t0
        events_mb = table_bytes(folder / "events.parquet") / (1 << 20)  # 0 when events are off (no file)
    s = result.summary
    return {
        "trace": label or trace,
        "num_requests": n,
        "allocator": config.allocator,
        "record_events": config.record_events,
        "mode": config.mode,
        "wall_s": wall,
        "us_per_request": 1e6 * wall / n,
        "rss_before_mb": before,
        # Both processes' own peaks, as if at once (not RUSAGE_CHILDREN: an exec'd child's count starts
        # at this process's peak when it was started; pagelab/malloc.py `peak_rss_mib`).
        "peak_rss_mb": peak_rss_mib() + (output.child_peak_rss_mib or 0.0),
        "num_steps": s["num_steps"],
        "num_memory_rows": output.num_memory_rows,
        "num_events": result.num_events,
        "events_mb": events_mb,
        "sim_duration_s": s["sim_duration_s"],
        "mean_batch_size": s["mean_batch_size"],
        "num_preemptions": s["num_preemptions"],
    }


def _child(conn, args: tuple, kwargs: dict) -> None:
    try:
        conn.send(("ok", measure_once(*args, **kwargs)))
    except Exception as exc:  # noqa: BLE001 - handed to the parent, which re-raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def _isolated(args: tuple, kwargs: dict) -> dict:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, args, kwargs))
    proc.start()
    child.close()
    try:
        status, payload = parent.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"benchmark process died (exit code {proc.exitcode}; out of memory?)") from None
    proc.join()
    if status != "ok":
        raise RuntimeError(f"benchmark process failed: {payload}")
    return payload


def bench_simulate(num_requests_list: Sequence[int | None], allocators: Sequence[str] = ("paged",), *,
                   trace: str | None = None, events: Sequence[bool] = (False,), repeat: int = 1,
                   rate: float = DEFAULT_RATE, lengths: str = "sharegpt", seed: int = 0,
                   config: SimConfig | None = None, isolate: bool = True) -> list[dict]:
    """Time `simulate` for every (size, allocator, events) combination, `repeat` times each.

    `trace` None: synthetic traces of each size (`lengths`, Poisson arrivals at `rate`, written to a
    temporary Parquet file first); else a trace path or bundled name, cut to each size (None: all of it).
    `config` supplies everything but the allocator and `record_events`. With `isolate`, each run gets its
    own process, so `peak_rss_mb` is that run's peak (interpreter and libraries included; `rss_before_mb`
    is the level before simulating). Returns one record per run with `wall_s`, `us_per_request`,
    `peak_rss_mb` and run statistics.
    """
    for name in allocators:
        if name not in ALLOCATORS:
            raise ConfigError(f"unknown allocator {name!r}; choose from {', '.join(ALLOCATORS)}")
    if repeat < 1:
        raise ConfigError(f"repeat must be >= 1, got {repeat}")
    if trace is None and None in num_requests_list:
        raise ConfigError("a synthetic benchmark trace needs a number of requests")
    if trace is not None and isolate:
        # Read here first: a missing, malformed or too short trace is the caller's mistake, reported as
        # such, not as the failure of a benchmark process.
        sizes = [n for n in num_requests_list if n is not None]
        _load(trace, max(sizes) if sizes else None)
    base = config or SimConfig()
    records = []
    with tempfile.TemporaryDirectory(prefix="pagelab-bench-traces-") as traces_dir:
        for n in num_requests_list:
            path, label = trace, None
            if trace is None:
                path = str(write_synthetic(Path(traces_dir) / f"syn-{n}.parquet", n, rate, lengths, seed))
                label = f"synthetic({lengths}, {rate:g} req/s)"
            for name in allocators:
                for ev in events:
                    cfg = dataclasses.replace(base, allocator=name, record_events=ev)
                    for i in range(repeat):
                        args = (path, n, cfg, label)
                        record = _isolated(args, {}) if isolate else measure_once(*args)
                        record.update(repeat=i, isolated=isolate)
                        records.append(record)
            if trace is None:
                Path(path).unlink()  # a 10M-request trace is ~150 MB
    return records


def summarize_runs(records: list[dict]) -> list[dict]:
    """One row per (trace, size, allocator, events): min and median wall time, max peak memory."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["trace"], r["num_requests"], r["allocator"], r["record_events"]), []).append(r)
    rows = []
    for (trace, n, alloc, ev), rs in groups.items():
        walls = sorted(r["wall_s"] for r in rs)
        mid = len(walls) // 2
        median = walls[mid] if len(walls) % 2 else (walls[mid - 1] + walls[mid]) / 2
        rows.append({"trace": trace, "num_requests": n, "allocator": alloc, "record_events": ev,
                     "runs": len(rs), "min_wall_s": walls[0], "median_wall_s": median,
                     "us_per_request": 1e6 * walls[0] / n, "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                     "num_events": rs[0]["num_events"], "events_mb": rs[0].get("events_mb", 0.0)})
    return rows

"""What simulate and replay share: picking the workload, checking options, reporting and saving results."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cli.common import (
    LogProgress,
    UserError,
    check_seed,
    console,
    err_console,
    names_list,
    pick_one,
    printing_warnings,
    warn_long_context,
)
from cli.help import VLLM
from cli.report import (
    memory_table,
    parse_metrics,
    parse_percentiles,
    serving_table,
    warn_about,
)
from simulator.slo import parse_goodput

if TYPE_CHECKING:
    from traces.batches import TraceBatches

GOODPUT_HELP = ("Per-request latency limits as in vLLM: ttft:200 tpot:50 (ms when no unit is given; also "
                "ttft:0.2s, e2el:2s). Metrics: ttft, tpot, e2el.")

# The vLLM-compatibility options simulate and replay share, declared once (typer reads them, never writes).
NUM_PROMPTS = typer.Option(None, "--num-prompts", rich_help_panel=VLLM, help="Same as --limit.")
PERCENTILE_METRICS = typer.Option(None, "--percentile-metrics", rich_help_panel=VLLM,
                                  help="Metrics with percentiles: ttft,tpot,itl,e2el (default "
                                       "ttft,tpot,itl).")
METRIC_PERCENTILES = typer.Option(None, "--metric-percentiles", rich_help_panel=VLLM,
                                  help="Percentiles to report, e.g. 50,90,99 (default 99).")
GOODPUT = typer.Option(None, "--goodput", rich_help_panel=VLLM, help=GOODPUT_HELP)
SAVE_RESULT = typer.Option(False, "--save-result", rich_help_panel=VLLM,
                           help="Save the results as JSON, one vLLM-shaped file per allocator.")
RESULT_DIR = typer.Option(None, "--result-dir", rich_help_panel=VLLM,
                          help="Folder of the result JSON (default: .).")
RESULT_FILENAME = typer.Option(None, "--result-filename", rich_help_panel=VLLM,
                               help="Name of the result JSON (with several allocators: "
                                    "NAME-ALLOCATOR.json).")


def allocators(values: list[str] | None, default: list[str]) -> list[str]:
    """-a values (repeated or comma-separated), checked against the registry."""
    from simulator.core.config import ALLOCATORS as known

    names = names_list(values) or default
    for name in names:
        if name not in known:
            raise UserError(f"unknown allocator {name!r}; choose from {', '.join(known)}")
    return list(dict.fromkeys(names))


def load_workload(trace_arg: str | None, trace_opt: str | None, limit: int | None, num_prompts: int | None,
                  rate: float | None, burstiness: float | None, seed: int,
                  default_limit: int | None = None, stream: bool = False
                  ) -> tuple[pd.DataFrame | TraceBatches, dict]:
    """The trace (positional or --trace), cut to --limit/--num-prompts and re-timed by --request-rate.

    With `stream`, a canonical Parquet trace kept as is (no --request-rate) comes back as TraceBatches,
    read a batch of rows at a time by the simulator instead of loaded whole (traces/batches.py).
    """
    from traces import load_trace, respace_arrivals
    from traces.stats import trace_info

    check_seed(seed)
    source = pick_one("the trace (positional or --trace)", trace_arg, trace_opt) or "azure-conv"
    limit = pick_one("--limit/--num-prompts", limit, num_prompts)
    limit = default_limit if limit is None else limit
    if limit is not None and limit < 1:
        raise UserError(f"--limit/--num-prompts must be >= 1, got {limit}")
    if rate is not None and (math.isnan(rate) or rate <= 0):
        raise UserError(f"--request-rate/--rate must be > 0 requests/s, or inf (all at t=0); got {rate}")
    if burstiness is not None:
        if not (math.isfinite(burstiness) and burstiness > 0):
            raise UserError(f"--burstiness must be a finite number > 0, got {burstiness}")
        if rate is None or math.isinf(rate):
            raise UserError("--burstiness shapes the gaps between arrivals: it needs a finite --request-rate")
    if stream and rate is None:
        chunks = _parquet_chunks(source, limit)
        if chunks is not None:
            return chunks, {"source": source, **trace_info(chunks), "rate_override": None,
                            "burstiness": burstiness, "limit": limit}
    with printing_warnings() as warnings:
        df = load_trace(source, warnings=warnings)
        if limit is not None:
            df = df.iloc[:limit].reset_index(drop=True)
        if rate is not None:
            df = respace_arrivals(df, rate, burstiness, seed, warnings)
    # JSON has no infinity: an infinite rate is recorded as the string "inf".
    info = {"source": source, **trace_info(df), "rate_override": "inf" if rate == math.inf else rate,
            "burstiness": burstiness, "limit": limit}
    return df, info


def _parquet_chunks(source: str, limit: int | None):
    """The trace as TraceBatches if it is a canonical Parquet file, else None (it is loaded whole)."""
    from traces.batches import open_parquet_batches
    from traces.loaders import resolve_trace

    path, _ = resolve_trace(source)
    return open_parquet_batches(path, limit) if path.suffix == ".parquet" else None


def cap_concurrency(max_num_seqs: int, max_concurrency: int | None) -> int:
    """--max-concurrency as the server sees it here: a cap on the running requests (docs/run-format.md)."""
    if max_concurrency is None:
        return max_num_seqs
    if max_concurrency < 1:
        raise UserError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    return min(max_num_seqs, max_concurrency)


def check_metric_options(percentile_metrics: str | None, metric_percentiles: str | None,
                         goodput: list[str] | None) -> tuple[tuple, tuple, tuple]:
    """Parse --percentile-metrics, --metric-percentiles and --goodput before any work."""
    return parse_metrics(percentile_metrics), parse_percentiles(metric_percentiles), parse_goodput(goodput)


class Bars:
    """A live bar per task on a terminal; log lines (per 10% or per minute) when stderr is redirected."""

    def __init__(self, verb: str):
        self.verb = verb
        self.rich = err_console.is_terminal
        self.progress = (Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=err_console, transient=True)
                         if self.rich else None)
        self.tasks: dict[str, object] = {}

    def __enter__(self):
        if self.progress:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self.progress:
            self.progress.__exit__(*exc)

    def add(self, name: str, total: int) -> None:
        """A new bar (or log line series) for `name`."""
        self.tasks[name] = (self.progress.add_task(f"{self.verb} {name}", total=total) if self.progress
                            else LogProgress(f"{self.verb} {name}", total))

    def update(self, name: str, done: int, total: int | None = None) -> None:
        """Report `done` of `name`'s requests."""
        task = self.tasks[name]
        if self.progress:
            self.progress.update(task, completed=done)
        else:
            task.update(done)


@dataclass(frozen=True)
class Reporting:
    """How simulate and replay report a run: the latency statistics, goodput limits, and where results go."""

    kinds: tuple[str, ...]  # --percentile-metrics
    percentiles: tuple[float, ...]  # --metric-percentiles
    slos: tuple = ()  # --goodput limits
    save: bool = False  # --save-result (also implied by --result-dir / --result-filename)
    result_dir: Path | None = None
    result_filename: str | None = None
    as_json: bool = False  # --json: the results on stdout instead of the tables

    @property
    def saving(self) -> bool:
        """Whether result files are written."""
        return self.save or self.result_dir is not None or self.result_filename is not None


def reporting(percentile_metrics: str | None, metric_percentiles: str | None, goodput: list[str] | None, *,
              save: bool = False, result_dir: Path | None = None, result_filename: str | None = None,
              as_json: bool = False) -> Reporting:
    """Parse --percentile-metrics, --metric-percentiles and --goodput before any work."""
    from cli.runs import check_result_options

    kinds, percentiles, slos = check_metric_options(percentile_metrics, metric_percentiles, goodput)
    check_result_options(result_dir, result_filename)
    return Reporting(kinds, percentiles, slos, save, result_dir, result_filename, as_json)


def print_capacity(capacity, model_id: str | None = None, *, stderr: bool = False) -> None:
    """The KV pool at the top of a run, in vLLM's start-up words (on stderr when stdout carries --json)."""
    lines = capacity.lines()
    if model_id and model_id != capacity.model:
        lines.insert(0, f"{model_id}: the registry's {capacity.model}")
    for line in lines:
        (err_console if stderr else console).print(line, markup=False, soft_wrap=True)
    warn_long_context(capacity.model, capacity.max_model_len)


def report(command: str, results: dict, info: dict, how: Reporting, labels: dict | None = None) -> dict:
    """Print the memory and serving tables and the warnings; save or print the vLLM-shaped results.

    `labels` (model_id, model, gpu, max_concurrency, kv_cache) go into the result JSON. Returns the serving
    metrics of every allocator (all four latency metrics, for summary.json).
    """
    from bench.run_tools import serving_metrics
    from cli.results import now_stamp, print_json_lines, result_paths, save_results, vllm_result
    from simulator.metrics import METRICS

    metrics = serving_metrics(results, METRICS, how.percentiles, how.slos)
    summaries = {n: r.summary for n, r in results.items()}
    if not how.as_json:
        console.print(memory_table(summaries))
        console.print(serving_table(metrics, how.kinds, how.percentiles, summaries))
        if how.slos:  # the limits as read: a bare vLLM number is ms
            console.print(f"Goodput limits: {', '.join(x.describe() for x in how.slos)}")
    warn_about(results, (labels or {}).get("kv_cache", {}).get("sized_by"))
    if how.saving or how.as_json:
        date = now_stamp()
        flat = {n: vllm_result(command, n, metrics[n], summaries[n], info, labels or {}, how.percentiles,
                               date) for n in results}
        if how.saving:
            paths = result_paths(command, list(results), how.result_dir, how.result_filename, date)
            save_results(flat, paths)
        if how.as_json:
            print_json_lines(flat)
    return metrics

"""pagelab viz: figures from run folders (docs/run-format.md); imports only numpy, pandas, matplotlib.

`plot_runs` draws every figure that applies to the given run folders; each figure module also exposes
a `plot_*` function returning a FigureResult (the Figure plus the data it drew).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from viz.blockmap import plot_block_map
from viz.breakdown import plot_breakdown
from viz.common import FORMATS, FigureResult, safe_stem, save_figure
from viz.errors import VizError
from viz.latency_cdf import plot_latency_cdf
from viz.load import Run, load_runs
from viz.snapshot import plot_block_snapshot
from viz.sweep import applies, plot_block_size_sweep, plot_sweep_latency
from viz.timeline import plot_batch_size, plot_memory_over_time
from viz.trace_overview import save_trace_overview

__all__ = ["FIGURES", "VizError", "figure_results", "plot_runs", "save_trace_overview"]


def _per_run(plot: Callable[..., FigureResult], name: str, *option_names: str
             ) -> Callable[..., Iterator[FigureResult]]:
    """Draw a one-run figure for each run; with several runs the file name gets the run label."""
    def draw(runs: list[Run], **options) -> Iterator[FigureResult]:
        passed = {k: v for k, v in options.items() if k in option_names}
        for run in runs:
            stem = name if len(runs) == 1 else f"{name}-{safe_stem(run.label)}"
            yield plot(run, name=stem, **passed)
    return draw


def _all_runs(plot: Callable[[list[Run]], FigureResult]) -> Callable[..., Iterator[FigureResult]]:
    """Draw one figure from all runs together."""
    def draw(runs: list[Run], **_options) -> Iterator[FigureResult]:
        yield plot(runs)
    return draw


def _has_events(runs: list[Run]) -> bool:
    """Whether any allocator recorded pool tenures (simulate --no-events writes none)."""
    return any(alloc.num_events for run in runs for alloc in run.allocators.values())


NO_EVENTS = "needs tenures in events.parquet (runs simulated with --no-events have none)"

# name -> (draw, applicability check, why it may not apply)
FIGURES: dict[str, tuple[Callable[..., Iterator[FigureResult]], Callable[[list[Run]], bool], str]] = {
    "breakdown": (_all_runs(plot_breakdown), lambda runs: True, ""),
    "memory_over_time": (_per_run(plot_memory_over_time, "memory_over_time"), lambda runs: True, ""),
    "block_map": (_per_run(plot_block_map, "block_map"), _has_events, NO_EVENTS),
    "block_snapshot": (_per_run(plot_block_snapshot, "block_snapshot", "at"), _has_events, NO_EVENTS),
    "latency_cdf": (_all_runs(plot_latency_cdf), lambda runs: True, ""),
    "batch_size": (_all_runs(plot_batch_size), lambda runs: True, ""),
    "sweep_latency": (_all_runs(plot_sweep_latency), lambda runs: applies(runs, "rate"),
                      "needs two or more run folders with different request rates"),
    "block_size_sweep": (_all_runs(plot_block_size_sweep), lambda runs: applies(runs, "block_size"),
                         "needs two or more run folders with different block sizes"),
}


def figure_results(runs: list[Run], only: list[str] | None = None, at: float | None = None
                   ) -> Iterator[FigureResult]:
    """Draw the selected figures that apply, one at a time (a requested one that cannot apply is an error)."""
    unknown = [n for n in only or [] if n not in FIGURES]
    if unknown:
        raise VizError(f"unknown figure '{unknown[0]}'; choose from {', '.join(FIGURES)}")
    for name, (draw, check, why) in FIGURES.items():
        if only and name not in only:
            continue
        if not check(runs):
            if only:
                raise VizError(f"figure '{name}' {why}")
            continue
        yield from draw(runs, at=at)


def plot_runs(run_dirs: list[Path], out: Path, fmt: str = "png", only: list[str] | None = None,
              at: float | None = None) -> list[Path]:
    """Draw every figure that applies to the run folders into `out`; returns the files written."""
    if fmt not in FORMATS:
        raise VizError(f"format '{fmt}' is not one of {', '.join(FORMATS)}")
    runs = load_runs([Path(d) for d in run_dirs])
    written = []
    for result in figure_results(runs, only, at):
        written.append(save_figure(result.figure, Path(out) / f"{result.name}.{fmt}", fmt))
    return written

"""pagelab viz: figures from run folders (docs/run-format.md); imports only numpy, pandas, matplotlib.

`plot_runs` draws every figure that applies to the given run folders; each figure module also exposes
a `plot_*` function returning a FigureResult (the Figure plus the data it drew).
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from viz.blockmap import plot_block_map
from viz.breakdown import plot_breakdown
from viz.common import FORMATS, FigureResult, safe_stem, save_figure, staged_folder
from viz.errors import TableError, VizError
from viz.latency_cdf import plot_latency_cdf
from viz.load import AllocatorRun, Run, load_runs, run_allocator
from viz.snapshot import plot_block_snapshot
from viz.sweep import applies, plot_block_size_sweep, plot_sweep_latency, sweep_label, sweeps, unjoined
from viz.timeline import plot_batch_size, plot_memory_over_time
from viz.titles import PartRun
from viz.trace_overview import save_trace_overview

__all__ = ["FIGURES", "VizError", "figure_results", "no_steps", "plot_runs", "save_figures",
           "save_trace_overview"]


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


def _per_sweep(plot: Callable[..., FigureResult], name: str, column: str
               ) -> Callable[..., Iterator[FigureResult]]:
    """Draw a sweep figure from the points of each sweep among the runs that differ in `column`; with
    several sweeps the file name gets the sweep folder's name."""
    def draw(runs: list[Run], **_options) -> Iterator[FigureResult]:
        groups = sweeps(runs, column)
        for group in groups:
            yield plot(group, name=name if len(groups) == 1 else f"{name}-{safe_stem(sweep_label(group))}")
    return draw


def _has_events(runs: list[Run]) -> bool:
    """Whether any allocator recorded pool tenures (simulate --no-events writes none)."""
    return any(alloc.num_events for run in runs for alloc in run.allocators.values())


SWEEP_POINTS = "points of one sweep (`pagelab sweep --out DIR` writes them in DIR/points)"
# The sweep figures: the column their points differ in, and its name in messages.
SWEEP_AXES = {"sweep_latency": ("rate", "request rate"), "block_size_sweep": ("block_size", "block size")}


def _sweep_figure(plot: Callable[..., FigureResult], name: str) -> tuple:
    """A sweep figure's FIGURES entry, from its axis in SWEEP_AXES."""
    column, what = SWEEP_AXES[name]
    return (_per_sweep(plot, name, column), lambda runs: applies(runs, column),
            f"needs two or more {SWEEP_POINTS} with different {what}s")


NO_EVENTS = ("needs tenures in events.parquet, which none of the runs recorded (simulate records them "
             "unless --no-events, sweep only with --events)")

# name -> (draw, applicability check, why it may not apply)
FIGURES: dict[str, tuple[Callable[..., Iterator[FigureResult]], Callable[[list[Run]], bool], str]] = {
    "breakdown": (_all_runs(plot_breakdown), lambda runs: True, ""),
    "memory_over_time": (_per_run(plot_memory_over_time, "memory_over_time"), lambda runs: True, ""),
    "block_map": (_per_run(plot_block_map, "block_map", "window"), _has_events, NO_EVENTS),
    "block_snapshot": (_per_run(plot_block_snapshot, "block_snapshot", "at"), _has_events, NO_EVENTS),
    "latency_cdf": (_all_runs(plot_latency_cdf), lambda runs: True, ""),
    "batch_size": (_all_runs(plot_batch_size), lambda runs: True, ""),
    "sweep_latency": _sweep_figure(plot_sweep_latency, "sweep_latency"),
    "block_size_sweep": _sweep_figure(plot_block_size_sweep, "block_size_sweep"),
}


# The tables each figure reads: an allocator whose table cannot be read is left out of that figure only.
FIGURE_TABLES: dict[str, tuple[str, ...]] = {
    "breakdown": (), "memory_over_time": ("memory",), "block_map": ("events",),
    "block_snapshot": ("events", "memory", "requests"), "latency_cdf": ("requests",),
    "batch_size": ("memory",), "sweep_latency": ("requests",), "block_size_sweep": ("requests",),
}


def no_steps(alloc: AllocatorRun) -> str | None:
    """Why an allocator has nothing to draw, or None: it ran no step, so its memory table has no rows and
    its summary's memory shares are null (every request was rejected before the first step)."""
    summary = alloc.summary
    if summary.get("num_steps") != 0:
        return None
    total = summary.get("num_requests")
    return "no steps: every request was rejected" if total and summary.get("num_rejected") == total \
        else "no steps"


def _with_steps(runs: list[Run], warn: Callable[[str], None]) -> list[Run]:
    """The runs with only the allocators that ran a step (a warning for each other one); VizError naming
    them when none did."""
    kept, left_out = [], []
    for run in runs:
        allocs = {n: a for n, a in run.allocators.items() if no_steps(a) is None}
        dropped = {n: a for n, a in run.allocators.items() if n not in allocs}
        left_out += [(run, a) for a in dropped.values()]
        if allocs and dropped:  # the titles still count the allocators left out
            fields = {f.name: getattr(run, f.name) for f in dataclasses.fields(Run)}
            kept.append(PartRun(**{**fields, "allocators": allocs}, left_out=dropped))
        elif allocs:
            kept.append(dataclasses.replace(run, allocators=allocs))
    if not kept:
        raise VizError("nothing to draw: " + "; ".join(f"{a.path}: {no_steps(a)}" for _, a in left_out))
    for run, alloc in left_out:
        warn(f"{alloc.path}: {no_steps(alloc)}; the figures leave out {run_allocator(run, alloc)}")
    return kept


def _readable(runs: list[Run], tables: tuple[str, ...]) -> list[Run]:
    """The runs with only the allocators whose `tables` can all be read (runs left with none dropped)."""
    kept = []
    for run in runs:
        allocs = {n: a for n, a in run.allocators.items() if not a.table_problems(tables)}
        if allocs:
            kept.append(dataclasses.replace(run, allocators=allocs))
    return kept


def figure_results(runs: list[Run], only: list[str] | None = None, at: float | None = None,
                   warn: Callable[[str], None] | None = None, window: tuple[float, float] | None = None
                   ) -> Iterator[FigureResult]:
    """Draw the selected figures that apply, one at a time (a requested one that cannot apply is an error);
    `at` is the snapshot's time, `window` the block map's (start, end) in seconds.

    A table that cannot be read leaves its allocator out of the figures that need it, with a `warn`ing
    naming the file (Python's warnings without `warn`); a figure left with nothing to draw is skipped. So is
    an allocator that ran no step, with a warning; VizError when no allocator did.
    """
    warn = warn or (lambda message: warnings.warn(message, stacklevel=3))
    unknown = [n for n in only or [] if n not in FIGURES]
    if unknown:
        raise VizError(f"unknown figure '{unknown[0]}'; choose from {', '.join(FIGURES)}")
    runs = _with_steps(runs, warn)
    told: set[Path] = set()
    for name, (draw, check, why) in FIGURES.items():
        if only and name not in only:
            continue
        drawn: set[str] = set()  # a per-run figure redrawn after damage yields each file once
        found: tuple[str, ...] = ()  # tables found damaged while drawing that FIGURE_TABLES does not list
        while True:
            tables = FIGURE_TABLES[name] + found
            for run in runs:
                for alloc in run.allocators.values():
                    for problem in alloc.table_problems(tables):
                        if problem.path not in told:
                            told.add(problem.path)
                            warn(f"{problem}: the figures that need the {problem.table} table leave out "
                                 f"{run_allocator(run, alloc)}")
            readable = _readable(runs, tables)
            if not readable:
                warn(f"figure '{name}' skipped: none of its {'/'.join(tables)} tables can be read")
                break
            if not check(readable):
                if only:
                    raise VizError(f"figure '{name}' {why}")
                column, what = SWEEP_AXES.get(name, (None, ""))
                if column and unjoined(readable, column):
                    warn(f"figure '{name}' not drawn: the run folders differ in {what} but are separate "
                         f"runs; it {why}")
                elif not column and why:  # a figure every run would have but these lack: say why
                    warn(f"figure '{name}' not drawn: it {why}")
                break
            try:
                for result in draw(readable, at=at, window=window):
                    if result.name not in drawn:
                        drawn.add(result.name)
                        yield result
            except TableError as exc:  # damage the footers did not show: mark it and draw without it
                _mark(runs, exc)
                # The redraw must leave that allocator out, or it meets the same damage again, forever.
                if exc.table not in tables:
                    found += (exc.table,)
                continue
            break


def _mark(runs: list[Run], exc: TableError) -> None:
    """Record a table found unreadable while drawing, so figures leave its allocator out from now on."""
    for run in runs:
        for alloc in run.allocators.values():
            if exc.path == alloc.path or alloc.path in exc.path.parents:
                if alloc._problems.get(exc.table) is not None:
                    raise exc  # already left out of the figure that met it: redrawing would not end
                alloc._problems[exc.table] = exc
                return
    raise exc  # not a table of these runs


def _warn_incomplete(runs: list[Run], warn: Callable[[str], None]) -> None:
    """A warning for every run that stopped early (it is drawn as far as it ran)."""
    for run in runs:
        for alloc in run.allocators.values():
            stopped = alloc.incomplete or (run.incomplete if run.incomplete and
                                           run.incomplete.get("allocator") == alloc.name else None)
            if stopped:
                warn(f"{alloc.path}: an incomplete run, stopped at step {stopped.get('num_steps', '?')} "
                     f"({stopped.get('reason', 'no reason recorded')}); its figures show the steps it ran")


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise VizError(f"format '{fmt}' is not one of {', '.join(FORMATS)}")


def plot_runs(run_dirs: list[Path], out: Path, fmt: str = "png", only: list[str] | None = None,
              at: float | None = None, warn: Callable[[str], None] | None = None,
              window: tuple[float, float] | None = None) -> list[Path]:
    """Draw every figure that applies to the run folders into `out`; returns the files written. Incomplete
    runs and unreadable tables are reported through `warn` (see figure_results)."""
    _check_format(fmt)  # before the runs are read
    return save_figures(load_runs([Path(d) for d in run_dirs]), out, fmt, only, at, warn, window)


def save_figures(runs: list[Run], out: Path, fmt: str = "png", only: list[str] | None = None,
                 at: float | None = None, warn: Callable[[str], None] | None = None,
                 window: tuple[float, float] | None = None) -> list[Path]:
    """`plot_runs` on runs already loaded (a caller checks them before it checks `out`)."""
    _check_format(fmt)
    warn = warn or (lambda message: warnings.warn(message, stacklevel=3))
    _warn_incomplete(runs, warn)
    names = []
    with staged_folder(out) as tmp:  # a figure that fails leaves none of the others in `out`
        for result in figure_results(runs, only, at, warn, window):
            names.append(save_figure(result.figure, tmp / f"{result.name}.{fmt}", fmt).name)
    return [Path(out) / name for name in names]

"""`pagelab plot`: draw every figure that applies to one or more run folders."""
from __future__ import annotations

import json
import math
from pathlib import Path

import typer

from cli.common import UserError, err_console, figure_format, user_errors, warn


def _run_end(run_dir: Path) -> float | None:
    """The longest simulated (or measured) duration among a run folder's allocators, if it says."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        return max(float(s["sim_duration_s"]) for s in summary["allocators"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _check_at(at: float, run_dirs: list[Path]) -> None:
    """--at must be a finite time within the runs (a snapshot after the end shows nothing)."""
    if not math.isfinite(at) or at < 0:
        raise UserError(f"--at must be a finite time >= 0 s (got {at})")
    ends = [e for e in map(_run_end, run_dirs) if e is not None]
    if ends and at > max(ends):
        raise UserError(f"--at {at:g} s is after the end of the run(s) ({max(ends):,.3f} s)")


def _window(text: str | None) -> tuple[float, float] | None:
    """--window START:END as two numbers (checked against the run when the block map is drawn)."""
    if text is None:
        return None
    try:
        start, end = (float(x) for x in text.split(":"))
    except ValueError:
        raise UserError(f"--window {text!r}: expected START:END in seconds, e.g. 0:3600") from None
    return start, end


@user_errors
def plot_cmd(
    run_dirs: list[Path] = typer.Argument(..., metavar="RUN_DIR...",
                                          help="Run folders from simulate or replay."),
    out: Path = typer.Option(None, "--out", "-o",
                             help="Folder for the figures (default: RUN_DIR/figures for one run, "
                                  "./figures for several)."),
    fmt: str = typer.Option("png", "--image-format", "--format", "-f", help="png, svg or pdf."),
    only: list[str] = typer.Option(None, "--only",
                                   help="Draw only these figures (repeat or comma-separate): breakdown, "
                                        "memory_over_time, block_map, block_snapshot, latency_cdf, "
                                        "batch_size, sweep_latency, block_size_sweep."),
    at: float = typer.Option(None, "--at", help="Time (s) of the block snapshot (default: peak usage)."),
    window: str = typer.Option(None, "--window", metavar="START:END",
                               help="Seconds of the run the block map draws (default: the whole run, or its "
                                    "first part when it holds over 2,000,000 tenures)."),
) -> None:
    """Draw breakdowns, memory over time, block maps, latency CDFs and sweeps from run folders."""
    from cli.runs import check_out_folder
    from viz import save_figures
    from viz.load import load_runs

    fmt = figure_format(fmt)
    names = [n.strip() for item in only or [] for n in item.split(",") if n.strip()] or None
    # --at and --window shape one figure each: refused when --only leaves that figure out.
    for option, value, figure in (("--at", at, "block_snapshot"), ("--window", window, "block_map")):
        if value is not None and names is not None and figure not in names:
            raise UserError(f"{option} shapes the {figure} figure, which --only leaves out")
    label = f"--out {out}"
    if out is None:
        out = run_dirs[0] / "figures" if len(run_dirs) == 1 else Path("figures")
        label = str(out)
    if at is not None:
        _check_at(at, run_dirs)
    runs = load_runs(list(run_dirs))
    check_out_folder(out, label)
    written = save_figures(runs, out, fmt, names, at=at, window=_window(window), warn=warn)
    for path in written:
        err_console.print(f"wrote {path}", markup=False)
    if not written:
        err_console.print("no figure applies to these run folders", highlight=False)

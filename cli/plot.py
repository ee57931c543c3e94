"""`pagelab plot`: draw every figure that applies to one or more run folders."""
from __future__ import annotations

from pathlib import Path

import typer

from cli import app
from cli.common import UserError, err_console, user_errors


@app.command("plot")
@user_errors
def plot_cmd(
    run_dirs: list[Path] = typer.Argument(..., metavar="RUN_DIR...",
                                          help="Run folders from simulate or replay."),
    out: Path = typer.Option(None, "--out", "-o",
                             help="Folder for the figures (default: RUN_DIR/figures for one run, "
                                  "./figures for several)."),
    fmt: str = typer.Option("png", "--format", "-f", help="png, svg or pdf."),
    only: list[str] = typer.Option(None, "--only",
                                   help="Draw only these figures (repeat or comma-separate): breakdown, "
                                        "memory_over_time, block_map, block_snapshot, latency_cdf, "
                                        "batch_size, sweep_latency, block_size_sweep."),
    at: float = typer.Option(None, "--at", help="Time (s) of the block snapshot (default: peak usage)."),
) -> None:
    """Draw breakdowns, memory over time, block maps, latency CDFs and sweeps from run folders."""
    from viz import plot_runs

    fmt = fmt.lower().lstrip(".")
    names = [n.strip() for item in only or [] for n in item.split(",") if n.strip()] or None
    if out is None:
        out = run_dirs[0] / "figures" if len(run_dirs) == 1 else Path("figures")
    if at is not None and at < 0:
        raise UserError(f"--at must be a time >= 0 s (got {at})")
    written = plot_runs(list(run_dirs), out, fmt, names, at=at)
    for path in written:
        err_console.print(f"wrote {path}", highlight=False)
    if not written:
        err_console.print("no figure applies to these run folders", highlight=False)

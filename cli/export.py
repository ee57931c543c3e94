"""`pagelab export`: a run folder in another tool's format (Perfetto / chrome://tracing trace events)."""
from __future__ import annotations

from pathlib import Path

import typer

from cli.common import UserError, err_console, user_errors, warn

FORMATS = ("perfetto",)


@user_errors
def export_cmd(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="Run folder from simulate or replay."),
    fmt: str = typer.Option("perfetto", "--format", "-f",
                            help="perfetto: Chrome trace-event JSON (Perfetto, chrome://tracing)."),
    out: Path = typer.Option(None, "--out", "-o", help="File to write (default: RUN_DIR/trace.json)."),
) -> None:
    """Write a run as a timeline other tools open: one track per request, counters for memory and queues."""
    if fmt.lower() not in FORMATS:
        raise UserError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    from cli.runs import check_out_file
    from viz.load import load_run
    from viz.perfetto import check_tables, write_perfetto
    from viz.transitions import missing_transitions

    run = load_run(run_dir)
    check_tables(run)  # before --out is checked: the run's problems first
    path = out if out is not None else run_dir / "trace.json"
    check_out_file(path, f"--out {out}" if out is not None else str(path))
    for problem in missing_transitions(run.allocators.values()):
        warn(problem)
    count = write_perfetto(run, path)
    err_console.print(f"wrote {path} ({count:,} trace events)", markup=False, highlight=False)

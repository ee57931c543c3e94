"""`pagelab view`: a run as one HTML page to scrub through (block maps, memory curve, request lanes)."""
from __future__ import annotations

import contextlib
from pathlib import Path

import typer

from cli.common import UserError, err_console, user_errors, warn


@user_errors
def view_cmd(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="Run folder from simulate or replay."),
    window: list[str] = typer.Option(None, "--window", metavar="START:END",
                                     help="Seconds of the run shown in full detail (repeatable; default: "
                                          "around the peak, or the whole run when it is small)."),
    out: Path = typer.Option(None, "--out", "-o", help="HTML file to write (default: RUN_DIR/view.html)."),
    serve: bool = typer.Option(False, "--serve",
                               help="Also serve the page on localhost; it loads any moment's detail."),
    port: int = typer.Option(0, "--port", help="Port for --serve (default: any free one)."),
) -> None:
    """Write one self-contained HTML page that scrubs through a run: pool block map, memory, requests."""
    from cli.runs import check_out_file
    from viz.explorer import check_windows
    from viz.explorer_page import set_page, write_page
    from viz.load import load_run
    from viz.perfetto import run_end
    from viz.transitions import missing_transitions

    if not 0 <= port <= 65535:
        raise UserError(f"--port {port}: expected a port from 0 to 65535 (0: any free one)")
    if port and not serve:
        raise UserError(f"--port {port} is where --serve listens: give --serve too, or leave --port out")
    run = load_run(run_dir)
    end = max(run_end(a) for a in run.allocators.values())
    windows = check_windows(list(window or []), end) or None
    path = out if out is not None else run_dir / "view.html"
    check_out_file(path, f"--out {out}" if out is not None else str(path))
    for problem in missing_transitions(run.allocators.values()):
        warn(problem)
    server = _listen(run, port) if serve else None  # a busy port is refused before the page is written
    try:
        size = write_page(run, path, windows, serve=serve)
        err_console.print(f"wrote {path} ({size / 1e6:.1f} MB)", markup=False, highlight=False)
        if server is None:
            return
        set_page(server, path.read_bytes())
        err_console.print(f"serving http://127.0.0.1:{server.server_port}/ (Ctrl-C stops)", markup=False,
                          highlight=False)
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()
    finally:
        if server is not None:
            server.server_close()


def _listen(run, port: int):
    """The page's server listening on `port` (it serves the page once it is written), or UserError: the
    port is taken or not ours to open."""
    from viz.explorer_page import make_server

    try:
        return make_server(run, b"", port)
    except OSError as exc:
        raise UserError(f"--port {port}: cannot listen on 127.0.0.1:{port} ({exc.strerror or exc})") from None

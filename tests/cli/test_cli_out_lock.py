"""Two commands into one --out: the second refuses at once naming the first's pid; a killed first run leaves
no lock that blocks the next. The first runs in its own process; the others run in this one."""
from __future__ import annotations

import signal
import time

from clirun import start
from typer.testing import CliRunner

import cli.common
from cli import app


def _error(result) -> str:
    """The one error line of a refused command (exit 2)."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_cli_runs_into_one_out_exclude_each_other(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli.common.err_console, "width", 400)
    runner = CliRunner()
    first = start("simulate", "--mode", "step", "--out", "r", cwd=tmp_path)  # minutes of work
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / ".r.lock").is_file() or not (tmp_path / ".r.lock").read_text().strip():
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.1)
        began = time.monotonic()
        line = _error(runner.invoke(app, ["simulate", "--limit", "20", "--out", "r", "--overwrite"]))
        assert time.monotonic() - began < 30
        assert f"--out r: another pagelab process (pid {first.pid}) is writing this folder" in line
        sweep = _error(runner.invoke(app, ["sweep", "--rate", "1,2", "--limit", "20", "--out", "r"]))
        assert f"(pid {first.pid})" in sweep
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # Killed mid-run: its lock went with it, so the next run goes ahead (and clears the killed run's files).
    done = runner.invoke(app, ["simulate", "--limit", "20", "-a", "paged", "--out", "r"])
    assert done.exit_code == 0, done.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]

"""Two commands into one --out: the second refuses at once naming the first's pid; a killed first run leaves
no lock that blocks the next."""
from __future__ import annotations

import signal
import time

from clirun import one_line_error, pagelab, start


def test_cli_runs_into_one_out_exclude_each_other(tmp_path):
    first = start("simulate", "--mode", "step", "--out", "r", cwd=tmp_path)  # minutes of work
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / ".r.lock").is_file() or not (tmp_path / ".r.lock").read_text().strip():
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.1)
        began = time.monotonic()
        line = one_line_error(pagelab("simulate", "--limit", "20", "--out", "r", "--overwrite", cwd=tmp_path))
        assert time.monotonic() - began < 30
        assert f"--out r: another pagelab process (pid {first.pid}) is writing this folder" in line
        sweep = one_line_error(pagelab("sweep", "--rate", "1,2", "--limit", "20", "--out", "r", cwd=tmp_path))
        assert f"(pid {first.pid})" in sweep
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # Killed mid-run: its lock went with it, so the next run goes ahead (and clears the killed run's files).
    done = pagelab("simulate", "--limit", "20", "-a", "paged", "--out", "r", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]

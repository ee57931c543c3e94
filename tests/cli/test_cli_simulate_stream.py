"""`pagelab simulate --out` streams its tables into the atomic run folder; stale temp folders are cleared."""
from __future__ import annotations

import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from pagelab.atomic import atomic_dir, stale_temp_dirs
from simulator.config import SimConfig
from simulator.loop import simulate
from traces import SyntheticConfig, generate_trace

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("wide_consoles")


def _dead_pid() -> int:
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has this pid now (pids are not reused that fast)


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_streamed_run_folder_equals_the_pure_run_and_clears_a_killed_runs_temp(tmp_path, fmt):
    trace_path = tmp_path / "t.parquet"
    generate_trace(SyntheticConfig(num_requests=80, rate=20.0, seed=1)).to_parquet(trace_path)
    out = tmp_path / "run"
    stale = tmp_path / f".run.tmp-{_dead_pid()}-abcd1234"
    (stale / "paged").mkdir(parents=True)
    unknown = tmp_path / ".run.tmp-zzz"  # an old-style name: no pid, left alone but reported
    unknown.mkdir()
    result = runner.invoke(app, ["simulate", str(trace_path), "-a", "paged", "--capacity-tokens", "5000",
                                 "--out", str(out), "--table-format", fmt])
    assert result.exit_code == 0, result.output
    assert not stale.exists() and unknown.exists()
    assert f"removed {stale}" in result.output and str(unknown) in result.output
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".run.tmp-") and p != unknown]
    pure = simulate(generate_trace(SyntheticConfig(num_requests=80, rate=20.0, seed=1)),
                    SimConfig(capacity_tokens=5000))
    read = pd.read_parquet if fmt == "parquet" else pd.read_csv
    events = read(out / "paged" / f"events.{fmt}")
    memory = read(out / "paged" / f"memory.{fmt}")
    assert len(events) == len(pure.events) > 0 and len(memory) == len(pure.memory)
    if fmt == "parquet":
        pd.testing.assert_frame_equal(events, pure.events)
        pd.testing.assert_frame_equal(memory, pure.memory)


def test_a_live_processes_temp_folder_is_not_stale(tmp_path):
    with atomic_dir(tmp_path / "run") as tmp:
        assert tmp.name.startswith(".run.tmp-")
        assert stale_temp_dirs(tmp_path / "run") == ([], [])
    assert (tmp_path / "run").is_dir()

"""`pagelab sweep` when a worker dies: the point's line and a warning say so, the sweep exits 1 with its
tables written; running it again runs only that point."""
from __future__ import annotations

import pandas as pd
from clirun import pagelab

from simulator.sweep.executors import KILL_POINT_ENV
from traces import SyntheticConfig, generate_trace, save_trace


def test_a_killed_worker_fails_its_point_and_a_rerun_retries_it(tmp_path):
    save_trace(generate_trace(SyntheticConfig(num_requests=40, lengths="sharegpt", rate=1.0, seed=0)),
               tmp_path / "t.parquet")
    args = ("sweep", "t.parquet", "-a", "paged", "--capacity-tokens", "8192", "--max-model-len", "2048",
            "--rate", "1,2,4", "--no-search", "--jobs", "2", "--out", "s")
    result = pagelab(*args, cwd=tmp_path, **{KILL_POINT_ENV: "-r2-"})
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "of at most 3: paged at 2 req/s: failed: its worker process was killed by SIGKILL" in result.stderr
    assert ("warning: 1 point(s) failed (their causes are in the error column of s/sweep.parquet); run the "
            "same sweep again to retry them") in result.stderr
    assert pd.read_parquet(tmp_path / "s" / "sweep.parquet")["error"].notna().sum() == 1
    again = pagelab(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "wrote s (1 points run, 2 reused)" in again.stderr


def test_ctrl_c_stops_a_local_sweep_at_once_and_a_rerun_resumes_it(tmp_path):
    # Ctrl-C reaches every process of the terminal's group, workers included, as os.killpg does here.
    import os
    import signal
    import subprocess
    import sys

    from clirun import env

    args = ("sweep", "--rate", "1:10", "-a", "paged,contiguous-max", "--limit", "3000", "-j", "2",
            "--slo", "ttft_p99:1s", "--out", "s")
    sweep = subprocess.Popen([sys.executable, "-c", "from cli import main; main()", *args], cwd=tmp_path,
                             env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    for line in sweep.stderr:  # the first point's line: the pool's workers are running points
        if line.startswith("point 1 "):
            break
    os.killpg(sweep.pid, signal.SIGINT)
    try:
        _, err = sweep.communicate(timeout=60)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    assert sweep.returncode == 130 and "Traceback" not in err, err
    done = pagelab(*args, cwd=tmp_path, timeout=300)
    assert done.returncode == 0 and " reused)" in done.stderr, done.stderr

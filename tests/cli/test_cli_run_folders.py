"""`--out`: the user's files survive, destinations are checked before the work, runs describe themselves."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from clirun import env, one_line_error, pagelab, start

SIM = ("simulate", "azure-conv", "--limit", "20", "-a", "paged", "--kv-memory-gb", "2")


def test_out_refuses_a_folder_that_is_not_a_run_and_keeps_its_files(tmp_path):
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "notes.txt").write_text("x")
    line = one_line_error(pagelab(*SIM, "--out", "u", cwd=tmp_path))
    assert "not a pagelab run" in line and "notes.txt" in line
    assert (tmp_path / "u" / "notes.txt").read_text() == "x"
    assert sorted(p.name for p in (tmp_path / "u").iterdir()) == ["notes.txt"]


def test_out_naming_a_file_is_refused_and_the_file_survives(tmp_path):
    (tmp_path / "f.txt").write_text("hi")
    line = one_line_error(pagelab(*SIM, "--out", "f.txt", cwd=tmp_path))
    assert "is a file" in line
    assert (tmp_path / "f.txt").read_text() == "hi"


def test_an_existing_run_is_replaced_only_with_overwrite(tmp_path):
    assert pagelab(*SIM, "--out", "r", cwd=tmp_path).returncode == 0
    first = json.loads((tmp_path / "r" / "run.json").read_text())["created_utc"]
    line = one_line_error(pagelab(*SIM, "--out", "r", cwd=tmp_path))
    assert "--overwrite" in line
    assert json.loads((tmp_path / "r" / "run.json").read_text())["created_utc"] == first
    done = pagelab(*SIM, "-a", "contiguous-max", "--out", "r", "--overwrite", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["contiguous-max", "paged", "run.json",
                                                                 "summary.json"]


@pytest.mark.parametrize("out, message", [
    ("f.txt/sub", "which is a file"),
    (".", "not a pagelab run"),
    ("/proc/pagelab-run", "folders in /proc"),  # "cannot create" as root, "no permission" otherwise
])
def test_unusable_destinations_are_refused_before_the_simulation(tmp_path, out, message):
    (tmp_path / "f.txt").write_text("hi")
    # A trace that takes minutes to simulate: the refusal must come before it is even loaded.
    start = time.monotonic()
    line = one_line_error(pagelab("simulate", "--out", out, cwd=tmp_path))
    assert message in line
    assert time.monotonic() - start < 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]


def test_run_folder_is_self_describing_and_follows_the_umask(tmp_path):
    result = subprocess.run(["/bin/sh", "-c", f'umask 022 && exec "{sys.executable}" -c '
                             '"from cli import main; main()" ' + " ".join(SIM) + " --out r --sharing"],
                            cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "r"
    meta = json.loads((run / "run.json").read_text())
    assert meta["command"] == "simulate" and meta["argv"][1:4] == ["simulate", "azure-conv", "--limit"]
    assert meta["trace_sha256"].startswith("sha256:") and len(meta["trace_sha256"]) == 7 + 64
    assert meta["versions"]["python"].count(".") == 2 and meta["versions"]["pagelab"]
    assert meta["config"]["kv_memory_gb"] == 2 and meta["config"]["allocators"] == ["paged"]
    assert meta["created_utc"].endswith("+00:00")
    summary = json.loads((run / "summary.json").read_text())
    assert 0 <= summary["sharing"]["saving"] <= 1
    assert summary["serving_metrics"]["paged"]["completed"] == 20
    assert run.stat().st_mode & 0o777 == 0o755
    assert (run / "paged").stat().st_mode & 0o777 == 0o755
    assert (run / "run.json").stat().st_mode & 0o777 == 0o644


def test_trace_hash_is_the_files_sha256_across_read_buffers(tmp_path):
    from traces.loaders import HASH_READ_BYTES, trace_hash

    data = np.random.default_rng(0).bytes(2 * HASH_READ_BYTES + 123)
    path = tmp_path / "t.parquet"
    path.write_bytes(data)
    assert trace_hash(str(path)) == "sha256:" + hashlib.sha256(data).hexdigest()
    path.write_bytes(b"")
    assert trace_hash(str(path)) == "sha256:" + hashlib.sha256(b"").hexdigest()


def test_temp_folders_of_killed_runs_are_removed(tmp_path):
    stale = tmp_path / ".r.tmp-999999999-deadbeef"  # no such process
    stale.mkdir()
    (stale / "half.parquet").write_text("")
    result = pagelab(*SIM, "--out", "r", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not stale.exists()
    assert "left behind by a killed run" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_a_run_clears_the_temp_folder_of_a_killed_run_into_the_same_folder(tmp_path):
    proc = start("simulate", "--mode", "step", "--out", "a", cwd=tmp_path)  # minutes over the whole trace
    try:
        while not [p for p in tmp_path.iterdir() if p.name.startswith(".a.tmp-")]:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.communicate()
    (stale,) = [p for p in tmp_path.iterdir() if p.name.startswith(".a.tmp-")]
    result = pagelab(*SIM, "--out", "b", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"removed {stale}, left behind by a killed run" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # the killed run's lock file went too


def test_temp_folders_of_live_writers_and_other_names_are_kept(tmp_path, dead_pid):
    live = tmp_path / f".c.tmp-{os.getpid()}-0123abcd"
    locked = tmp_path / f".d.tmp-{dead_pid}-0123abcd"  # a writer elsewhere: its pid means nothing here
    # g absent: the swap that moved g aside was cut short, so .g.old holds its only copy
    names = (f".e.tmp-{dead_pid}-0123ABCD", f".e.tmp-{dead_pid}", "e.tmp-1-0123abcd", f".g.old-{dead_pid}")
    others = [tmp_path / name for name in names]
    for folder in (live, locked, *others):
        folder.mkdir()
    (tmp_path / f".f.tmp-{dead_pid}-0123abcd").write_text("a file")
    (tmp_path / f".h.tmp-{dead_pid}-0123abcd").symlink_to(tmp_path / "e.tmp-1-0123abcd")
    before = sorted(p.name for p in tmp_path.iterdir())
    code = ("import sys; from pagelab.folder_lock import hold, release_held; hold(sys.argv[1]); "
            "print('held', flush=True); sys.stdin.read(); release_held()")
    holder = subprocess.Popen([sys.executable, "-c", code, tmp_path / "d"], env=env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = pagelab(*SIM, "--out", "b", cwd=tmp_path)
        after = sorted(p.name for p in tmp_path.iterdir())
    finally:
        holder.communicate("")
    assert result.returncode == 0, result.stderr
    assert "removed" not in result.stderr
    assert after == sorted([*before, ".d.lock", "b"])


def test_out_on_a_mount_point_is_refused_before_the_work(small_tmpfs, tmp_path):
    mount = small_tmpfs()
    line = one_line_error(pagelab(*SIM, "--out", mount, cwd=tmp_path))
    assert line == (f"error: --out {mount} is a mount point, so the output folder cannot be replaced there; "
                    "choose a folder inside it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small"] and list(mount.iterdir()) == []


def test_out_on_a_bind_mount_fails_at_the_rename_naming_it_and_leaves_no_temp_folder(bind_mount, tmp_path):
    line = one_line_error(pagelab(*SIM, "--out", bind_mount, cwd=tmp_path))
    assert str(bind_mount) in line and "cannot be replaced" in line and "mount point" in line
    assert "choose a folder inside it" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bind", "src"] and list(bind_mount.iterdir()) == []


def test_sigterm_during_the_write_leaves_no_hidden_folder(tmp_path):
    code = ("import sys, time; from cli.commands import _terminate; import signal; "
            "signal.signal(signal.SIGTERM, _terminate); from pagelab.atomic import atomic_dir\n"
            "with atomic_dir('r') as tmp:\n"
            "    (tmp / 'part').write_text('x'); print('writing', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "writing"
    assert any(p.name.startswith(".r.tmp-") for p in tmp_path.iterdir())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_cli_installs_the_sigterm_handler(tmp_path):
    proc = start("simulate", "--mode", "step", "--out", "r", cwd=tmp_path)
    time.sleep(3)  # step mode over the whole bundled trace takes minutes
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert os.listdir(tmp_path) == []


def test_a_run_without_events_has_an_empty_events_table(tmp_path):
    result = pagelab(*SIM, "--no-events", "--out", "r", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    import pandas as pd

    events = pd.read_parquet(tmp_path / "r" / "paged" / "events.parquet")
    assert len(events) == 0 and str(events["request_id"].dtype) == "int32"


def test_config_from_a_simulation_says_it_takes_a_replay(tmp_path):
    sim = tmp_path / "sim"
    assert pagelab("simulate", "--limit", "20", "-a", "paged", "--out", sim).returncode == 0
    message = one_line_error(pagelab("simulate", "--config-from", sim, "--out", tmp_path / "twin"))
    assert "a simulation, not a measured run" in message and "pagelab replay" in message
    assert not (tmp_path / "twin").exists()


def test_figures_left_out_by_simulate_plot_are_warned_as_plot_warns(tmp_path):
    # Without events there is no block map: one warning line as `pagelab plot` gives, no Python warning.
    result = pagelab(*SIM, "--no-events", "--out", "r", "--plot", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "warning: " in result.stderr and "block_map" in result.stderr
    assert "UserWarning" not in result.stderr and ".py:" not in result.stderr

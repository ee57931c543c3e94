"""One writer per output folder: the second refuses at once naming the first's pid, and a writer that dies
(even by SIGKILL) leaves no lock behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pagelab.folder_lock import FolderBusyError, FolderLock, hold, lock_path, release_held

ROOT = Path(__file__).resolve().parents[2]
HOLDER = ("import sys, time; from pagelab.folder_lock import FolderLock\n"
          "lock = FolderLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)\n")


def _holder(folder: Path) -> subprocess.Popen:
    """Another process that takes `folder`'s lock and keeps it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_is_refused_at_once_and_told_the_holders_pid(tmp_path):
    proc = _holder(tmp_path / "run")
    try:
        with pytest.raises(FolderBusyError) as caught:
            FolderLock(tmp_path / "run").acquire()
        assert f"(pid {proc.pid}) is writing this folder" in str(caught.value)
        assert str(tmp_path / "run") in str(caught.value)
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_holder_leaves_no_lock(tmp_path):
    proc = _holder(tmp_path / "run")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert lock_path(tmp_path / "run").exists()  # the file stays; the lock went with the process
    with FolderLock(tmp_path / "run") as lock:
        assert lock.held
        assert lock_path(tmp_path / "run").read_text().strip() == str(os.getpid())
    assert list(tmp_path.iterdir()) == []


def test_a_released_lock_takes_its_file_and_the_folders_made_for_it(tmp_path):
    lock = FolderLock(tmp_path / "a" / "b" / "run").acquire()
    assert lock_path(tmp_path / "a" / "b" / "run").is_file()
    lock.release()
    assert list(tmp_path.iterdir()) == []


def test_a_waiting_writer_does_not_keep_a_deleted_file(tmp_path):
    # A locks, B opens the same file and waits; A releases (deleting the file): B must lock a file that is
    # at the path, or a third writer could lock a new file beside it.
    first = FolderLock(tmp_path / "run").acquire()
    fd = os.open(lock_path(tmp_path / "run"), os.O_RDWR)
    first.release()
    try:
        second = FolderLock(tmp_path / "run").acquire()
        third = FolderLock(tmp_path / "run")
        with pytest.raises(FolderBusyError):
            third.acquire()
        second.release()
    finally:
        os.close(fd)


def test_held_locks_stay_until_released(tmp_path):
    hold(tmp_path / "run")
    hold(tmp_path / "run")  # the same lock: no refusal from itself
    with pytest.raises(FolderBusyError):
        FolderLock(tmp_path / "run").acquire()
    release_held()
    with FolderLock(tmp_path / "run"):
        pass

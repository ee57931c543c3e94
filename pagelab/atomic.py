"""Write files and folders so that readers see either nothing or the complete result."""
from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from pagelab.writes import drop_open_files, write_bytes


def temp_sibling(path: Path, suffix: str = ".tmp") -> Path:
    """A fresh hidden name next to `path` (not mkstemp: its 0600 mode would survive the rename)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{suffix}")


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object], suffix: str = ".tmp") -> Path:
    """Call `write(tmp)` on a temporary sibling of `path`, then rename it into place; clean up on failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path, suffix)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        # Where the temporary file could not be made (a read-only file system), unlinking it fails too:
        # the first error is the one to report.
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` via a temporary name and rename."""
    return atomic_write(path, lambda tmp: write_bytes(tmp, data))


def _pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def stale_temp_dirs(final: str | os.PathLike) -> tuple[list[Path], list[Path]]:
    """Temporary siblings of `final` left by killed runs: (whose process is gone, whose owner is unknown).

    `atomic_dir` names its folders `.NAME.tmp-PID-...` (and `.NAME.old-PID` while swapping), so a
    folder whose process no longer runs can never be renamed into place; older names carry no pid.
    """
    final = Path(final)
    if not final.parent.is_dir():
        return [], []
    dead, unknown = [], []
    for p in sorted(final.parent.glob(f".{final.name}.*")):
        rest = p.name[len(final.name) + 2:]
        kind, _, tail = rest.partition("-")
        if kind not in ("tmp", "old") or not p.is_dir():
            continue
        pid = tail.split("-")[0]
        if not pid.isdigit():
            unknown.append(p)
        elif not _pid_alive(int(pid)):
            dead.append(p)
    return dead, unknown


def remove_stale_temp_dirs(final: str | os.PathLike) -> tuple[list[Path], list[Path]]:
    """Delete the temporary siblings of `final` whose process is gone; return (removed, left alone)."""
    dead, unknown = stale_temp_dirs(final)
    for p in dead:
        shutil.rmtree(p, ignore_errors=True)
    return dead, unknown


def _make_temp_dir(final: Path) -> Path:
    """A new hidden sibling folder named after our pid, created with the user's umask (not mkdtemp's 0700)."""
    while True:
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            tmp.mkdir(mode=0o777)  # the umask applies, as for any folder the user creates
        except FileExistsError:
            continue
        return tmp


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling folder; rename it to `final` only if the block completes.

    An interrupted or failed run leaves no half-written folder behind: either the complete
    result replaces `final`, or nothing changes. Temporary folders of writers that were killed
    (SIGKILL leaves no chance to clean up) are removed the next time `final` is written.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(final)
    tmp = _make_temp_dir(final)
    try:
        yield tmp
    except BaseException:
        drop_open_files(tmp)  # the writers of a failed run write nothing more when they are collected
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)

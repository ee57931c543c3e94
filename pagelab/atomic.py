"""Write files and folders so that readers see either nothing or the complete result."""
from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path


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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` via a temporary name and rename."""
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def _pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def stale_temp_dirs(final: str | os.PathLike) -> list[Path]:
    """Hidden `.NAME.tmp-PID-*` / `.NAME.old-PID` folders next to `final` whose writer process is gone."""
    final = Path(final)
    if not final.parent.is_dir():
        return []
    stale = []
    for kind in ("tmp", "old"):
        for path in final.parent.glob(f".{final.name}.{kind}-*"):
            pid = path.name[len(f".{final.name}.{kind}-"):].split("-")[0]
            if path.is_dir() and (not pid.isdigit() or not _pid_alive(int(pid))):
                stale.append(path)
    return sorted(stale)


def remove_stale_temp_dirs(final: str | os.PathLike) -> list[Path]:
    """Delete what killed writers of `final` left behind (see `stale_temp_dirs`); return what was removed."""
    removed = []
    for path in stale_temp_dirs(final):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed


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
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)

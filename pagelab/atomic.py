"""Write files and folders so that readers see either nothing or the complete result."""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from pagelab.errors import PagelabError
from pagelab.folder_lock import FolderBusyError, FolderLock
from pagelab.writes import drop_open_files, is_disk_full, write_bytes


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


# atomic_dir's folders: `.NAME.tmp-PID-HEX` while writing, `.NAME.old-PID` while swapping a run in.
_TEMP_DIR = re.compile(r"^\.(?P<name>.+)\.(?:tmp-(?P<pid>\d+)-[0-9a-f]{8}|old-(?P<old>\d+))$")


def _removable(path: Path, match: re.Match) -> bool:
    """Whether a folder of atomic_dir's can go: its process is gone, and no run exists only there (a writer
    killed between renaming the previous run aside and the new one into place leaves both, NAME absent)."""
    pid = match["pid"] or match["old"]
    if _pid_alive(int(pid)):
        return False
    final = path.with_name(match["name"])
    if final.exists() or final.is_symlink():
        return True
    return match["old"] is None and not path.with_name(f".{match['name']}.old-{pid}").exists()


def _temp_dirs(folder: Path) -> Iterator[tuple[Path, re.Match]]:
    """The folders (not links) in `folder` named as atomic_dir names its own."""
    for p in sorted(folder.iterdir()):
        match = _TEMP_DIR.match(p.name)
        if match is not None and p.is_dir() and not p.is_symlink():
            yield p, match


def stale_temp_dirs(final: str | os.PathLike) -> tuple[list[Path], list[Path]]:
    """Temporary siblings of `final` left by killed runs: (whose process is gone, whose owner is unknown).

    `atomic_dir` names its folders `.NAME.tmp-PID-...` (and `.NAME.old-PID` while swapping), so a
    folder whose process no longer runs can never be renamed into place; older names carry no pid, and
    the two folders of a swap cut short hold the only copies of the runs.
    """
    final = Path(final)
    if not final.parent.is_dir():
        return [], []
    dead, unknown = [], []
    prefix = f".{final.name}."
    for p in sorted(final.parent.iterdir()):
        kind = p.name[len(prefix):].partition("-")[0] if p.name.startswith(prefix) else ""
        if kind not in ("tmp", "old") or not p.is_dir() or p.is_symlink():
            continue
        match = _TEMP_DIR.match(p.name)
        if match is None or match["name"] != final.name:
            unknown.append(p)
        elif _removable(p, match):
            dead.append(p)
        elif not _pid_alive(int(match["pid"] or match["old"])):
            unknown.append(p)
    return dead, unknown


def remove_stale_temp_dirs(final: str | os.PathLike) -> tuple[list[Path], list[Path]]:
    """Delete the temporary siblings of `final` whose process is gone; return (removed, left alone)."""
    dead, unknown = stale_temp_dirs(final)
    for p in dead:
        shutil.rmtree(p, ignore_errors=True)
    return dead, unknown


def remove_stale_temp_dirs_beside(final: str | os.PathLike) -> list[Path]:
    """Delete the temporary folders of other destinations in `final`'s folder whose process is gone; return
    them. `final`'s own are `remove_stale_temp_dirs`'s, under the lock its writer holds.

    A folder is left alone while its destination's lock (pagelab/folder_lock.py) is held: a writer on
    another machine sharing the folder has a pid that means nothing here, but it holds that lock.
    """
    final = Path(os.path.abspath(final))
    if not final.parent.is_dir():
        return []
    removed = []
    for p, match in _temp_dirs(final.parent):
        if match["name"] == final.name or not _removable(p, match):
            continue
        try:
            with FolderLock(p.with_name(match["name"])):
                shutil.rmtree(p, ignore_errors=True)
        except (FolderBusyError, OSError):
            continue
        if not p.exists():
            removed.append(p)
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
        drop_open_files(tmp)  # the writers of a failed run write nothing more when they are collected
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _swap_in(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):
            raise
        raise replace_error(final, exc) from None


def _swap_in(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`, moving a folder already there aside first; on failure `final` is as before."""
    if not final.exists():
        tmp.rename(final)
        return
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    final.rename(old)
    try:
        tmp.rename(final)
    except OSError:
        with contextlib.suppress(OSError):  # else the previous run stays in `old`, which is never removed
            old.rename(final)
        raise
    shutil.rmtree(old, ignore_errors=True)


class FolderReplaceError(PagelabError):
    """A finished folder could not be renamed into place: its destination cannot be replaced by a rename."""


def replace_error(final: str | os.PathLike, exc: OSError) -> FolderReplaceError:
    """The error naming `final` after renaming a finished folder onto it failed with `exc`."""
    final = Path(final)
    if os.path.ismount(final):
        why = "it is a mount point; choose a folder inside it"
    elif exc.errno == errno.EBUSY:  # Linux's answer for a mount point, which ismount misses for a bind mount
        why = "it is a mount point (or in use by the system); choose a folder inside it"
    else:
        why = exc.strerror or str(exc)
    return FolderReplaceError(f"the output folder {final} cannot be replaced: {why}")

"""One writer per output folder: an flock on `.NAME.lock` beside the folder, taken before any work.

The operating system releases an flock when its process ends, however it ends (SIGKILL, out of memory, a
lost machine), so a crashed writer never leaves a lock that blocks a later run: the file may stay, the
lock does not. The holder writes its pid into the file, so a refused writer can say who holds it. A lock
is released by deleting its file while still holding it; a writer that locked a file someone else then
deleted sees that its file is no longer the one at the path and starts over.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from pagelab.errors import PagelabError


class FolderBusyError(PagelabError):
    """Another process is writing the folder: this one refuses at once instead of mixing their files."""

    def __init__(self, folder: Path, detail: str) -> None:
        super().__init__(f"{folder}: {detail}")
        self.detail = detail  # the message without the folder's name


def lock_path(folder: str | os.PathLike) -> Path:
    """The lock file of `folder`: `.NAME.lock` in its parent."""
    folder = Path(os.path.abspath(folder))
    return folder.with_name(f".{folder.name}.lock")


def _holder(path: Path) -> str:
    """' (pid N)' of the process that wrote its pid into the lock file, or '' when it cannot be read."""
    try:
        pid = path.read_text().strip()
    except OSError:
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""


class FolderLock:
    """The exclusive right to write `folder` (see the module docstring); `release` gives it up."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = lock_path(folder)
        self._fd: int | None = None
        self._made: list[Path] = []  # parent folders created for the lock file, deepest last

    @property
    def held(self) -> bool:
        """Whether this process holds the lock."""
        return self._fd is not None

    def acquire(self) -> FolderLock:
        """Take the lock now or raise FolderBusyError (never waits); parent folders are created."""
        if self.held:
            return self
        self._make_parents()
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                self._remove_parents()
                raise FolderBusyError(self.folder, f"another pagelab process{_holder(self.path)} is writing "
                                                   "this folder; wait for it to finish, or choose another "
                                                   "folder") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder released (and deleted) the file we locked: lock the new one
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the lock up and delete its file (and the parent folders made for it, when empty)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)
        os.close(self._fd)
        self._fd = None
        self._remove_parents()

    def _make_parents(self) -> None:
        missing = []
        parent = self.path.parent
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        for folder in reversed(missing):
            with contextlib.suppress(FileExistsError):
                folder.mkdir()
                self._made.append(folder)

    def _remove_parents(self) -> None:
        """The folders made for the lock file, if the run put nothing in them."""
        for folder in reversed(self._made):
            with contextlib.suppress(OSError):
                folder.rmdir()
        self._made = []

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# The locks a command holds until it returns (cli.common.user_errors releases them); the OS releases them
# if the process dies first.
_HELD: dict[Path, FolderLock] = {}


def hold(folder: str | os.PathLike) -> FolderLock:
    """Take `folder`'s lock (FolderBusyError if another process has it) and keep it until `release_held`."""
    key = lock_path(folder)
    if key not in _HELD:
        _HELD[key] = FolderLock(folder).acquire()
    return _HELD[key]


def release_held() -> None:
    """Release every lock taken with `hold`."""
    while _HELD:
        _, lock = _HELD.popitem()
        lock.release()

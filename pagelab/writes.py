"""Every file pagelab writes is opened here (`open_out`), so a full disk is reported the same way everywhere.

Parquet (pyarrow takes a Python file object), CSV, JSON, spool files and figures all write through
`OutFile`, which counts the bytes it wrote and turns the operating system's "no space left on device"
(ENOSPC, or EDQUOT for a quota) into a `DiskFullError`: one line naming the file, the bytes written to it
and the space left on its file system. Whoever was writing then drops its temporary file or folder
(pagelab/atomic.py), so a full disk leaves the previous result in place and nothing half-written.

Test hook: the environment variable PAGELAB_TEST_DISK_FULL="N" (or "N:TEXT") makes the writes of this
process fail with ENOSPC once N bytes have been written (counting only files whose destination path
contains TEXT); `limit_disk` does the same within a `with` block. Nothing sets it outside the tests.
"""
from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import shutil
import weakref
from collections.abc import Iterator
from pathlib import Path

from pagelab.errors import PagelabError

TEST_DISK_FULL_ENV = "PAGELAB_TEST_DISK_FULL"
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# Temporary names of pagelab/atomic.py (`.NAME.tmp-PID-HEX` folders, `.NAME.PID.HEX.SUFFIX` files) and of a
# Parquet table's single part (`.NAME.part`): a message names the destination, which is what the user knows.
_TEMP_DIR = re.compile(r"^\.(.+)\.tmp-\d+-[0-9a-f]{8}$")
_TEMP_FILE = re.compile(r"^\.(.+)\.\d+\.[0-9a-f]{8}\.[A-Za-z0-9]+$")
_PART_FILE = re.compile(r"^\.(.+)\.part$")


class DiskFullError(PagelabError):
    """The file system ran out of space (or quota) while pagelab wrote a file; the message says which."""


def destination(path: str | os.PathLike) -> Path:
    """`path` with the temporary names of atomic writes replaced by the names they become."""
    parts = []
    for part in Path(path).parts:
        match = _TEMP_DIR.match(part) or _TEMP_FILE.match(part) or _PART_FILE.match(part)
        parts.append(match.group(1) if match else part)
    return Path(*parts) if parts else Path(path)


def space_left(path: str | os.PathLike) -> int | None:
    """Free bytes on the file system holding `path` (its nearest existing folder); None if unknown."""
    place = Path(os.path.abspath(path))
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        return shutil.disk_usage(place).free
    except OSError:
        return None


def _size(n: int) -> str:
    """Bytes as a short human figure."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def disk_full(path: str | os.PathLike, written: int | None = None) -> DiskFullError:
    """The one-line error for a full file system while writing `path` (`written` bytes of it so far)."""
    free = space_left(path)
    left = "unknown space" if free is None else _size(free)
    wrote = "" if written is None else f" after {_size(written)} of it"
    return DiskFullError(f"disk full: writing {destination(path)} failed{wrote}; {left} left on its file "
                         "system. Nothing was replaced: free some space or write elsewhere")


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` is the operating system's "no space left" (or "quota exceeded")."""
    return isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS


class _Limit:
    """The test hook's state: bytes still allowed (None: no limit) for paths containing `match`."""

    def __init__(self, spec: str | None) -> None:
        self.left: int | None = None
        self.match = ""
        if spec:
            count, _, self.match = spec.partition(":")
            self.left = int(count)

    def allow(self, path: str, n: int) -> int:
        """How many of `n` bytes to `path` may still be written."""
        if self.left is None or (self.match and self.match not in str(destination(path))):
            return n
        allowed = min(n, self.left)
        self.left -= allowed
        return allowed


_LIMIT = _Limit(os.environ.get(TEST_DISK_FULL_ENV))


@contextlib.contextmanager
def limit_disk(nbytes: int, match: str = "") -> Iterator[None]:
    """Test hook: within the block, writes fail with ENOSPC after `nbytes` bytes (to paths containing
    `match`)."""
    global _LIMIT
    saved, _LIMIT = _LIMIT, _Limit(f"{nbytes}:{match}")
    try:
        yield
    finally:
        _LIMIT = saved


# Every OutFile not yet collected: a failed run's files are closed through here (`drop_open_files`).
_OPEN: weakref.WeakSet = weakref.WeakSet()


class OutFile(io.RawIOBase):
    """A file opened for writing from scratch, unbuffered: every write reaches the OS at once, is counted
    (`written`), and a full disk raises `DiskFullError`; after a failed write, or once closed, writes are
    dropped (see `write`). It has no `fileno`: writers that would write to the descriptor directly (Pillow)
    write through `write` instead."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.written = 0
        self.failed = False  # a write failed: the file is incomplete and further writes are dropped
        _OPEN.add(self)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0),
                               0o666)
        except OSError as exc:
            if is_disk_full(exc):
                raise disk_full(self.path, 0) from None
            raise

    def writable(self) -> bool:
        """Always: the file is open for writing."""
        return True

    def write(self, data) -> int:
        """Write all of `data` (bytes-like); DiskFullError when the file system is full."""
        view = memoryview(data).cast("B")
        n = len(view)
        if self.closed or self.failed:
            # A writer collected after an error or after the file closed (pyarrow's writers write their
            # footer when collected) writes into a file that is discarded anyway; an exception raised in a
            # garbage collection can reach C code that does not expect one (CPython 3.11's AST
            # constructor fails with "recursion depth mismatch").
            return n
        allowed = _LIMIT.allow(self.path, n)
        done = 0
        try:
            while done < allowed:
                done += os.write(self._fd, view[done:allowed])
            if allowed < n:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        except OSError as exc:
            self.written += done
            self.failed = True
            if is_disk_full(exc):
                raise disk_full(self.path, self.written) from None
            raise
        self.written += done
        return n

    def tell(self) -> int:
        """Bytes written so far (the file is only ever appended to)."""
        return self.written

    def close(self) -> None:
        """Close the descriptor (once)."""
        if not self.closed:
            try:
                os.close(self._fd)
            finally:
                super().close()


def drop_open_files(under: str | os.PathLike | None = None) -> None:
    """Close the files still open under the folder `under` (every one: None) without finishing them.

    A failed run's writers are collected later, and pyarrow's then write their footers: into a closed file
    those writes are dropped, where on a full disk they would fail again, each printing a traceback.
    """
    prefix = None if under is None else os.path.join(os.fspath(under), "")
    for f in list(_OPEN):
        if prefix is None or f.path.startswith(prefix):
            f.close()


def open_out(path: str | os.PathLike) -> OutFile:
    """A new (or emptied) file at `path`, written through the disk-full handling above."""
    return OutFile(path)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """`data` as the whole content of `path`."""
    with open_out(path) as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    """`text` (UTF-8) as the whole content of `path`."""
    write_bytes(path, text.encode("utf-8"))


def write_parquet(path: str | os.PathLike, df) -> None:
    """A DataFrame as one Parquet file (pandas' defaults, no index)."""
    with open_out(path) as f:
        df.to_parquet(f, index=False)

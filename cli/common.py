"""Shared CLI helpers: user-facing errors and atomic output folders."""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import typer
from rich.console import Console

# Piped output gets a wide console so tables are not squeezed to 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, soft_wrap=True)


class UserError(Exception):
    """A problem with the user's input: printed without a traceback, exit code 2."""


def user_errors(func: Callable) -> Callable:
    """Turn the project's input errors into a one-line message and exit code 2."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except _user_error_types() as exc:
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
            raise typer.Exit(code=2) from None

    return wrapper


def _user_error_types() -> tuple[type[BaseException], ...]:
    """The exception types that mean 'the user gave bad input'."""
    types: list[type[BaseException]] = [UserError, FileNotFoundError]
    for mod, name in (("traces.errors", "TraceError"), ("simulator.errors", "PagelabError"),
                      ("viz.errors", "VizError")):
        with contextlib.suppress(ImportError, AttributeError):
            types.append(getattr(__import__(mod, fromlist=[name]), name))
    return tuple(types)


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; rename it to `final` only if the block completes.

    An interrupted or failed run leaves no half-written folder behind: either the complete
    result replaces `final`, or nothing changes.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write a file via a temporary name and rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise

"""Shared CLI helpers: consoles and user-facing errors."""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import typer
from rich.console import Console

from pagelab.atomic import atomic_dir, atomic_write_bytes  # noqa: F401  (re-exported for commands)
from pagelab.errors import PagelabError

# Piped output gets a wide console so tables are not squeezed to 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, soft_wrap=True)


class UserError(PagelabError):
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
    return (UserError, FileNotFoundError, PagelabError)

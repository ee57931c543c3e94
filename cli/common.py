"""Shared CLI helpers: consoles, user-facing errors and warnings, comma lists, progress, saved results."""
from __future__ import annotations

import contextlib
import errno
import functools
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from pagelab.atomic import atomic_dir  # noqa: F401  (re-exported for commands)
from pagelab.errors import PagelabError
from pagelab.folder_lock import release_held

# Piped output gets a wide console unless COLUMNS says otherwise; a terminal keeps its own width.
console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160, highlight=False,
                  emoji=False)
err_console = Console(stderr=True, soft_wrap=True, highlight=False, emoji=False)


class UserError(PagelabError):
    """A problem with the user's input: printed without a traceback, exit code 2."""


def user_errors(func: Callable) -> Callable:
    """Turn the project's input errors into a one-line message and exit code 2."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except _user_error_types() as exc:
            # User text (file names, cells) may contain [ ] or :x:; print it literally, never as markup.
            message = " ".join(str(exc).split("\n"))
            if isinstance(exc, PagelabError) and exc.names_fields:
                message = _as_options(message, func)
            err_console.print(f"[bold red]error:[/] {escape(message)}", emoji=False)
            raise typer.Exit(code=2) from None
        except OSError as exc:
            from pagelab.writes import destination, disk_full, is_disk_full

            if is_disk_full(exc):  # a full disk met outside pagelab.writes (mkdir, rename)
                message = str(disk_full(exc.filename or "."))
            elif exc.errno in _PATH_ERRNOS and exc.filename:
                # A path the checks before the work could not foresee (it changed meanwhile): name the
                # destination (a rename's target), not the temporary name the user never gave.
                message = f"{destination(exc.filename2 or exc.filename)}: {exc.strerror}"
            else:
                raise
            err_console.print(f"[bold red]error:[/] {escape(message)}", emoji=False)
            raise typer.Exit(code=2) from None
        finally:
            release_held()  # the output folders' locks taken by the command (pagelab/folder_lock.py)

    return wrapper


# The operating system refusing a path (permissions, a read-only file system, a folder or file in the way):
# the user's environment, not a bug.
_PATH_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.EISDIR, errno.ENOTDIR, errno.EEXIST)


def _as_options(message: str, command: Callable) -> str:
    """`message` with each field that `command` takes as an option named by that option (the simulator's
    and the engine's configs say max_num_seqs; the user typed --max-num-seqs). Only snake_case names are
    replaced: a one-word field (model, gpu) is also a plain word of the message."""
    import inspect
    import re

    from typer.models import OptionInfo

    for name, param in inspect.signature(command).parameters.items():
        info = param.default
        if "_" not in name or not isinstance(info, OptionInfo):
            continue
        flags = [f for decl in info.param_decls or () for f in decl.split("/") if f.startswith("--")]
        flag = flags[0] if flags else "--" + name.replace("_", "-")
        message = re.sub(rf"(?<![\w-]){name}(?![\w-])", flag, message)
    return message


def _user_error_types() -> tuple[type[BaseException], ...]:
    """The exception types that mean 'the user gave bad input'."""
    return (UserError, FileNotFoundError, PagelabError)


def warn(message: str) -> None:
    """One yellow warning line on stderr; the message is printed literally."""
    err_console.print(f"[yellow]warning:[/] {escape(message)}", emoji=False)


@contextlib.contextmanager
def printing_warnings() -> Iterator[list[str]]:
    """A list for the `warnings=` of trace functions, each printed with `warn` at the end, even when the
    command then fails."""
    warnings: list[str] = []
    try:
        yield warnings
    finally:
        for message in warnings:
            warn(message)


def figure_format(value: str, option: str = "--format") -> str:
    """A figure format option as the figures take it (png, svg or pdf), refused before any work."""
    from viz.common import format_named
    from viz.errors import VizError

    try:
        return format_named(value, f"{option} {value}")
    except VizError as exc:
        raise UserError(str(exc)) from None


def names_list(values: Iterable[str] | None) -> list[str]:
    """Repeated and/or comma-separated option values as one list (`-a paged,contiguous-max -a ...`)."""
    return [x.strip() for v in values or [] for x in str(v).split(",") if x.strip()]


def pick_one(option: str, *values):
    """The one value given among aliases of an option (e.g. --limit / --num-prompts); refuse conflicts."""
    given = [v for v in values if v is not None]
    if len(set(given)) > 1:
        raise UserError(f"{option} given twice with different values: {', '.join(map(str, given))}")
    return given[0] if given else None


class LogProgress:
    """Progress for logs: when stderr is not a terminal, one line per 10% of the work or per minute, and
    a line when it ends; work that ends within `quiet_s` gets only that last line."""

    def __init__(self, label: str, total: int, every_s: float = 60.0, step: float = 0.1,
                 quiet_s: float = 5.0):
        self.label, self.total, self.every_s, self.step = label, max(total, 1), every_s, step
        self.quiet_s = quiet_s
        self.start = self.last_t = time.monotonic()
        self.last_frac = 0.0

    def update(self, done: int) -> None:
        """Print a line when another tenth is done or a minute has passed since the last line."""
        now = time.monotonic()
        frac = done / self.total
        if done >= self.total:
            due = self.last_frac < 1
        else:
            due = now - self.start >= self.quiet_s and (frac - self.last_frac >= self.step
                                                         or now - self.last_t >= self.every_s)
        if due:
            self.last_t, self.last_frac = now, frac
            err_console.print(f"{escape(self.label)}: {done:,}/{self.total:,} ({100 * frac:.0f}%) after "
                              f"{now - self.start:.0f} s", emoji=False)


def stderr_is_terminal() -> bool:
    """Whether stderr is an interactive terminal (then rich draws live bars)."""
    return err_console.is_terminal


def finite_float(value: float | None, option: str, *, minimum: float | None = None) -> float | None:
    """Refuse nan and inf (and values below `minimum`) for a float option; None passes."""
    import math

    if value is None:
        return None
    if not math.isfinite(value):
        raise UserError(f"{option} must be a finite number, got {value}")
    if minimum is not None and value < minimum:
        raise UserError(f"{option} must be >= {minimum:g}, got {value:g}")
    return value


def check_seed(seed: int, option: str = "--seed") -> int:
    """Refuse a seed numpy's generators cannot take (they want a non-negative integer)."""
    if seed < 0:
        raise UserError(f"{option} must be a whole number >= 0, got {seed}")
    return seed


def plot_format(path: Path) -> str:
    """The figure format a --plot path names (viz.common.figure_format), refused before any work."""
    from viz.common import figure_format
    from viz.errors import VizError

    try:
        return figure_format(path)
    except VizError as exc:
        raise UserError(f"--plot {exc}") from None


def model_limit(model) -> int | None:
    """The context of the run's model, when it names one pagelab knows."""
    from simulator.core.errors import ConfigError
    from simulator.core.models import get_model

    try:
        return get_model(str(model)).max_model_len if model else None
    except ConfigError:
        return None


def warn_long_context(model, max_model_len: int) -> None:
    """Warn of a max-model-len past the model's own context, which vLLM refuses (None outside the registry:
    a local config.json's limit is applied when it is read)."""
    own = model_limit(model)
    if own is not None and max_model_len > own:
        warn(f"--max-model-len {max_model_len:,} is longer than {model}'s context of {own:,} tokens (vLLM "
             "refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)")

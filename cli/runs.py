"""Run folders (docs/run-format.md): destination checks, results, self-describing metadata."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rich.markup import escape

from cli.common import UserError, err_console, warn
from pagelab import run_folder
from pagelab.atomic import atomic_write_bytes, remove_stale_temp_dirs, remove_stale_temp_dirs_beside
from pagelab.folder_lock import FolderBusyError, hold
from pagelab.run_folder import (
    RUN_MARKER,
    clean_json,
    run_metadata,
    versions,
    write_json,
    write_run_files,
    write_table,
)

__all__ = ["RUN_MARKER", "check_out", "check_out_file", "check_out_folder", "check_result_options",
           "clean_json", "is_run_folder", "lock_out", "run_metadata", "save_result", "versions", "write_json",
           "write_run", "write_run_files", "write_table"]


def is_run_folder(path: Path) -> bool:
    """Whether `path` holds a pagelab run (run.json, or summary.json with allocators from older versions)."""
    if (path / RUN_MARKER).is_file():
        return True
    try:
        return "allocators" in json.loads((path / "summary.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def check_out(out: Path, overwrite: bool) -> Path:
    """Refuse, before any work, a destination we must not or cannot replace; returns the resolved path.

    A regular file, a folder that is not a pagelab run (and not empty), and an existing run without
    --overwrite are refused; so is a place where no folder can be created, and a folder another pagelab
    process is writing (its lock, pagelab/folder_lock.py, is held until the command returns). Temporary
    folders that killed runs left beside it, for it or another destination, are removed with a warning.
    """
    text = str(out)
    target = Path(os.path.abspath(out))
    if target == Path(target.anchor) or target == Path.home():
        raise UserError(f"--out {text}: refusing to write a run folder over {target}")
    if (target.exists() or target.is_symlink()) and not target.is_dir():
        raise UserError(f"--out {text} is a file, not a folder; choose a folder path for the run")
    if os.path.ismount(target):  # the run is written beside it and renamed into place, which a mount refuses
        raise UserError(f"--out {text} is a mount point, so the output folder cannot be replaced there; "
                        "choose a folder inside it")
    _check_creatable(f"--out {text}", target.parent, "folders")
    lock_out(out)  # before the checks of what the folder holds: a run that finishes meanwhile is seen
    if target.exists() or target.is_symlink():
        entries = sorted(p.name for p in target.iterdir())
        if entries and not is_run_folder(target):
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise UserError(f"--out {text} is a folder that is not a pagelab run (it holds {shown}); "
                            "pagelab will not replace it: choose a new or empty folder")
        if entries and not overwrite:
            raise UserError(f"--out {text} already holds a pagelab run; pass --overwrite to replace it, "
                            "or choose another folder")
    removed, unknown = remove_stale_temp_dirs(target)
    removed += remove_stale_temp_dirs_beside(target)
    for stale in removed:
        warn(f"removed {stale}, left behind by a killed run")
    for stale in unknown:
        warn(f"{stale} looks left behind by an earlier run; delete it if no run is writing it")
    return target


def lock_out(out: Path) -> None:
    """Take --out's lock until the command returns, or refuse at once: another process is writing it."""
    try:
        hold(out)
    except FolderBusyError as exc:
        raise UserError(f"--out {out}: {exc.detail}") from None


def check_out_file(path: Path, label: str) -> Path:
    """Refuse, before any work, a file destination that is a folder or where no file can be created (a
    read-only file system, a file in the way); `label` names it in the message (the option, or the path)."""
    if Path(path).name in ("", ".", ".."):
        raise UserError(f"{label}: expected the path of a file, got {str(path)!r}")
    target = Path(os.path.abspath(path))
    if target.is_dir():
        raise UserError(f"{label} is a folder, not a file; choose a file path")
    run = _run_owning(Path(os.path.realpath(target)))
    if run is not None:
        raise UserError(f"{label} is one of the files of the pagelab run in {run}; writing it would corrupt "
                        "the run: choose a path outside it")
    _check_creatable(label, target.parent, "files")
    return target


def _run_owning(target: Path) -> Path | None:
    """The run folder whose own data `target` is (its run.json or summary.json, or any path in one of its
    allocator folders), or None; files a run only gathers beside its data (trace.json, view.html, also
    those of one allocator in its folder) are not."""
    for run in target.parents:
        if not is_run_folder(run):
            continue  # a run may sit inside another folder (a sweep's points): look further up
        first, *rest = target.relative_to(run).parts
        if not rest and first in (RUN_MARKER, "summary.json"):
            return run
        if rest and rest not in (["trace.json"], ["view.html"]) and \
                any((run / first / name).is_file() for name in ("config.json", "summary.json")):
            return run
    return None


def check_out_folder(path: Path, label: str) -> Path:
    """Refuse, before any work, a folder to write files into that is a file, or where no file can be
    created; existing files in it are replaced one by one (figures)."""
    target = Path(os.path.abspath(path))
    if (target.exists() or target.is_symlink()) and not target.is_dir():
        raise UserError(f"{label} is a file, not a folder; choose a folder path")
    _check_creatable(label, target, "files")
    return target


def _check_creatable(label: str, folder: Path, what: str) -> None:
    """Refuse a destination whose `folder` (or its nearest existing folder above) is a file, or where no
    `what` (files or folders) can be created."""
    parent = folder
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{label}: cannot create a {what[:-1]} under {parent}, which is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{label}: no permission to create {what} in {parent}")
    probe = parent / f".pagelab-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        raise UserError(f"{label}: cannot create {what} in {parent} ({exc.strerror or exc})") from None


def write_run(out: Path, trace_info: dict, results: dict, table_format: str = "parquet", *,
              metadata: dict | None = None, extra_summary: dict | None = None) -> Path:
    """`pagelab.run_folder.write_run`, with a write failure (disk full, permissions) as a user error."""
    try:
        return run_folder.write_run(out, trace_info, results, table_format, metadata=metadata,
                                    extra_summary=extra_summary)
    except OSError as exc:
        raise UserError(f"cannot write the run folder {out}: {exc.strerror or exc}") from None


def check_result_options(result_dir: Path | None, result_filename: str | None) -> None:
    """Refuse, before any work, a --result-dir or --result-filename no result file can be written to."""
    if result_dir is not None:
        check_out_folder(result_dir, f"--result-dir {result_dir}")
    if result_filename is not None:
        label = f"--result-filename {result_filename}"
        if not result_filename.strip() or result_filename.endswith(("/", os.sep)):
            raise UserError(f"{label}: expected the name of a file, got {result_filename!r}")
        check_out_file(Path(result_dir or ".") / result_filename, label)


def save_result(command: str, payload: dict, *, save: bool, result_dir: Path | None,
                result_filename: str | None) -> Path | None:
    """Write the command's result JSON (vLLM's --save-result/--result-dir/--result-filename) atomically."""
    if not save and result_dir is None and result_filename is None:
        return None
    name = result_filename or f"pagelab-{command.replace(' ', '-')}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path = Path(result_dir or ".") / name
    if path.is_dir():
        raise UserError(f"--result-filename {name}: {path} is a folder")
    data = {**run_metadata(command), **payload}
    try:
        atomic_write_bytes(path, (json.dumps(clean_json(data), indent=2) + "\n").encode())
    except OSError as exc:
        raise UserError(f"cannot write the result {path}: {exc.strerror or exc}") from None
    err_console.print(f"saved result {escape(str(path))}", emoji=False)
    return path

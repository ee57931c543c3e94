"""Run folders (docs/run-format.md): destination checks, results, self-describing metadata."""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pandas as pd
from rich.markup import escape

from cli.common import UserError, atomic_dir, err_console, warn
from pagelab.atomic import atomic_write_bytes, remove_stale_temp_dirs

RUN_MARKER = "run.json"  # top-level metadata; its presence makes a folder a pagelab run


def clean_json(obj):
    """JSON-safe copy: NaN/inf become null, numpy scalars become Python numbers."""
    if isinstance(obj, dict):
        return {str(k): clean_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_json(v) for v in obj]
    if hasattr(obj, "item"):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj



def _version_of(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def versions() -> dict:
    """pagelab, Python, torch, numpy and pandas versions (read from metadata: nothing heavy is imported)."""
    return {"pagelab": _version_of("pagelab") or "unknown", "python": platform.python_version(),
            "torch": _version_of("torch"), "numpy": _version_of("numpy"), "pandas": _version_of("pandas")}


def run_metadata(command: str) -> dict:
    """Who made a result and how: command line, UTC timestamp, versions."""
    argv = [Path(sys.argv[0]).name if sys.argv[0] not in ("-c", "") else "pagelab", *sys.argv[1:]]
    return {"pagelab_run": 1, "command": command, "argv": argv,
            "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": versions()}


def trace_hash(source: str) -> str | None:
    """sha256 of the trace file behind a path or bundled name (None for generated traces)."""
    from traces.loaders import resolve_trace

    try:
        path, _ = resolve_trace(source)
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except (OSError, ValueError):
        return None
    return "sha256:" + digest.hexdigest()


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
    --overwrite are refused; so is a place where no folder can be created.
    """
    text = str(out)
    target = Path(os.path.abspath(out))
    if target == Path(target.anchor) or target == Path.home():
        raise UserError(f"--out {text}: refusing to write a run folder over {target}")
    if target.exists() or target.is_symlink():
        if not target.is_dir():
            raise UserError(f"--out {text} is a file, not a folder; choose a folder path for the run")
        entries = sorted(p.name for p in target.iterdir())
        if entries and not is_run_folder(target):
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise UserError(f"--out {text} is a folder that is not a pagelab run (it holds {shown}); "
                            "pagelab will not replace it: choose a new or empty folder")
        if entries and not overwrite:
            raise UserError(f"--out {text} already holds a pagelab run; pass --overwrite to replace it, "
                            "or choose another folder")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"--out {text}: cannot create a folder under {parent}, which is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--out {text}: no permission to create folders in {parent}")
    probe = parent / f".pagelab-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        raise UserError(f"--out {text}: cannot create folders in {parent} ({exc.strerror or exc})") from None
    for stale in remove_stale_temp_dirs(target):
        warn(f"removed {stale}, left behind by a killed run")
    return target


def write_json(path: Path, obj) -> None:
    """Pretty, JSON-safe output."""
    path.write_text(json.dumps(clean_json(obj), indent=2) + "\n")


def write_table(df: pd.DataFrame, path_stem: Path, fmt: str) -> None:
    """A table as Parquet (default) or CSV."""
    if fmt == "csv":
        df.to_csv(path_stem.with_suffix(".csv"), index=False)
    else:
        df.to_parquet(path_stem.with_suffix(".parquet"), index=False)


def write_run(out: Path, trace_info: dict, results: dict, table_format: str = "parquet", *,
              metadata: dict | None = None, extra_summary: dict | None = None) -> Path:
    """Write every allocator's result under `out`, all at once (temporary folder, then rename).

    `results` maps allocator name to an object with config, summary, requests, memory and events;
    `metadata` (command line, versions, trace hash, config) becomes OUT/run.json.
    """
    try:
        with atomic_dir(out) as tmp:
            for name, res in results.items():
                d = tmp / name
                d.mkdir()
                write_json(d / "config.json", res.config)
                write_json(d / "summary.json", res.summary)
                write_table(res.requests, d / "requests", table_format)
                write_table(res.memory, d / "memory", table_format)
                write_table(res.events, d / "events", table_format)
                steps = getattr(res, "steps", None)  # replays: one row per engine step (pagelab calibrate)
                if steps is not None:
                    write_table(steps, d / "steps", table_format)
            write_json(tmp / "summary.json", {"trace": trace_info, **(extra_summary or {}),
                                              "allocators": {n: r.summary for n, r in results.items()}})
            write_json(tmp / RUN_MARKER, {**(metadata or run_metadata("run")), "trace": trace_info,
                                          "allocators": list(results)})
    except OSError as exc:
        raise UserError(f"cannot write the run folder {out}: {exc.strerror or exc}") from None
    return out


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

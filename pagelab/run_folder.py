"""Writing run folders (docs/run-format.md): the same layout for simulated, measured and swept runs.

Library code (the sweep workers) writes folders through here; `cli.runs` adds the command-line checks
(destinations, overwrite rules) and re-exports these.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pandas as pd

from pagelab import __version__, run_format
from pagelab.atomic import atomic_dir
from pagelab.writes import open_out, write_text

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
    """pagelab, Python, torch, numpy and pandas versions (libraries' from metadata: none imported)."""
    # pagelab's own from the code that runs: an editable install's metadata keeps the version it was
    # installed at.
    return {"pagelab": __version__, "python": platform.python_version(),
            "torch": _version_of("torch"), "numpy": _version_of("numpy"), "pandas": _version_of("pandas")}


def run_metadata(command: str) -> dict:
    """Who made a result and how: command line, UTC timestamp, versions."""
    argv = [Path(sys.argv[0]).name if sys.argv[0] not in ("-c", "") else "pagelab", *sys.argv[1:]]
    return {"pagelab_run": 1, "command": command, "argv": argv,
            "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": versions()}


def write_json(path: Path, obj) -> None:
    """Pretty, JSON-safe output."""
    write_text(path, json.dumps(clean_json(obj), indent=2) + "\n")


_WRITE_ROWS = 1 << 20  # rows per Parquet write (pyarrow's default row group)


def write_table(df: pd.DataFrame, path_stem: Path, fmt: str) -> None:
    """A table as Parquet (default) or CSV."""
    if fmt == "csv":
        with open_out(path_stem.with_suffix(".csv")) as f:
            df.to_csv(f, index=False)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Converted and written a slice at a time: Arrow holds one slice, not a second copy of the table.
    schema = pa.Schema.from_pandas(df, preserve_index=False)  # of the whole table: slices may lack values
    with open_out(path_stem.with_suffix(".parquet")) as f, pq.ParquetWriter(f, schema) as writer:
        for start in range(0, max(len(df), 1), _WRITE_ROWS):
            writer.write_table(pa.Table.from_pandas(df.iloc[start:start + _WRITE_ROWS], schema=schema,
                                                    preserve_index=False))


def _empty(columns: dict[str, str]) -> pd.DataFrame:
    """A table with no rows and the run format's column types."""
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in columns.items()})


def write_run_files(tmp: Path, trace_info: dict, results: dict, table_format: str = "parquet", *,
                    metadata: dict | None = None, extra_summary: dict | None = None) -> None:
    """Write every allocator's result into the (temporary) run folder `tmp`.

    `results` maps allocator name to an object with config, summary, requests, memory and events (and
    `steps` for replays); requests, memory or events None means the run streamed that table into
    tmp/NAME/ already (simulate's sinks). `metadata` (command line, versions, trace hash, config)
    becomes run.json.
    """
    for name, res in results.items():
        d = tmp / name
        d.mkdir(exist_ok=True)
        write_json(d / "config.json", res.config)
        write_json(d / "summary.json", res.summary)
        for table in ("requests", "memory", "events"):
            df = getattr(res, table)
            if df is not None:
                write_table(df, d / table, table_format)
            elif any(d.glob(f"{table}.*")):
                continue
            elif table == "events" and res.config.get("record_events") is False:
                # A run that recorded no tenures (--no-events) still has the table, with no rows.
                write_table(_empty(run_format.EVENT_COLUMNS), d / table, table_format)
            else:
                raise FileNotFoundError(f"{d}: the streamed {table} table is missing")
        for table in ("transitions", "refcounts"):  # None: streamed already, or not recorded
            df = getattr(res, table, None)
            if df is not None:
                write_table(df, d / table, table_format)
        steps = getattr(res, "steps", None)  # replays: one row per engine step (pagelab calibrate)
        if steps is not None:
            write_table(steps, d / "steps", table_format)
    write_json(tmp / "summary.json", {"trace": trace_info, **(extra_summary or {}),
                                      "allocators": {n: r.summary for n, r in results.items()}})
    write_json(tmp / RUN_MARKER, {**(metadata or run_metadata("run")), "trace": trace_info,
                                  "allocators": list(results)})


def write_run(out: Path, trace_info: dict, results: dict, table_format: str = "parquet", *,
              metadata: dict | None = None, extra_summary: dict | None = None) -> Path:
    """Write every allocator's result under `out`, all at once (temporary folder, then rename)."""
    with atomic_dir(out) as tmp:
        write_run_files(tmp, trace_info, results, table_format, metadata=metadata,
                        extra_summary=extra_summary)
    return out

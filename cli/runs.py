"""Writing run folders (docs/run-format.md): the same layout for simulated and measured runs."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
from rich.markup import escape

from cli.common import atomic_dir, err_console
from pagelab.atomic import remove_stale_temp_dirs


def _clean(obj):
    """JSON-safe copy: NaN/inf become null, numpy scalars become Python numbers."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "item"):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json(path: Path, obj) -> None:
    """Pretty, JSON-safe output."""
    path.write_text(json.dumps(_clean(obj), indent=2) + "\n")


def write_table(df: pd.DataFrame, path_stem: Path, fmt: str) -> None:
    """A table as Parquet (default) or CSV."""
    if fmt == "csv":
        df.to_csv(path_stem.with_suffix(".csv"), index=False)
    else:
        df.to_parquet(path_stem.with_suffix(".parquet"), index=False)


def clear_stale_temps(out: Path) -> None:
    """Delete the temporary folders killed runs left next to `out`, saying so; report unknown ones."""
    removed, unknown = remove_stale_temp_dirs(out)
    for p in removed:
        err_console.print(f"[yellow]warning:[/] removed {escape(str(p))} (left by a killed run)",
                          highlight=False)
    for p in unknown:
        err_console.print(f"[yellow]warning:[/] {escape(str(p))} looks left by an earlier run; delete it "
                          "if no run is writing it", highlight=False)


def write_run_files(tmp: Path, trace_info: dict, results: dict, table_format: str = "parquet") -> None:
    """Write every allocator's result into the (temporary) run folder `tmp`.

    `results` maps allocator name to an object with config, summary, requests, memory and events;
    memory or events None means the run streamed that table into tmp/NAME/ already (simulate's sinks).
    """
    for name, res in results.items():
        d = tmp / name
        d.mkdir(exist_ok=True)
        write_json(d / "config.json", res.config)
        write_json(d / "summary.json", res.summary)
        write_table(res.requests, d / "requests", table_format)
        for table in ("memory", "events"):
            df = getattr(res, table)
            if df is not None:
                write_table(df, d / table, table_format)
            elif not any(d.glob(f"{table}.*")):
                raise FileNotFoundError(f"{d}: the streamed {table} table is missing")
    write_json(tmp / "summary.json", {"trace": trace_info,
                                      "allocators": {n: r.summary for n, r in results.items()}})


def write_run(out: Path, trace_info: dict, results: dict, table_format: str = "parquet") -> Path:
    """Write every allocator's result under `out`, all at once (temporary folder, then rename)."""
    with atomic_dir(out) as tmp:
        write_run_files(tmp, trace_info, results, table_format)
    return out

"""Load, detect and save traces; the bundled sample traces.

Format detection looks at the content first (Parquet magic bytes, a JSON object on the first line, or
the CSV header's column names) and falls back on the extension only for Parquet. Warnings (fixed
problems such as re-sorted arrivals or dropped failed requests) go to the `warnings` list when one is
passed, else they are issued as `traces.schema.TraceWarning`.
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd

import traces.formats as formats
from pagelab.atomic import atomic_write
from pagelab.writes import open_out
from traces.errors import TraceError
from traces.schema import RawTrace, _validate, validate_trace

_DATA = Path(__file__).resolve().parent / "data"
BUNDLED: dict[str, Path] = {
    "azure-conv": _DATA / "AzureLLMInferenceTrace_conv.csv",
    "azure-code": _DATA / "AzureLLMInferenceTrace_code.csv",
    "mooncake-conv": _DATA / "mooncake_conversation_trace.jsonl",
}

FORMATS: dict[str, Callable[[Path, str, list[str] | None], RawTrace]] = {
    "azure": formats.azure,
    "vidur": formats.vidur,
    "burstgpt": formats.burstgpt,
    "mooncake": formats.mooncake,
    "csv": formats.pagelab_csv,
    "jsonl": formats.pagelab_jsonl,
    "parquet": formats.pagelab_parquet,
}

# Header columns that identify each CSV format; the best overlap wins, so a file missing one column
# is still recognised and then refused with "missing column" rather than "unknown format".
_CSV_SIGNATURES = {
    "azure": {"TIMESTAMP", "ContextTokens", "GeneratedTokens"},
    "vidur": {"arrived_at", "num_prefill_tokens", "num_decode_tokens"},
    "burstgpt": {"Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"},
    "csv": {"request_id", "arrival_s", "prompt_len", "output_len", "n", "beam_width", "prefix_blocks"},
}
_MOONCAKE_KEYS = {"timestamp", "input_length", "output_length", "hash_ids"}
_PAGELAB_KEYS = {"request_id", "arrival_s", "prompt_len", "output_len"}


def default_trace_path() -> Path:
    """The bundled Azure 2023 conversation trace, replayed when no trace is named."""
    return BUNDLED["azure-conv"]


def resolve_trace(path: str | os.PathLike) -> tuple[Path, str]:
    """A trace argument (a path or a BUNDLED name) as (file path, name to use in messages)."""
    text = os.fspath(path)
    if text in BUNDLED and not Path(text).exists():
        return BUNDLED[text], f"{text} ({BUNDLED[text].name})"
    p = Path(text)
    if not p.exists():
        raise TraceError(f"{text}: no such file (bundled traces: {', '.join(BUNDLED)})")
    if p.is_dir():
        raise TraceError(f"{text}: is a folder, not a trace file")
    return p, text


HASH_READ_BYTES = 1 << 16


def trace_hash(source: str) -> str | None:
    """sha256 of the trace file behind a path or bundled name (None for generated traces)."""
    try:
        path, _ = resolve_trace(source)
        digest = hashlib.sha256()
        # Into one small buffer: reading 1 MiB chunks makes a new 1 MiB object each, which would set a
        # 10M run's peak at its very end.
        buffer = bytearray(HASH_READ_BYTES)
        view = memoryview(buffer)
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                digest.update(view[:n])
    except (OSError, ValueError):
        return None
    return "sha256:" + digest.hexdigest()


def _first_line(path: Path, source: str) -> str:
    """The first non-blank line of a text file."""
    try:
        with open(path, encoding="utf-8-sig") as fh:
            for line in fh:
                if line.strip():
                    return line.strip()
    except UnicodeDecodeError:
        raise TraceError(f"{source}: unknown trace format (not a text file and not Parquet)") from None
    raise TraceError(f"{source}: empty file")


def detect_format(path: str | os.PathLike, source: str | None = None) -> str:
    """The FORMATS name for a trace file, judged by its first bytes, first line or header."""
    path = Path(path)
    source = source or str(path)
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if not magic:
        raise TraceError(f"{source}: empty file")
    if magic == b"PAR1" or path.suffix.lower() in (".parquet", ".pq"):
        return "parquet"
    first = _first_line(path, source)
    if first.startswith("{"):
        try:
            keys = set(json.loads(first))
        except (json.JSONDecodeError, TypeError):
            raise TraceError(f"{source} line 1: looks like JSON lines but is not valid JSON") from None
        if keys & {"input_length", "output_length", "hash_ids"}:
            return "mooncake"
        if keys & _PAGELAB_KEYS:
            return "jsonl"
        raise TraceError(f"{source}: unknown trace format (JSON keys: {', '.join(sorted(keys))}); "
                         f"known formats: {', '.join(FORMATS)}")
    header = {c.strip() for c in next(csv.reader([first]))}
    scores = {name: len(header & sig) for name, sig in _CSV_SIGNATURES.items()}
    best = max(scores, key=scores.get)
    if scores[best] == 0:
        raise TraceError(f"{source}: unknown trace format (header: {first[:200]}); known formats: "
                         f"{', '.join(FORMATS)}")
    return best


def load_trace(path: str | os.PathLike, format: str = "auto", *,
               warnings: list[str] | None = None) -> pd.DataFrame:
    """Load a trace file or BUNDLED name as a canonical, validated DataFrame."""
    file, source = resolve_trace(path)
    with _os_errors(source, "read"):
        fmt = detect_format(file, source) if format == "auto" else format
        if fmt not in FORMATS:
            raise TraceError(f"{source}: unknown format {fmt!r}; choose from auto, {', '.join(FORMATS)}")
        raw = FORMATS[fmt](file, source, warnings)
    return _validate(raw, source, warnings)


@contextlib.contextmanager
def _os_errors(source: str, verb: str) -> Iterator[None]:
    """Report permission problems and the like as TraceError (a user problem, not a crash)."""
    try:
        yield
    except OSError as exc:
        raise TraceError(f"{source}: cannot {verb} the file: {exc.strerror or exc}") from None


def load_length_pairs(path: str | os.PathLike, *, warnings: list[str] | None = None) -> pd.DataFrame:
    """The (prompt_len, output_len) pairs of any trace, including Vidur's length-only CSV files."""
    file, source = resolve_trace(path)
    fmt = detect_format(file, source)
    if fmt == "vidur":
        df = formats.read_csv(file, source)
        if "arrived_at" not in df.columns:
            df["arrived_at"] = 0.0  # lengths only: the caller synthesizes arrivals
            raw = formats.csv_raw(df, formats.VIDUR, relative_time=False)
            return _validate(raw, source, warnings)[["prompt_len", "output_len"]]
    return load_trace(file, fmt, warnings=warnings)[["prompt_len", "output_len"]]


def save_trace(df: pd.DataFrame, path: str | os.PathLike, *, warnings: list[str] | None = None) -> Path:
    """Validate and write a trace as .csv, .jsonl or .parquet (by extension), via a temporary name."""
    path = Path(path)
    writer = _WRITERS.get(path.suffix.lower())
    if writer is None:
        raise TraceError(f"{path}: cannot save a trace as {path.suffix or 'a file without extension'!r}; "
                         "use .csv, .jsonl or .parquet")
    trace = validate_trace(df, source="trace to save", warnings=warnings)
    with _os_errors(str(path), "write"):
        atomic_write(path, lambda tmp: writer(trace, tmp))
    return path


def _write_csv(trace: pd.DataFrame, path: Path) -> None:
    """CSV with prefix_blocks as space-separated keys; floats use repr so they read back exactly."""
    out = trace.copy()
    if "prefix_blocks" in out:
        out["prefix_blocks"] = [" ".join(map(str, keys)) for keys in out["prefix_blocks"]]
    with open_out(path) as f:
        out.to_csv(f, index=False)


def _write_jsonl(trace: pd.DataFrame, path: Path) -> None:
    """One JSON object per request, formatted directly (json.dumps per row is several times slower)."""
    cols = list(trace.columns)
    values = [trace[c].tolist() for c in cols]
    if "prefix_blocks" in trace.columns:
        i = cols.index("prefix_blocks")
        values[i] = ["[" + ",".join(map(str, keys)) + "]" for keys in values[i]]
    # Every value is an int, a finite float (repr round-trips and is valid JSON) or a JSON list.
    template = "{{" + ",".join(f'"{c}":{{}}' for c in cols) + "}}\n"
    floats = [i for i, c in enumerate(cols) if trace[c].dtype.kind == "f"]
    for i in floats:
        values[i] = list(map(repr, values[i]))
    with open_out(path) as raw, io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8") as fh:
        fh.writelines(template.format(*row) for row in zip(*values, strict=True))


def _write_parquet(trace: pd.DataFrame, path: Path) -> None:
    """Parquet with prefix_blocks as list<int64>."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays, names = [], []
    for col in trace.columns:
        if col == "prefix_blocks":
            arrays.append(pa.array(trace[col].tolist(), type=pa.list_(pa.int64())))
        else:
            arrays.append(pa.array(trace[col].to_numpy()))
        names.append(col)
    # No dictionaries for the columns whose values are all distinct (ids, arrival times): Parquet fills a
    # 1 MB dictionary page with them before it gives up, and a reader holds each column's page for its
    # row group: dictionaries on these columns cost more bytes than they save.
    unique = {"request_id", "arrival_s"}
    # One row group, however long the trace: a simulation reads it front to back through two cursors, and
    # each row group they cross leaves ~0.1 MB more resident while they live; in one row group the
    # cursors' memory stays flat.
    with open_out(path) as f:
        pq.write_table(pa.Table.from_arrays(arrays, names=names), f, row_group_size=max(len(trace), 1),
                       use_dictionary=[c for c in names if c not in unique])


_WRITERS = {".csv": _write_csv, ".jsonl": _write_jsonl, ".parquet": _write_parquet}

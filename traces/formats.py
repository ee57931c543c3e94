"""Readers for the public trace formats and pagelab's own files; each returns an unchecked RawTrace.

Every reader keeps the file's own line numbers (header = line 1) so `_validate` can point at the exact
line. Arrival times are converted to seconds here; everything else is checked in `traces.schema`.
"""
from __future__ import annotations

import csv
import json
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from traces.errors import TraceError
from traces.schema import CANONICAL_COLUMNS, PREFIX_COLUMNS, RawTrace, bulk_objects, emit

AZURE = {"arrival_s": "TIMESTAMP", "prompt_len": "ContextTokens", "output_len": "GeneratedTokens"}
VIDUR = {"arrival_s": "arrived_at", "prompt_len": "num_prefill_tokens", "output_len": "num_decode_tokens"}
BURSTGPT = {"arrival_s": "Timestamp", "prompt_len": "Request tokens", "output_len": "Response tokens"}
MOONCAKE = {"arrival_s": "timestamp", "prompt_len": "input_length", "output_len": "output_length",
            "prefix_blocks": "hash_ids"}
MOONCAKE_BLOCK_SIZE = 512  # tokens per hash_ids entry (FAST25-release/README.md)


def read_csv(path: Path, source: str) -> pd.DataFrame:
    """Read a CSV keeping blank lines as all-NaN rows, so that row i is line i + 2 of the file."""
    try:
        # index_col=False: a row with more fields than the header is not read as an index plus shifted
        # columns; pandas drops the extra fields, with a warning that sends us to check them.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", pd.errors.ParserWarning)
            df = pd.read_csv(path, skip_blank_lines=False, encoding="utf-8-sig", index_col=False,
                             dtype={"prefix_blocks": str})
    except pd.errors.EmptyDataError:
        raise TraceError(f"{source}: empty file") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
        raise TraceError(f"{source}: cannot parse as CSV: {str(exc).strip()}") from None
    if any(issubclass(w.category, pd.errors.ParserWarning) for w in caught):
        _check_widths(path, source)
    df.columns = [str(c).strip() for c in df.columns]
    with open(path, encoding="utf-8-sig", newline="") as f:  # pandas renames a second 'x' to 'x.1'
        header = [name.strip() for name in next(csv.reader(f), [])]
    twice = sorted({name for name in header if header.count(name) > 1})
    if twice:
        raise TraceError(f"{source} line 1 (header): column {twice[0]!r} appears twice")
    return df


def _check_widths(path: Path, source: str) -> None:
    """Refuse a row with more values than the header has names (empty trailing fields, as a comma at the
    end of each line leaves, are only dropped)."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f)
        width = len(next(reader, []))
        for row in reader:
            if len(row) > width and any(field.strip() for field in row[width:]):
                raise TraceError(f"{source} line {reader.line_num}: {len(row)} fields, but the header names "
                                 f"{width}")


def csv_raw(df: pd.DataFrame, fields: dict[str, str], relative_time: bool, source: str = "") -> RawTrace:
    """Rename a CSV frame to canonical names, dropping blank lines but keeping their line numbers."""
    ours = [k for k, v in fields.items() if v not in df.columns and k in df.columns]
    if ours:  # pagelab's own CSV, read as another format: its columns would be taken for that format's
        raise TraceError(f"{source}: the header has pagelab's {', '.join(ours)}, not this format's "
                         f"{', '.join(fields[k] for k in ours)}: leave --format out to read pagelab's CSV")
    lines = np.arange(2, len(df) + 2)
    blank = df.isna().all(axis=1).to_numpy()
    if blank.any():
        df, lines = df[~blank].reset_index(drop=True), lines[~blank]
    df = df.rename(columns={v: k for k, v in fields.items()})
    return RawTrace(frame=df, lines=lines, unit="line", header="line 1 (header)", fields=fields,
                    relative_time=relative_time)


def azure(path: Path, source: str, warnings: list[str] | None) -> RawTrace:
    """Azure LLM inference trace 2023: `TIMESTAMP,ContextTokens,GeneratedTokens`, wall-clock timestamps."""
    raw = csv_raw(read_csv(path, source), AZURE, relative_time=False, source=source)
    df = raw.frame
    if "arrival_s" in df:
        text = df["arrival_s"]
        stamps = pd.to_datetime(text, format="ISO8601", errors="coerce")
        bad = (stamps.isna() & text.notna()).to_numpy()
        if bad.any():
            pos = int(np.argmax(bad))
            raise TraceError(f"{source} line {raw.lines[pos]}, field 'TIMESTAMP': not a timestamp "
                             f"{text.iloc[pos]!r} (expected e.g. '2023-11-16 18:17:03.9799600')")
        # Subtract in int64 nanoseconds: as float64, epoch nanoseconds keep only ~256 ns of precision.
        valid = stamps.notna().to_numpy()
        ns = stamps.to_numpy(dtype="datetime64[ns]").astype(np.int64)
        first = ns[valid].min() if valid.any() else 0
        seconds = (ns - first).astype(np.float64) / 1e9
        seconds[~valid] = np.nan
        df["arrival_s"] = seconds
    return raw


def vidur(path: Path, source: str, warnings: list[str] | None) -> RawTrace:
    """Vidur trace_replay CSV: `arrived_at,num_prefill_tokens,num_decode_tokens`, seconds."""
    df = read_csv(path, source)
    if "arrived_at" not in df.columns and {"num_prefill_tokens", "num_decode_tokens"} <= set(df.columns):
        raise TraceError(
            f"{source} line 1 (header), field 'arrived_at': missing column: this Vidur file has lengths but "
            "no arrival times; give it synthetic arrivals with "
            f"`pagelab trace gen --lengths {path} --arrival poisson --rate R --out OUT`")
    return _relative(csv_raw(df, VIDUR, relative_time=False, source=source), scale=1.0)


def burstgpt(path: Path, source: str, warnings: list[str] | None) -> RawTrace:
    """BurstGPT CSV (with or without `Session ID,Elapsed time`); drops failed requests (0 response tokens)."""
    raw = csv_raw(read_csv(path, source), BURSTGPT, relative_time=False, source=source)
    df = raw.frame
    if "output_len" in df:
        failed = (pd.to_numeric(df["output_len"], errors="coerce") == 0).to_numpy()
        if failed.all():
            raise TraceError(f"{source}: every request failed ('Response tokens' = 0); nothing to replay")
        if failed.any():
            emit(warnings, f"{source}: dropped {int(failed.sum())} failed requests ('Response tokens' = 0)")
            raw = replace(raw, frame=df[~failed].reset_index(drop=True), lines=raw.lines[~failed])
    return _relative(raw, scale=1.0)


def _relative(raw: RawTrace, scale: float) -> RawTrace:
    """Arrival column to seconds since the earliest request; bad cells are left for the validator."""
    df = raw.frame
    if "arrival_s" in df and len(df):  # an empty table (header only) is refused by the validator
        num = pd.to_numeric(df["arrival_s"], errors="coerce").to_numpy(dtype=np.float64) * scale
        ok = np.isfinite(num)
        if ok.all():
            df["arrival_s"] = num - num.min()
        elif ok.any():
            # Keep the raw cells where they are bad so the validator can quote them.
            df["arrival_s"] = df["arrival_s"].astype(object).where(~ok, num - num[ok].min())
    return raw


def pagelab_csv(path: Path, source: str, warnings: list[str] | None) -> RawTrace:
    """pagelab's own CSV: canonical columns, prefix_blocks as "1 2 3" or "[1, 2, 3]"."""
    return _drop_unknown(csv_raw(read_csv(path, source), {}, relative_time=True), source, warnings)


def _drop_unknown(raw: RawTrace, source: str, warnings: list[str] | None) -> RawTrace:
    """Warn about and drop columns that pagelab does not know."""
    extra = [c for c in raw.frame.columns if c not in (*CANONICAL_COLUMNS, *PREFIX_COLUMNS)]
    if not extra:
        return raw
    emit(warnings, f"{source}: ignored unknown column(s): {', '.join(map(str, extra))}")
    return replace(raw, frame=raw.frame.drop(columns=extra), ignored=tuple(map(str, extra)))


def read_jsonl(path: Path, source: str) -> tuple[list[dict], np.ndarray]:
    """Parse a JSON-lines file into records and their line numbers; blank lines are skipped."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{source}: not a UTF-8 text file ({exc.reason})") from None
    all_lines = text.splitlines()
    numbers = [i for i, line in enumerate(all_lines, start=1) if line.strip()]
    if not numbers:
        raise TraceError(f"{source}: empty file (no JSON lines)")
    kept = [all_lines[i - 1] for i in numbers]
    with bulk_objects():
        # One json.loads over the whole file is ~3x faster than one call per line; if anything is off,
        # the per-line pass below finds the line to blame.
        try:
            records = json.loads("[" + ",".join(kept) + "]")
        except json.JSONDecodeError:
            records = None
        if records is None or len(records) != len(kept) or set(map(type, records)) != {dict}:
            records = [_json_line(line, number, source) for line, number in zip(kept, numbers, strict=True)]
    return records, np.asarray(numbers, dtype=np.int64)


def _json_line(line: str, number: int, source: str) -> dict:
    """One JSON object from one line, or a TraceError naming the line."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{source} line {number}: not valid JSON ({exc.msg})") from None
    if not isinstance(rec, dict):
        raise TraceError(f"{source} line {number}: expected a JSON object, got {type(rec).__name__}")
    return rec


# Keys that may be left out of single JSON lines: an absent key means the default (an explicit null does not).
_JSON_DEFAULTS = {"n": 1, "beam_width": 1, "prefix_blocks": ()}


def _columns(records: list[dict], keys: dict[str, str]) -> pd.DataFrame:
    """Pick the wanted keys of every record into columns (absent keys: default above, else None)."""
    cols = {}
    for canon, key in keys.items():
        if any(key in r for r in records):
            default = _JSON_DEFAULTS.get(canon)
            cols[canon] = pd.Series([r.get(key, default) for r in records], dtype=object)
    return pd.DataFrame(cols, index=pd.RangeIndex(len(records)))  # no wanted key: rows without columns


def mooncake(path: Path, source: str, warnings: list[str] | None) -> RawTrace:
    """Mooncake FAST'25 JSONL: `timestamp` ms, `input_length`, `output_length`, `hash_ids` (512 tokens)."""
    records, lines = read_jsonl(path, source)
    df = _columns(records, MOONCAKE)
    for col in ("prompt_len", "output_len"):
        if col in df:
            df[col] = _numeric_if_clean(df[col])
    if "prefix_blocks" in df:
        df["prefix_block_size"] = MOONCAKE_BLOCK_SIZE
    fields = {**MOONCAKE, "prefix_block_size": "hash_ids"}
    raw = RawTrace(frame=df, lines=lines, unit="line", header="line 1", fields=fields, relative_time=False)
    return _relative(raw, scale=1e-3)


def _numeric_if_clean(col: pd.Series) -> pd.Series:
    """An object column as int64 when every cell is a JSON integer, else unchanged (checked later)."""
    # JSON integers have no size limit: wider than int64 stays object, for the validator to refuse.
    if set(map(type, col)) == {int} and min(col) >= -(2**63) and max(col) < 2**63:
        return col.astype(np.int64)
    return col


def pagelab_jsonl(path: Path, source: str, warnings: list[str] | None) -> RawTrace:
    """pagelab's own JSONL: one object per request with the canonical keys."""
    records, lines = read_jsonl(path, source)
    keys = {k for r in records for k in r}
    known = [c for c in (*CANONICAL_COLUMNS, *PREFIX_COLUMNS) if c in keys]
    extra = sorted(keys - set(known))
    if extra:
        emit(warnings, f"{source}: ignored unknown key(s): {', '.join(extra)}")
    df = _columns(records, {c: c for c in known})
    for col in df.columns:
        if col != "prefix_blocks":
            df[col] = _numeric_if_clean(df[col])
    return RawTrace(frame=df, lines=lines, unit="line", header="line 1", relative_time=True)


def pagelab_parquet(path: Path, source: str, warnings: list[str] | None) -> RawTrace:
    """pagelab's own Parquet file (canonical columns); rows are named by 1-based data row."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several unrelated types for a damaged file
        raise TraceError(f"{source}: cannot read as Parquet: {exc}") from None
    lists = "prefix_blocks" in table.column_names
    df = (table.drop_columns(["prefix_blocks"]) if lists else table).to_pandas().reset_index(drop=True)
    if lists:  # to_pylist gives Python ints directly; pandas would give one numpy array per cell
        with bulk_objects():
            df["prefix_blocks"] = pd.Series(table.column("prefix_blocks").to_pylist(), dtype=object)
    raw = RawTrace(frame=df, lines=np.arange(1, len(df) + 1), unit="row",
                   header="schema", relative_time=True)
    return _drop_unknown(raw, source, warnings)


def parquet_prefix_columns(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """A Parquet trace's prefix keys (flat), keys per row, prompt lengths and recorded block sizes, read
    straight from the columns when they need no checking: lists of signed integers beside integer lengths
    and sizes, no nulls. None for any other file, which must be loaded and validated whole (that parses
    keys stored as text and names the row of a key it cannot take)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = ["prefix_blocks", "prompt_len", "prefix_block_size"]
    try:
        if not set(columns) <= set(pq.read_schema(path).names):
            return None
        # Only the columns used: reading the others too takes about as long again.
        table = pq.read_table(path, columns=columns)
    except Exception:  # noqa: BLE001 - the loader reports an unreadable file in its own words
        return None
    col = table.column("prefix_blocks").combine_chunks()
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        return None
    flat = col.flatten()
    others = [table.column(c) for c in columns[1:]]
    if not all(pa.types.is_signed_integer(c.type) and c.null_count == 0 for c in (flat, *others)):
        return None
    return (flat.to_numpy().astype(np.int64), np.diff(col.offsets.to_numpy()),
            *(c.to_numpy().astype(np.int64) for c in others))

"""Reading a run folder's tables (NAME.parquet, one file or a directory of parts, or NAME.csv): the columns
the figures use are checked, and a file that cannot be read is named, with the row at fault in a CSV."""
from __future__ import annotations

import csv
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from pagelab import run_format
from pagelab.parquet_parts import PartedFile, iter_batches, part_files, table_exists
from viz.errors import TableError, VizError

# The run format's columns, as the simulation and the replay write them.
REQUEST_COLUMNS = tuple(run_format.REQUEST_COLUMNS)
MEMORY_COLUMNS = tuple(run_format.MEMORY_COLUMNS)
EVENT_COLUMNS = tuple(c for c in run_format.EVENT_COLUMNS if c not in run_format.EVENT_OPTIONAL)
TABLE_COLUMNS = {"requests": REQUEST_COLUMNS, "memory": MEMORY_COLUMNS, "events": EVENT_COLUMNS}
_SCAN_BYTES = 1 << 23  # a CSV's rows are checked this much of the file at a time


def read_table(folder: Path, name: str, columns: tuple[str, ...] | None = None) -> pd.DataFrame:
    """Read NAME.parquet (or NAME.csv) from `folder`, only `columns` if given, and check the columns the
    figures use (of those read)."""
    parquet, csv_path = folder / f"{name}.parquet", folder / f"{name}.csv"
    wanted = list(columns) if columns is not None else None
    try:
        if table_exists(parquet):
            if columns is not None:
                check_table(folder, name, columns)
            path, df = parquet, pd.read_parquet(parquet, columns=wanted)
        elif csv_path.is_file():
            csv_rows(csv_path, name)  # pandas fills a row cut short with NaN: refuse it first
            if columns is not None:
                check_table(folder, name, columns)
            path, df = csv_path, pd.read_csv(csv_path, usecols=wanted)
        else:
            raise TableError(f"{parquet}: file not found", parquet, name)
    except (OSError, ValueError) as exc:
        if isinstance(exc, VizError):
            raise
        raise unreadable(folder, name, exc) from None
    checked = TABLE_COLUMNS[name] if columns is None else columns
    if len(df) == 0:  # an empty CSV has no dtypes to check; give the columns numeric ones
        df = df.astype({c: float for c in checked if c in df.columns})
    check_columns(df, checked, str(path))
    return df


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def table_problem(folder: Path, name: str) -> TableError | None:
    """Why NAME's table in `folder` cannot be read, from every Parquet footer or every CSV row's field
    count (not its values); None when it looks readable."""
    parquet, csv_path = folder / f"{name}.parquet", folder / f"{name}.csv"
    if table_exists(parquet):
        for part in part_files(parquet):
            try:
                pq.read_metadata(part)
            except (OSError, ValueError) as exc:
                return TableError(f"{part}: cannot read table ({_first_line(exc)})", part, name)
        return None
    if csv_path.is_file():
        try:
            csv_rows(csv_path, name)
            pd.read_csv(csv_path, nrows=0)
        except TableError as exc:
            return exc
        except (OSError, ValueError) as exc:
            return TableError(f"{csv_path}: cannot read table ({_first_line(exc)})", csv_path, name)
        return None
    return TableError(f"{parquet}: file not found", parquet, name)


def unreadable(folder: Path, name: str, exc: BaseException) -> TableError:
    """NAME's table in `folder` failed to read with `exc`: the error naming the file (or part) at fault."""
    found = table_problem(folder, name)
    if found is not None:
        return found
    parquet = folder / f"{name}.parquet"
    path = parquet if table_exists(parquet) else folder / f"{name}.csv"
    return TableError(f"{path}: cannot read table ({_first_line(exc)})", path, name)


def table_rows(folder: Path, name: str) -> int:
    """Rows of NAME's table in `folder`: from the Parquet footers, or a CSV's rows counted."""
    parquet = folder / f"{name}.parquet"
    if table_exists(parquet):
        with PartedFile(parquet) as f:
            return f.metadata.num_rows
    return csv_rows(folder / f"{name}.csv", name)


def parquet_batches(folder: Path, name: str, columns: list[str], rows: int) -> Iterator:
    """NAME's Parquet table in `folder` as record batches of `columns`, `rows` at a time; damage its footer
    did not show (pyarrow raises OSError or ValueError) as `unreadable`'s error naming the file."""
    try:
        yield from iter_batches(folder / f"{name}.parquet", columns, rows)
    except (OSError, ValueError) as exc:
        raise unreadable(folder, name, exc) from None


def missing_column(where: str | Path, column: str, found) -> VizError:
    """The error naming `where`, the column it lacks and the columns it has."""
    return VizError(f"{where}: missing column '{column}' (found: {', '.join(map(str, found)) or 'none'})")


def check_columns(df: pd.DataFrame, columns: tuple[str, ...], where: str) -> None:
    """Raise VizError naming `where` and the first missing or non-numeric column."""
    for col in columns:
        if col not in df.columns:
            raise missing_column(where, col, df.columns)
        dtype = df[col].dtype
        if not (pd.api.types.is_numeric_dtype(dtype) or pd.api.types.is_bool_dtype(dtype)):
            raise VizError(f"{where}: column '{col}' must be numeric, found {dtype}")


def _numeric(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind) \
        or pa.types.is_null(kind)  # a column with no value in any row: NaN once read


def check_schema(schema: pa.Schema, columns: tuple[str, ...], path: Path) -> None:
    """VizError naming the Parquet file and the first of `columns` it lacks or holds as non-numbers."""
    for col in columns:
        if col not in schema.names:
            raise missing_column(path, col, schema.names)
        kind = schema.field(col).type
        if not _numeric(kind):
            raise VizError(f"{path}: column '{col}' must be numeric, found {kind}")


def check_table(folder: Path, name: str, columns: tuple[str, ...]) -> None:
    """Check, from NAME's Parquet footer or CSV header alone, that its table in `folder` has `columns`
    (numeric, in Parquet): VizError naming the file and the first column at fault."""
    parquet = folder / f"{name}.parquet"
    try:
        if table_exists(parquet):
            with PartedFile(parquet) as f:
                check_schema(f.schema_arrow, columns, parquet)
            return
        path = folder / f"{name}.csv"
        names = csv_header(path, name)
    except (OSError, ValueError) as exc:
        if isinstance(exc, VizError):
            raise
        raise unreadable(folder, name, exc) from None
    for col in columns:
        if col not in names:
            raise missing_column(path, col, names)


def table_columns(folder: Path, name: str) -> list[str] | None:
    """The column names of NAME's table in `folder`, from its Parquet footer or CSV header; None when it
    is absent or cannot be read (its readers name the file)."""
    parquet = folder / f"{name}.parquet"
    try:
        if table_exists(parquet):
            with PartedFile(parquet) as f:
                return list(f.schema_arrow.names)
        path = folder / f"{name}.csv"
        return csv_header(path, name) if path.is_file() else None
    except (OSError, ValueError):
        return None


def csv_header(path: Path, table: str) -> list[str]:
    """The column names of a CSV table's first line; TableError for a name given twice (pandas would
    rename the second, which then matches no column of the run format)."""
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        names = next(csv.reader(f), [])
    seen: set[str] = set()
    for col in names:
        if col in seen:
            raise TableError(f"{path}: column '{col}' appears twice in the header", path, table)
        seen.add(col)
    return names


_CHECKED: dict[tuple[str, int, int], int] = {}  # (path, mtime, size) -> rows, of the CSVs found whole


def csv_rows(path: Path, table: str) -> int:
    """The data rows of a CSV table, once every row is found to hold the header's number of fields (a file
    cut short ends in part of a row, which pandas would fill with NaN); TableError naming the file, the row
    and its line otherwise. Blank lines are skipped, as pandas skips them."""
    stat = os.stat(path)
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key in _CHECKED:
        return _CHECKED[key]
    want = len(csv_header(path, table))
    rows, line = 0, 1  # data rows and lines (of the file) before the block being checked
    with open(path, "rb") as f:
        f.readline()
        rest = b""
        while block := f.read(_SCAN_BYTES):
            data = rest + block
            end = data.rfind(b"\n") + 1
            data, rest = data[:end], data[end:]
            fields, blank = _fields_per_line(data)
            bad = np.flatnonzero((fields != want) & ~blank)
            if len(bad):
                i = int(bad[0])
                row = rows + int((~blank[:i]).sum()) + 1
                _short_row(path, table, row, line + i + 1, int(fields[i]), want)
            rows, line = rows + int((~blank).sum()), line + len(fields)
    if rest.strip():
        fields, _ = _fields_per_line(rest + b"\n")
        _short_row(path, table, rows + 1, line + 1, int(fields[0]), want)
        raise TableError(f"{path}: row {rows + 1} (line {line + 1}) is cut short (no newline at its end)",
                         path, table)
    _CHECKED[key] = rows
    return rows


def _short_row(path: Path, table: str, row: int, line: int, fields: int, want: int) -> None:
    if fields != want:
        raise TableError(f"{path}: row {row} (line {line}) has {fields} of the header's {want} fields", path,
                         table)


def _fields_per_line(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(fields, blank) of each newline-ended line of `data`."""
    if b'"' in data:  # quoted fields may hold commas: the csv module's count
        lines = data.decode("utf-8", "replace").split("\n")[:-1]
        fields = np.array([len(next(csv.reader([s]), [])) for s in lines], np.int64)
        return fields, np.array([not s.strip("\r") for s in lines], bool)
    buf = np.frombuffer(data, np.uint8)
    ends = np.flatnonzero(buf == ord("\n"))
    starts = np.concatenate(([0], ends[:-1] + 1))[: len(ends)]
    fields = np.diff(np.searchsorted(np.flatnonzero(buf == ord(",")), ends), prepend=0) + 1
    length = ends - starts
    blank = (length == 0) | ((length == 1) & (buf[starts] == ord("\r")))
    return fields, blank

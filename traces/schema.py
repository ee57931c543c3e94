"""The canonical trace table and its validation.

A canonical trace is a pandas DataFrame sorted by arrival with index 0..N-1 and the columns in
CANONICAL_COLUMNS (plus, optionally, PREFIX_COLUMNS). Every loader and generator ends in `_validate`, so
the simulator can trust a frame that came out of this package.

Problems are reported as `TraceError("<source> <where>, field '<field>': <problem>")`, where <where> is
`line K` for text files (the physical line, header = line 1) and `row K` (1-based data row) for Parquet
files and in-memory frames. Problems that can be fixed without guessing are fixed and reported as
warnings (see `emit`).
"""
from __future__ import annotations

import contextlib
import gc
import json
import warnings as _warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import pandas as pd

from traces.errors import TraceError

CANONICAL_COLUMNS = ("request_id", "arrival_s", "prompt_len", "output_len", "n", "beam_width")
PREFIX_COLUMNS = ("prefix_blocks", "prefix_block_size")
REQUIRED_COLUMNS = ("arrival_s", "prompt_len", "output_len")
# Beyond this a "length" is certainly garbage, and float64 would stop holding it exactly.
MAX_COUNT = 2**40
# The run's clock is a float of seconds: past 1e9 s (~31 years) it no longer resolves a microsecond.
MAX_ARRIVAL_S = 1e9
LATE = "about 31 years: the run's clock would lose its microseconds"
COUNT_COLUMNS = ("prompt_len", "output_len", "n", "beam_width")
KEY_MIN, KEY_MAX = -(2**63), 2**63 - 1  # prefix keys are int64 in every table and array


class TraceWarning(UserWarning):
    """A trace problem that was fixed (e.g. re-sorted arrivals); issued when no warnings list is passed."""


def emit(warnings: list[str] | None, message: str) -> None:
    """Append `message` to the caller's warnings list, or issue it as a TraceWarning when there is none."""
    if warnings is not None:
        warnings.append(message)
    else:
        _warnings.warn(message, TraceWarning, stacklevel=3)


@dataclass(frozen=True)
class RawTrace:
    """A parsed but unchecked table plus what is needed to point at rows and fields of its file."""

    frame: pd.DataFrame  # canonical column names, raw values
    lines: np.ndarray  # the number printed for each row (file line or 1-based row)
    unit: str = "row"  # "line" for text files, "row" otherwise
    header: str = "header"  # where a missing column is reported, e.g. "line 1 (header)"
    fields: dict[str, str] = field(default_factory=dict)  # canonical name -> the file's own name
    relative_time: bool = True  # False: arrivals are absolute clock values, shifting them is expected
    ignored: tuple[str, ...] = ()  # the file's columns pagelab does not know (dropped, named when one lacks)


def validate_trace(df: pd.DataFrame, source: str = "<dataframe>", *,
                   warnings: list[str] | None = None) -> pd.DataFrame:
    """Check a trace table and return a canonical copy; rows are named `row K`, K the 1-based data row."""
    if not isinstance(df, pd.DataFrame):
        raise TraceError(f"{source}: expected a pandas DataFrame, got {type(df).__name__}")
    raw = RawTrace(frame=df.reset_index(drop=True), lines=np.arange(1, len(df) + 1), header="columns")
    return _validate(raw, source, warnings)



def canonical_trace(df: pd.DataFrame, source: str = "<dataframe>") -> pd.DataFrame:
    """`df` itself when it already is what validate_trace returns (checked by scans, no copy), else
    validate_trace(df): the simulator re-checks its input without holding a second copy of a 10M-row trace."""
    return df if _is_canonical(df) else validate_trace(df, source)


def _is_canonical(df) -> bool:
    """Whether validate_trace would return `df` unchanged (traces with prefix keys take the full check)."""
    if not isinstance(df, pd.DataFrame) or len(df) == 0 or tuple(df.columns) != CANONICAL_COLUMNS:
        return False
    index = df.index
    if not (isinstance(index, pd.RangeIndex) and index.start == 0 and index.step == 1):
        return False
    return canonical_batches([{c: df[c].to_numpy() for c in CANONICAL_COLUMNS}])


def canonical_batches(batches: Iterable[dict[str, np.ndarray]]) -> bool:
    """Whether consecutive batches of the canonical columns make, together, a trace validate_trace would
    return unchanged: int64/float64 (no nulls), arrivals sorted from 0 up to MAX_ARRIVAL_S, ids
    increasing, counts in range. One batch at a time (a Parquet file's record batches, or a whole frame)."""
    last_arrival, last_id, first = 0.0, -1, True
    for c in batches:
        arrival, ids = c["arrival_s"], c["request_id"]
        if arrival.dtype != np.float64 or any(c[k].dtype != np.int64 for k in CANONICAL_COLUMNS
                                              if k != "arrival_s"):
            return False  # nulls come back as floats or objects
        if (first and arrival[0] != 0.0) or arrival[0] < last_arrival or ids[0] <= last_id:
            return False
        first = False
        if not ((arrival[1:] >= arrival[:-1]).all() and arrival[-1] <= MAX_ARRIVAL_S
                and (ids[1:] > ids[:-1]).all()
                and all(((c[k] >= 1) & (c[k] <= MAX_COUNT)).all() for k in COUNT_COLUMNS)):
            return False
        last_arrival, last_id = arrival[-1], ids[-1]
        del c, arrival, ids  # before the next batch is read: one batch in memory, not two
    return True

def _validate(raw: RawTrace, source: str, warnings: list[str] | None) -> pd.DataFrame:
    """Turn a RawTrace into a canonical frame, refusing what cannot be fixed (see module docstring)."""
    df = raw.frame
    if len(df) == 0:
        raise TraceError(f"{source}: no requests (the trace is empty)")
    name = lambda col: raw.fields.get(col, col)

    def fail(pos: int, col: str, problem: str) -> None:
        raise TraceError(f"{source} {raw.unit} {raw.lines[pos]}, field '{name(col)}': {problem}")

    def missing(cols: list[str], why: str = "") -> None:
        names = ", ".join(f"'{name(c)}'" for c in cols)
        found = ", ".join([*(str(name(c)) for c in df.columns), *raw.ignored]) or "none"
        raise TraceError(f"{source} {raw.header}, field {names}: missing column{why} (found: {found})")

    absent = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if absent:
        missing(absent)

    arrival = _arrival_column(df["arrival_s"], fail)
    out = {
        "prompt_len": _count_column(df["prompt_len"], "prompt_len", fail),
        "output_len": _count_column(df["output_len"], "output_len", fail),
        "n": _count_column(df["n"], "n", fail) if "n" in df else np.ones(len(df), np.int64),
        "beam_width": (_count_column(df["beam_width"], "beam_width", fail) if "beam_width" in df
                       else np.ones(len(df), np.int64)),
    }
    if "request_id" in df:
        ids = _count_column(df["request_id"], "request_id", fail, minimum=0, maximum=2**63 - 1)
        # Increasing ids (every trace pagelab writes) are unique: no hash table over 10M ids.
        increasing = len(ids) < 2 or bool((ids[1:] > ids[:-1]).all())
        dup = None if increasing else pd.Series(ids).duplicated().to_numpy()
        if dup is not None and dup.any():
            pos = int(np.argmax(dup))
            first = int(np.flatnonzero(ids == ids[pos])[0])
            fail(pos, "request_id", f"duplicate id {ids[pos]} (first used at {raw.unit} {raw.lines[first]})")
    else:
        ids = np.arange(len(df), dtype=np.int64)
    prefix = _prefix_columns(df, out["prompt_len"], fail, missing, name("prompt_len"))

    start = float(arrival.min())
    if start != 0.0:
        if raw.relative_time:
            emit(warnings, f"{source}: arrival times shifted by -{start:g} s so that the first request "
                           "arrives at 0")
        arrival = arrival - start
    order = None
    back = np.flatnonzero(arrival[1:] < arrival[:-1]) + 1
    if len(back):
        emit(warnings, f"{source}: {len(back)} request(s) arrive earlier than the request before them "
                       f"(first at {raw.unit} {raw.lines[back[0]]}); sorted by arrival time (stable)")
        order = np.argsort(arrival, kind="stable")

    columns = {"request_id": ids, "arrival_s": arrival, **out}
    if prefix is not None:
        columns["prefix_blocks"], columns["prefix_block_size"] = prefix
    result = pd.DataFrame({c: columns[c] for c in (*CANONICAL_COLUMNS, *PREFIX_COLUMNS) if c in columns})
    if order is not None:
        result = result.iloc[order].reset_index(drop=True)
    return result


def _refuse_na(values: pd.Series, col: str, fail) -> None:
    """Fail on the first missing value of a nullable column (pandas' NA has no NumPy number)."""
    if isinstance(values.dtype, pd.api.extensions.ExtensionDtype) and values.dtype.kind in "iufb":
        na = values.isna().to_numpy(bool)
        if na.any():
            fail(int(np.argmax(na)), col, "missing value (NaN or empty)")


def _numbers(values: pd.Series, col: str, fail, expected: str = "") -> np.ndarray:
    """Values as float64, failing on the first one that is missing, not a number, not finite, a boolean, or
    a date or duration (whose numbers are in a unit of their own); `expected` says what should be there."""
    _refuse_na(values, col, fail)
    if values.dtype.kind in "iu":
        return values.to_numpy(dtype=np.float64)
    if values.dtype.kind in "mM" or isinstance(values.dtype, pd.DatetimeTZDtype):
        fail(0, col, f"a {values.dtype} column is not numbers{expected}")
    # pandas would read true/false as 1/0; a boolean is never a count or a time.
    if values.dtype.kind == "b":
        fail(0, col, f"boolean value {bool(values.iloc[0])!r} is not a number")
    if values.dtype == object:
        flags = values.map(lambda v: isinstance(v, (bool, np.bool_))).to_numpy(bool)
        if flags.any():
            pos = int(np.argmax(flags))
            fail(pos, col, f"boolean value {bool(values.iloc[pos])!r} is not a number")
    num = pd.to_numeric(values, errors="coerce").to_numpy(dtype=np.float64)
    bad = ~np.isfinite(num)
    if bad.any():
        pos = int(np.argmax(bad))
        cell = values.iloc[pos]
        if cell is None or (isinstance(cell, float) and np.isnan(cell)) or str(cell).strip() == "":
            fail(pos, col, "missing value (NaN or empty)")
        if np.isinf(num[pos]):
            # A numpy scalar's repr is np.float64(inf); the user wrote inf.
            shown = repr(cell) if isinstance(cell, str) else f"{num[pos]:g}"
            fail(pos, col, f"value is not finite: {shown}")
        fail(pos, col, f"not a number: {cell!r}{expected}")
    return num


def _arrival_column(values: pd.Series, fail) -> np.ndarray:
    """Arrival times in seconds: finite, not negative, at most MAX_ARRIVAL_S."""
    arr = _numbers(values, "arrival_s", fail, " (expected seconds, e.g. 0.25, since the trace's start)")
    neg = arr < 0
    if neg.any():
        pos = int(np.argmax(neg))
        fail(pos, "arrival_s", f"negative arrival time {arr[pos]:g}")
    late = arr > MAX_ARRIVAL_S
    if late.any():
        pos = int(np.argmax(late))
        fail(pos, "arrival_s", f"arrival time {arr[pos]:g} s is past {MAX_ARRIVAL_S:g} s ({LATE})")
    return arr


_TOO_SMALL = {"output_len": "zero output length (every request must generate at least one token)",
              "prompt_len": "zero prompt length (a request needs at least one prompt token)"}


def _count_column(values: pd.Series, col: str, fail, minimum: int = 1,
                  maximum: int = MAX_COUNT) -> np.ndarray:
    """A column of whole counts in [minimum, maximum] as int64."""
    _refuse_na(values, col, fail)
    if values.dtype.kind in "iu":
        arr = values.to_numpy(dtype=np.int64)
        bad = (arr < minimum) | (arr > maximum)
        if not bad.any():
            return arr
    num = _numbers(values, col, fail)
    frac = num != np.floor(num)
    neg = num < 0
    small = num < minimum
    big = num > maximum
    bad = frac | neg | small | big
    if bad.any():
        pos = int(np.argmax(bad))
        v = num[pos]
        if frac[pos]:
            fail(pos, col, f"fractional value {v:g} (must be a whole number)")
        if neg[pos]:
            fail(pos, col, f"negative value {v:g}")
        if big[pos]:
            fail(pos, col, f"value {v:g} is too large")
        fail(pos, col, _TOO_SMALL.get(col, f"value {v:g} is below the minimum {minimum}"))
    return num.astype(np.int64)


def _prefix_columns(df: pd.DataFrame, prompt_len: np.ndarray, fail, missing, prompt_name: str):
    """Canonical (prefix_blocks, prefix_block_size), or None when the trace records no prefix keys."""
    if "prefix_blocks" not in df:
        return None  # a prefix_block_size without keys carries no information
    blocks = _key_lists(df["prefix_blocks"].to_numpy(dtype=object).tolist(), fail)
    nkeys = np.fromiter(map(len, blocks), dtype=np.int64, count=len(blocks))
    if not nkeys.any():
        return None
    if "prefix_block_size" not in df:
        missing(["prefix_block_size"], " (needed to interpret prefix_blocks)")
    sizes_raw = df["prefix_block_size"]
    # Rows without keys may leave the size empty; give them the most common size so the column stays int.
    has = nkeys > 0
    size_num = pd.to_numeric(sizes_raw, errors="coerce")
    fill = size_num[has].mode()
    sizes_raw = sizes_raw.where(has | size_num.notna(), fill.iloc[0] if len(fill) else 1)
    sizes = _count_column(sizes_raw, "prefix_block_size", fail)
    span = -(-prompt_len // sizes)  # blocks the prompt touches, the last one possibly partial
    over = nkeys > span
    if over.any():
        pos = int(np.argmax(over))
        fail(pos, "prefix_blocks", f"{nkeys[pos]} keys of {sizes[pos]} tokens, but {prompt_name} "
                                   f"{prompt_len[pos]} spans only {span[pos]} block(s)")
    return pd.Series(blocks, dtype=object).to_numpy(), sizes


@contextlib.contextmanager
def bulk_objects() -> Iterator[None]:
    """Pause the cyclic garbage collector while building millions of small acyclic objects.

    Each new list or dict counts towards a collection, and every full collection re-scans all the lists
    built so far: with the collector on, building 1M key lists takes ~7x longer. Nothing built here
    can form a reference cycle, so nothing is lost by pausing it; the previous state is restored.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _key_lists(cells: list, fail) -> list[list[int]]:
    """All prefix_blocks cells as fresh lists of Python ints (one C-speed pass when they already are)."""
    with bulk_objects():
        if set(map(type, cells)) == {list} and set(map(type, chain.from_iterable(cells))) <= {int} \
                and _all_int64(chain.from_iterable(cells)):
            return [cell.copy() for cell in cells]
        return [_key_list(cell, pos, fail) for pos, cell in enumerate(cells)]


def _all_int64(keys) -> bool:
    """Whether every key fits in int64, in one C-speed pass (`_key_list` names the row of any other)."""
    try:
        np.fromiter(keys, np.int64)
    except OverflowError:
        return False
    return True


def _key_list(cell, pos: int, fail) -> list[int]:
    """One prefix_blocks cell (list, array, or text "1 2 3" / "[1, 2, 3]") as a list of Python ints that
    fit in int64 (the key arrays of the reuse analysis and of Parquet files)."""
    if isinstance(cell, list) and all(type(x) is int and KEY_MIN <= x <= KEY_MAX for x in cell):
        return list(cell)
    if cell is None or (isinstance(cell, float) and np.isnan(cell)):
        return []
    if isinstance(cell, str):
        text = cell.strip()
        if not text.startswith("["):
            with contextlib.suppress(ValueError):
                keys = list(map(int, text.replace(",", " ").split()))
                if all(KEY_MIN <= k <= KEY_MAX for k in keys):
                    return keys
        try:
            items = json.loads(text) if text.startswith("[") else text.replace(",", " ").split()
        except json.JSONDecodeError:
            fail(pos, "prefix_blocks", f"not a list of integer keys: {cell!r}")
    elif isinstance(cell, (list, tuple, np.ndarray)):
        items = list(cell)
    else:
        fail(pos, "prefix_blocks", f"not a list of integer keys: {cell!r}")
    keys = []
    for item in items:
        if isinstance(item, (bool, np.bool_)):
            fail(pos, "prefix_blocks", f"not an integer key: {item!r}")
        try:
            key = int(item)
        except (TypeError, ValueError):
            fail(pos, "prefix_blocks", f"not an integer key: {item!r}")
        if isinstance(item, (float, np.floating)) and key != item:
            fail(pos, "prefix_blocks", f"not an integer key: {item!r}")
        if not KEY_MIN <= key <= KEY_MAX:
            fail(pos, "prefix_blocks", f"key {key} is outside the signed 64-bit range "
                                       f"[-2**63, 2**63 - 1] prefix keys are stored in")
        keys.append(key)
    return keys


def has_prefix(df: pd.DataFrame) -> bool:
    """Whether a canonical trace records prefix-block keys."""
    return "prefix_blocks" in df.columns


def flat_prefix_keys(df: pd.DataFrame) -> np.ndarray:
    """All recorded prefix keys of a canonical trace, in row order, as one int array."""
    if not has_prefix(df):
        return np.zeros(0, dtype=np.int64)
    return np.fromiter(chain.from_iterable(df["prefix_blocks"]), dtype=np.int64)

"""A validated trace read a batch of rows at a time, so a 10M-request run need not hold it whole.

`FrameBatches` slices a canonical DataFrame (no copy). `ParquetBatches` reads a Parquet trace file in
record batches; `open_parquet_batches` builds one only for a file that is already canonical (what
`pagelab trace gen` and `trace convert` write: the canonical columns and types, arrivals sorted from 0,
increasing ids, counts in range), which it checks in one pass a batch at a time. Any other file is
loaded and validated whole (traces.loaders), which is also where a bad row gets its error message.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd

from traces.schema import CANONICAL_COLUMNS, canonical_batches

BATCH_ROWS = 1 << 16
READ_BUFFER_BYTES = 64 << 10  # a Parquet reader's buffer per column
Columns = dict[str, np.ndarray]


class TraceBatches:
    """The rows of a validated trace, `num_rows` of them, a batch at a time."""

    num_rows: int
    columns: tuple[str, ...]

    def iter_batches(self, columns: tuple[str, ...], rows: int = BATCH_ROWS) -> Iterator[Columns]:
        """Consecutive batches of at most `rows` rows (the last may be shorter), as numpy columns."""
        raise NotImplementedError


class FrameBatches(TraceBatches):
    """A canonical trace DataFrame, sliced."""

    def __init__(self, frame: pd.DataFrame, max_rows: int | None = None) -> None:
        self.frame = frame
        self.num_rows = len(frame)
        self.columns = tuple(frame.columns)
        self.max_rows = max_rows  # a cap on the batch size (tests cross batch boundaries with it)

    def iter_batches(self, columns: tuple[str, ...], rows: int = BATCH_ROWS) -> Iterator[Columns]:
        """Views of the frame's columns."""
        rows = min(rows, self.max_rows or rows)
        arrays = {c: self.frame[c].to_numpy() for c in columns}
        for start in range(0, self.num_rows, rows):
            yield {c: a[start:start + rows] for c, a in arrays.items()}


class ParquetBatches(TraceBatches):
    """A canonical Parquet trace file (see open_parquet_batches), optionally cut to its first `num_rows`."""

    def __init__(self, path: Path, num_rows: int, columns: tuple[str, ...]) -> None:
        self.path = Path(path)
        self.num_rows = num_rows
        self.columns = columns

    def iter_batches(self, columns: tuple[str, ...], rows: int = BATCH_ROWS) -> Iterator[Columns]:
        """Record batches of the file, as numpy columns."""
        left = self.num_rows
        for batch in parquet_batches(self.path, columns, rows):
            if left <= 0:
                return
            n = len(batch[columns[0]])
            if n > left:
                batch = {c: v[:left] for c, v in batch.items()}
            left -= n
            yield batch


def parquet_batches(path: Path, columns: tuple[str, ...], rows: int) -> Iterator[Columns]:
    """A Parquet table's `columns` as numpy arrays, front to back, `rows` at a time (fewer where a row
    group or a part ends); one file, or a directory of parts (pagelab/parquet_parts.py)."""
    from pagelab.parquet_parts import iter_batches

    # Without pre-buffering, the reader keeps one buffered page range per column; with it (the
    # default), pyarrow holds ~15 MB more per million rows read until the iterator ends. One thread: each
    # decoding thread's malloc arena keeps its own freed buffers, and the caller reads one batch at a time
    # anyway. The read buffer is per column and lives as long as the reader (a run's two trace cursors:
    # the whole run); 64 KB reads as fast as 1 MB and holds less than half of Arrow's pool.
    for batch in iter_batches(path, list(columns), rows, pre_buffer=False, buffer_size=READ_BUFFER_BYTES):
        yield {c: batch.column(c).to_numpy(zero_copy_only=False) for c in columns}


_TYPES = {"request_id": "int64", "arrival_s": "double", "prompt_len": "int64", "output_len": "int64",
          "n": "int64", "beam_width": "int64"}


def open_parquet_batches(path: Path, limit: int | None = None) -> ParquetBatches | None:
    """The file as ParquetBatches when it is a canonical trace without prefix keys (its first `limit`
    rows, if given); None when it is not (load it whole instead)."""
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(path) as f:
            schema = f.schema_arrow
            num_rows = f.metadata.num_rows
    except Exception:  # noqa: BLE001 - not a Parquet file we can read in batches: the loader will say why
        return None
    names = tuple(schema.names)
    if names != CANONICAL_COLUMNS or any(str(schema.field(c).type) != t for c, t in _TYPES.items()):
        return None
    num_rows = num_rows if limit is None else min(num_rows, limit)
    batches = ParquetBatches(path, num_rows, names)
    if num_rows == 0 or not canonical_batches(batches.iter_batches(CANONICAL_COLUMNS)):
        return None
    return batches

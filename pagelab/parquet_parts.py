"""Reading Parquet tables written in parts: NAME.parquet is one file, or a directory of parts in row order.

A Parquet writer keeps every row group's footer entry (~870 bytes a column chunk, whatever the options)
until it closes, and a long run streams thousands of row groups into its tables: held to the end, those
entries grow with the run and, allocated a group at a time between the loop's own allocations, keep heap
pages from being returned. So a streamed table starts a new part file every so many row groups
(pagelab/table_sinks.py writes them); a table that ends within its first part is a single file at
NAME.parquet, the layout every small run has.

pandas.read_parquet and pyarrow.parquet.read_table read either layout; `PartedFile` gives the row groups
of both as one sequence (what pyarrow.parquet.ParquetFile gives for one file).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

PART_PATTERN = "part-*.parquet"  # pagelab.table_sinks.part_name


def part_files(path: str | Path) -> list[Path]:
    """The Parquet files holding a table, in row order: the file itself, or a directory's parts."""
    path = Path(path)
    return sorted(path.glob(PART_PATTERN)) if path.is_dir() else [path]


def table_exists(path: str | Path) -> bool:
    """Whether NAME.parquet is there, as a file or as a directory of parts."""
    path = Path(path)
    return path.is_file() or (path.is_dir() and bool(part_files(path)))


def table_bytes(path: str | Path) -> int:
    """Size on disk of a table in either layout."""
    return sum(p.stat().st_size for p in part_files(path) if p.is_file())


class _Metadata:
    """The footer-level facts of a parted table that readers ask pyarrow's FileMetaData for (it holds the
    parts' footers only, so it outlives the open files)."""

    def __init__(self, parts: list[pq.FileMetaData]) -> None:
        self.parts = parts
        self.groups = [(i, g) for i, m in enumerate(parts) for g in range(m.num_row_groups)]  # (part, group)
        self.schema = parts[0].schema
        self.num_rows = sum(m.num_rows for m in parts)
        self.num_row_groups = len(self.groups)

    def row_group(self, index: int):
        """RowGroupMetaData of row group `index` counted across the parts."""
        i, g = self.groups[index]
        return self.parts[i].row_group(g)


class PartedFile:
    """A table's row groups across its part files, read like one pyarrow.parquet.ParquetFile."""

    def __init__(self, path: str | Path, **options) -> None:
        self.path = Path(path)
        names = part_files(self.path)
        if not names:
            raise OSError(f"{self.path}: a directory without Parquet parts ({PART_PATTERN})")
        self.files = [pq.ParquetFile(p, **options) for p in names]
        self.metadata = _Metadata([f.metadata for f in self.files])
        self.schema_arrow = self.files[0].schema_arrow

    def read_row_group(self, index: int, columns: list[str] | None = None) -> pa.Table:
        """Row group `index` (counted across the parts)."""
        i, g = self.metadata.groups[index]
        return self.files[i].read_row_group(g, columns=columns)

    def close(self) -> None:
        """Close every part."""
        for f in self.files:
            f.close()

    def __enter__(self) -> PartedFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iter_batches(path: str | Path, columns: list[str], batch_size: int,
                 **options) -> Iterator[pa.RecordBatch]:
    """Record batches of a table in either layout, front to back, one part open at a time."""
    for name in part_files(path):
        with pq.ParquetFile(name, **options) as f:
            yield from f.iter_batches(batch_size=batch_size, columns=columns, use_threads=False)

"""Reading a run's transitions and refcounts tables (preemptions and swaps, and shared blocks' owner
counts, at their times), which older runs lack."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd

from pagelab.parquet_parts import table_exists
from pagelab.run_format import TRANSITION_COLUMNS, TRANSITION_KINDS
from viz.errors import VizError
from viz.load import AllocatorRun
from viz.tables import check_columns, parquet_batches, read_table

READ_ROWS = 262_144


def has_table(alloc: AllocatorRun, name: str) -> bool:
    """Whether the allocator folder holds table `name` (Parquet or CSV)."""
    return table_exists(alloc.path / f"{name}.parquet") or (alloc.path / f"{name}.csv").is_file()


def missing_transitions(allocs) -> list[str]:
    """For each allocator whose preemptions will show no markers (its summary counts some, its folder
    lacks the transitions table), why."""
    out = []
    for alloc in allocs:
        count = alloc.summary.get("num_preemptions")
        if isinstance(count, int) and count > 0 and not has_table(alloc, "transitions"):
            out.append(f"{alloc.path}: no transitions table, so the {count:,} preemptions (and swaps) its "
                       "summary counts have no markers")
    return out


def read_batches(alloc: AllocatorRun, name: str, columns: tuple[str, ...]) -> Iterator[pd.DataFrame]:
    """Table `name` in batches of rows (nothing when the run lacks it)."""
    if not has_table(alloc, name):
        return
    path = alloc.path / f"{name}.parquet"
    if table_exists(path):
        for batch in parquet_batches(alloc.path, name, list(columns), READ_ROWS):
            df = batch.to_pandas()
            check_columns(df, columns, str(path))
            yield df
    else:
        yield read_table(alloc.path, name, columns)


def read_transitions(alloc: AllocatorRun) -> Iterator[pd.DataFrame]:
    """The transitions table in batches of rows, with `kind_name` added; nothing when the run lacks it."""
    names = np.array(TRANSITION_KINDS)
    path = alloc.path / "transitions.parquet"
    for df in read_batches(alloc, "transitions", tuple(TRANSITION_COLUMNS)):
        kind = df["kind"].to_numpy(np.int64)
        if len(kind) and (kind.min() < 0 or kind.max() >= len(names)):
            raise VizError(f"{path}: column 'kind' must be 0 to {len(names) - 1}")
        yield df.assign(kind_name=names[kind])

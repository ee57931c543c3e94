"""Reading a run's transitions table (preemptions and swaps at their times), which older runs lack."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd

from pagelab.parquet_parts import iter_batches, table_exists
from pagelab.run_format import TRANSITION_COLUMNS, TRANSITION_KINDS
from viz.errors import VizError
from viz.load import AllocatorRun, check_columns, read_table

READ_ROWS = 262_144


def has_transitions(alloc: AllocatorRun) -> bool:
    """Whether the allocator folder records the times of preemptions and swaps."""
    return table_exists(alloc.path / "transitions.parquet") or (alloc.path / "transitions.csv").is_file()


def read_transitions(alloc: AllocatorRun) -> Iterator[pd.DataFrame]:
    """The transitions table in batches of rows, with `kind_name` added; nothing when the run lacks it."""
    if not has_transitions(alloc):
        return
    cols = list(TRANSITION_COLUMNS)
    path = alloc.path / "transitions.parquet"
    if table_exists(path):
        frames = (b.to_pandas() for b in iter_batches(path, cols, READ_ROWS))
    else:
        frames = iter([read_table(alloc.path, "transitions", tuple(cols))])
    names = np.array(TRANSITION_KINDS)
    for df in frames:
        check_columns(df, tuple(cols), str(path))
        kind = df["kind"].to_numpy(np.int64)
        if len(kind) and (kind.min() < 0 or kind.max() >= len(names)):
            raise VizError(f"{path}: column 'kind' must be 0 to {len(names) - 1}")
        yield df.assign(kind_name=names[kind])

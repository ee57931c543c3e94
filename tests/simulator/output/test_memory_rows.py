"""The memory table's rows: packed as they come, read back exactly, summed for the summary."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagelab.table_sinks import FrameSink
from simulator.core.allocator import MemoryBreakdown
from simulator.output.memory_rows import MEMORY_DTYPES, MemoryFrame, MemoryRows, MemoryTable, weighted_means


def _in_memory() -> MemoryRows:
    return MemoryRows(MemoryFrame(), 1 << 62, 1 << 62)


def test_memory_rows_round_trip():
    log = _in_memory()
    log.add_row(0, 3, 0.5, 0.25, 0.1, 0.2, 0.3, 0.15, 0.25, 0.05, 0.6, (7, 2, 1), 9, 11)
    log.add_breakdown(3, 1, 0.75, 0.1, MemoryBreakdown(100, 10, 20, 30, 15, 25, 5, 60), (8, 1, 0), 12, 4)
    log.end()
    df = log.writer.frame()
    assert len(log) == 2 and df["num_steps"].tolist() == [3, 1] and df["blocks_used"].tolist() == [11, 15]
    assert df.loc[1, "token_states"] == df.loc[1, "token_occupancy"] == 0.1
    assert df.loc[1, ["reservation", "internal_fragmentation", "free", "cached_free"]].tolist() == \
        [0.2, 0.3, 0.25, 0.05]
    assert df["step"].dtype == np.int64 and df["t_s"].dtype == np.float64


def test_memory_rows_keep_counts_up_to_int32_and_steps_past_it():
    """Counts are packed as int32 and the step as int64: both round-trip at their limits."""
    big = 2**31 - 1
    log = _in_memory()
    log.add_row(2**40, big, 1.0, 0.5, 0.1, 0.2, 0.3, 0.15, 0.25, 0.05, 0.6, (big, big - 1, 0), big, big)
    log.end()
    row = log.writer.frame().iloc[0]
    assert row["step"] == 2**40 and row["num_steps"] == row["num_running"] == row["blocks_used"] == big
    assert row["num_waiting"] == big - 1 and row["num_batched_tokens"] == big
    assert row["token_occupancy"] == row["token_states"] == 0.1 and row["block_occupancy"] == 0.6


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(1, 9), st.integers(1, 5))
def test_memory_rows_reach_a_file_in_row_groups_of_their_size(num, group, batch):
    """Rows handed on in batches reach the file's sink in order, in row groups of exactly `group` rows
    (the last one shorter), with the time-weighted sums of the rows."""
    rng = np.random.default_rng(num * 100 + group * 10 + batch)
    sink = FrameSink(MEMORY_DTYPES)
    logs = [_in_memory(), MemoryRows(MemoryTable(sink), batch, group)]
    for i in range(num):
        f = rng.random(8)
        for log in logs:
            log.add_row(i, 1 + i % 3, float(i), float(f[0]), *map(float, f[1:8]), (i, 1, 0), i % 5, 2 * i)
    logs[0].end()
    sums = logs[1].end()
    assert len(logs[1]) == num
    sizes = [len(b["step"]) for b in sink._batches]
    assert sizes == [group] * (num // group) + ([num % group] if num % group else [])
    expected = logs[0].writer.frame()
    pd.testing.assert_frame_equal(sink.frame(), expected, check_exact=True)
    means, token_occupancy, _ = weighted_means(sums)
    dt = expected["dt_s"].to_numpy()
    if num:
        want = (expected["token_occupancy"] * dt).sum() / dt.sum()
        assert token_occupancy == pytest.approx(want, rel=1e-12)
        assert means["free"] == pytest.approx((expected["free"] * dt).sum() / dt.sum(), rel=1e-12)

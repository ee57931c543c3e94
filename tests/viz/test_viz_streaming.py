"""Figures of a big run read its memory table a row group at a time: same series as the whole table."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from simulator.config import SimConfig
from simulator.loop import simulate
from simulator.output import RunFolder, Sizes
from traces import SyntheticConfig, generate_trace
from viz.downsample import downsample_chunks, downsample_steps
from viz.load import load_allocator
from viz.palette import STATE_ORDER
from viz.snapshot import peak_time
from viz.timeline import QUEUES, memory_series


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """A paged run whose memory table has many row groups in several part files (as a long simulate --out
    writes it)."""
    folder = tmp_path_factory.mktemp("run") / "paged"
    folder.mkdir()
    trace = generate_trace(SyntheticConfig(num_requests=300, rate=30.0, seed=4))
    sizes = Sizes(memory_group_rows=64, memory_min_group_rows=1, request_group_rows=50, table_part_groups=3)
    simulate(trace, SimConfig(capacity_tokens=8000, mode="step", record_events=False),
             RunFolder(folder, record_events=False, sizes=sizes))
    (folder / "config.json").write_text('{"allocator": "paged"}')
    (folder / "summary.json").write_text("{}")
    return folder


def test_the_table_is_read_in_row_groups(streamed):
    alloc = load_allocator(streamed)
    chunks = list(alloc.memory_chunks(("t_s", "dt_s")))
    assert len(chunks) > 5 and "memory" not in alloc.__dict__
    assert len(list((streamed / "memory.parquet").glob("part-*.parquet"))) == -(-len(chunks) // 3)
    num_rows = len(pd.read_parquet(streamed / "memory.parquet"))
    assert alloc.num_memory_rows == sum(len(c) for c in chunks) == num_rows


@pytest.mark.parametrize("max_bins", [7, 100, 100_000])
def test_binned_series_equal_the_whole_table(streamed, max_bins):
    whole = pd.read_parquet(streamed / "memory.parquet")
    t, dt = whole["t_s"].to_numpy(float), whole["dt_s"].to_numpy(float)
    series = memory_series(load_allocator(streamed), max_bins)
    for name, values in [("states", whole[list(STATE_ORDER)].to_numpy(float)),
                         ("used", 1.0 - whole["free"].to_numpy(float)),
                         ("queues", whole[list(QUEUES)].to_numpy(float))]:
        want, got = downsample_steps(t, dt, values, max_bins), series[name]
        np.testing.assert_array_equal(got.edges, want.edges)
        np.testing.assert_allclose(got.mean, want.mean, rtol=1e-9, atol=1e-12)
        np.testing.assert_array_equal(got.lo, want.lo)
        np.testing.assert_array_equal(got.hi, want.hi)


def test_chunk_boundaries_do_not_change_the_bins():
    rng = np.random.default_rng(3)
    dt = rng.choice([0.0, 0.5, 1.0, 7.0], 500)
    t = np.concatenate([[0.0], np.cumsum(dt)[:-1]]) + 2.0
    v = rng.normal(size=(500, 2))
    want = downsample_steps(t, dt, v, 40)
    cuts = [0, 1, 99, 100, 333, 500]
    got = downsample_chunks(((t[a:b], dt[a:b], v[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)),
                            len(t), (t[0], t[-1] + dt[-1]), 40)
    np.testing.assert_allclose(got.mean, want.mean, rtol=1e-9)
    np.testing.assert_array_equal(got.lo, want.lo)
    np.testing.assert_array_equal(got.hi, want.hi)


def test_peak_time_is_the_median_tie_of_the_whole_table(streamed):
    whole = pd.read_parquet(streamed / "memory.parquet")
    used = whole["blocks_used"].to_numpy(float)
    tied = np.flatnonzero(used == used.max())
    i = int(tied[len(tied) // 2])
    assert len(tied) > 1  # the pool saturates: several rows tie at the peak
    assert peak_time(load_allocator(streamed)) == float(whole["t_s"].iloc[i] + whole["dt_s"].iloc[i] / 2)

"""save_trace / load_trace round trips for CSV, JSONL and Parquet (hypothesis-generated traces)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from traces import SyntheticConfig, generate_trace, load_trace, save_trace, validate_trace

SUFFIXES = [".csv", ".jsonl", ".parquet"]


@st.composite
def traces(draw) -> pd.DataFrame:
    """A random canonical trace, with or without prefix keys."""
    n = draw(st.integers(1, 12))
    gaps = draw(st.lists(st.floats(0, 1e4, allow_nan=False, allow_infinity=False), min_size=n - 1,
                         max_size=n - 1))
    prompt = draw(st.lists(st.integers(1, 5000), min_size=n, max_size=n))
    frame = {
        "request_id": draw(st.lists(st.integers(0, 2**62), min_size=n, max_size=n, unique=True)),
        "arrival_s": np.concatenate(([0.0], np.cumsum(gaps))),
        "prompt_len": prompt,
        "output_len": draw(st.lists(st.integers(1, 5000), min_size=n, max_size=n)),
        "n": draw(st.lists(st.integers(1, 8), min_size=n, max_size=n)),
        "beam_width": draw(st.lists(st.integers(1, 8), min_size=n, max_size=n)),
    }
    if draw(st.booleans()):
        size = draw(st.sampled_from([16, 512]))
        frame["prefix_blocks"] = [draw(st.lists(st.integers(-2**63, 2**63 - 1), max_size=-(-p // size)))
                                  for p in prompt]
        frame["prefix_block_size"] = [size] * n
    return validate_trace(pd.DataFrame(frame), warnings=[])


@pytest.mark.parametrize("suffix", SUFFIXES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trace=traces())
def test_round_trip_is_exact(tmp_path, suffix, trace):
    path = save_trace(trace, tmp_path / f"t{suffix}")
    warnings: list[str] = []
    back = load_trace(path, warnings=warnings)
    assert warnings == []
    pd.testing.assert_frame_equal(back, trace, check_exact=True)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_round_trip_of_a_generated_trace_with_prefixes(tmp_path, suffix):
    trace = generate_trace(SyntheticConfig(num_requests=300, num_prefix_groups=2, prefix_len=48,
                                           prefix_fraction=0.5, n=2, seed=1))
    back = load_trace(save_trace(trace, tmp_path / f"g{suffix}"))
    pd.testing.assert_frame_equal(back, trace, check_exact=True)
    assert back["prefix_blocks"].map(type).eq(list).all()


def test_save_replaces_atomically(tmp_path):
    trace = generate_trace(SyntheticConfig(num_requests=5, lengths="fixed"))
    path = tmp_path / "t.csv"
    path.write_text("old")
    save_trace(trace, path)
    assert [p.name for p in tmp_path.iterdir()] == ["t.csv"]  # no temporary left behind
    pd.testing.assert_frame_equal(load_trace(path), trace)


def test_bundled_traces_convert_to_every_format(tmp_path):
    src = load_trace("mooncake-conv").iloc[:500].reset_index(drop=True)
    for suffix in SUFFIXES:
        pd.testing.assert_frame_equal(load_trace(save_trace(src, tmp_path / f"m{suffix}")), src)


def test_a_parquet_trace_is_one_row_group_however_long(tmp_path):
    # Longer than pyarrow's default row group (2^20 rows): a simulation's cursors never cross a group.
    import pyarrow.parquet as pq

    n = (1 << 20) + 5
    ones = np.ones(n, dtype=np.int64)
    trace = pd.DataFrame({"request_id": np.arange(n), "arrival_s": np.arange(n) * 0.01,
                          "prompt_len": 16 * ones, "output_len": 8 * ones, "n": ones, "beam_width": ones})
    meta = pq.ParquetFile(save_trace(trace, tmp_path / "long.parquet")).metadata
    assert meta.num_row_groups == 1 and meta.num_rows == n

"""Streamed Parquet tables in part files: every reader sees the rows written, in order, in either layout."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagelab.parquet_parts import PartedFile, iter_batches, part_files, table_bytes, table_exists
from pagelab.table_sinks import ParquetSink, arrow_schema, open_table_sink
from simulator.output.request_rows import REQUEST_DTYPES, RequestColumns, RequestTotals

SCHEMA = pa.schema([("row", pa.int64()), ("t_s", pa.float64())])


def _write(path, sizes, part_groups, group_rows=0, exact_groups=False) -> ParquetSink:
    sink = ParquetSink(path, SCHEMA, group_rows=group_rows, part_groups=part_groups,
                       exact_groups=exact_groups)
    start = 0
    for n in sizes:
        sink.write({"row": np.arange(start, start + n), "t_s": np.arange(start, start + n) * 0.5})
        start += n
    sink.close()
    return sink


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 30), max_size=40), part_groups=st.integers(1, 6),
       group_rows=st.sampled_from([0, 1, 25]), exact=st.booleans())
def test_every_reader_gets_the_rows_in_order_whatever_the_parts(tmp_path_factory, sizes, part_groups,
                                                                 group_rows, exact):
    path = tmp_path_factory.mktemp("t") / "table.parquet"
    exact = exact and group_rows > 0
    sink = _write(path, sizes, part_groups, group_rows, exact)
    rows = np.arange(sum(sizes))
    assert sink.num_rows == len(rows) and table_exists(path)
    f = PartedFile(path)
    groups = [f.read_row_group(g).column("row").to_numpy() for g in range(f.metadata.num_row_groups)]
    assert f.metadata.num_rows == len(rows)
    sizes_written = [len(g) for g in groups]
    if exact:  # copied into one buffer: every group full but the last
        assert all(n == group_rows for n in sizes_written[:-1])
        assert all(0 < n <= group_rows for n in sizes_written)
    elif group_rows:
        assert all(n >= group_rows for n in sizes_written[:-1])
    # A directory only when the row groups overflow one part; every part but the last is full.
    assert path.is_dir() == (f.metadata.num_row_groups > part_groups)
    per_part = [pq.ParquetFile(p).metadata.num_row_groups for p in part_files(path)]
    assert sum(per_part) == f.metadata.num_row_groups and all(n == part_groups for n in per_part[:-1])
    np.testing.assert_array_equal(np.concatenate(groups) if groups else np.zeros(0, np.int64), rows)
    f.close()
    with PartedFile(path) as g:
        assert g.schema_arrow == SCHEMA
    np.testing.assert_array_equal(pd.read_parquet(path)["row"].to_numpy(), rows)
    batches = [b.column("row").to_numpy() for b in iter_batches(path, ["row"], 7)]
    np.testing.assert_array_equal(np.concatenate(batches) if batches else np.zeros(0, np.int64), rows)
    assert table_bytes(path) == sum(p.stat().st_size for p in part_files(path)) > 0


def test_more_than_ten_parts_keep_their_order(tmp_path):
    path = tmp_path / "t.parquet"
    _write(path, [3] * 25, part_groups=2)
    assert [p.name for p in part_files(path)][:3] == ["part-00000.parquet", "part-00001.parquet",
                                                      "part-00002.parquet"]
    assert len(part_files(path)) == 13
    np.testing.assert_array_equal(pq.read_table(path).column("row").to_numpy(), np.arange(75))
    window = pq.read_table(path, filters=[("t_s", ">=", 30.0)]).column("row").to_numpy()
    np.testing.assert_array_equal(window, np.arange(60, 75))


def test_exact_groups_need_a_group_size(tmp_path):
    with pytest.raises(ValueError, match="group_rows"):
        ParquetSink(tmp_path / "t.parquet", SCHEMA, group_rows=0, exact_groups=True)


def test_an_empty_table_is_one_file_with_its_schema(tmp_path):
    path = tmp_path / "t.parquet"
    _write(path, [], part_groups=1)
    assert path.is_file() and pq.read_schema(path) == SCHEMA and pq.read_metadata(path).num_rows == 0


def test_a_stale_file_is_replaced_and_an_existing_directory_is_left_alone(tmp_path):
    path = tmp_path / "t.parquet"
    path.write_text("not parquet")
    _write(path, [5, 5], part_groups=1)
    assert path.is_dir() and pd.read_parquet(path)["row"].tolist() == list(range(10))
    with pytest.raises(FileExistsError):
        ParquetSink(path, SCHEMA)
    assert pd.read_parquet(path)["row"].tolist() == list(range(10))


def test_a_directory_without_parts_is_an_error_naming_it(tmp_path):
    (tmp_path / "t.parquet").mkdir()
    assert not table_exists(tmp_path / "t.parquet")
    with pytest.raises(OSError, match=r"t\.parquet: a directory without Parquet parts"):
        PartedFile(tmp_path / "t.parquet")


def test_request_columns_read_a_table_in_parts_as_written(tmp_path):
    rng = np.random.default_rng(0)
    n = 300
    cols = {c: (rng.random(n) * 100).astype(t) for c, t in REQUEST_DTYPES.items()}
    sink = open_table_sink(tmp_path / "requests", arrow_schema(REQUEST_DTYPES), part_groups=1, group_rows=0)
    for a in range(0, n, 70):
        sink.write({c: v[a:a + 70] for c, v in cols.items()})
    sink.close()
    assert len(part_files(sink.path)) == 5
    back = RequestColumns(RequestTotals(), path=sink.path)
    for name in ("arrival_s", "prompt_len", "e2e_s"):
        np.testing.assert_array_equal(back.column(name), cols[name])

"""Reading run folders: the happy path and a VizError naming file and column for each kind of damage."""
from __future__ import annotations

import json

import pandas as pd
import pytest
from viz_fixtures import write_small_run

from viz.errors import VizError
from viz.load import load_allocator, load_run, load_runs, series_label


@pytest.fixture
def run_dir(tmp_path):
    return write_small_run(tmp_path / "small")


def test_loads_allocators_in_canonical_order_with_tables(run_dir):
    run = load_run(run_dir)
    assert list(run.allocators) == ["paged", "contiguous-max"]
    paged = run.allocators["paged"]
    assert paged.capacity_slots == 64 and paged.block_size == 16 and paged.is_paged
    assert not run.allocators["contiguous-max"].is_paged
    assert len(paged.requests) == 4 and len(paged.memory) == 16 and len(paged.events) == 5
    assert paged.memory["t_s"].is_monotonic_increasing
    assert paged.memory_fractions()["token_states"] == pytest.approx(0.55)
    assert run.trace["name"] == "hand-built"


def test_an_allocator_folder_alone_is_a_run(run_dir):
    run = load_run(run_dir / "contiguous-max")
    assert list(run.allocators) == ["contiguous-max"]
    assert len(run.allocators["contiguous-max"].events) == 4


def test_same_folder_names_get_distinct_labels(tmp_path):
    a = write_small_run(tmp_path / "a" / "run")
    b = write_small_run(tmp_path / "b" / "run")
    runs = load_runs([a, b])
    assert [r.label for r in runs] == ["a/run", "b/run"]
    assert series_label(runs[0], runs[0].allocators["paged"], True) == "a/run/paged"
    assert series_label(runs[0], runs[0].allocators["paged"], False) == "paged"


def test_missing_run_folder(tmp_path):
    with pytest.raises(VizError, match="run folder not found"):
        load_run(tmp_path / "nope")


def test_missing_table_names_the_file(run_dir):
    (run_dir / "paged" / "events.parquet").unlink()
    run = load_run(run_dir)
    with pytest.raises(VizError, match=r"paged/events\.parquet: file not found"):
        _ = run.allocators["paged"].events


def test_missing_column_names_file_and_column(run_dir):
    path = run_dir / "contiguous-max" / "memory.parquet"
    pd.read_parquet(path).drop(columns=["dt_s"]).to_parquet(path)
    with pytest.raises(VizError, match=r"contiguous-max/memory\.parquet: missing column 'dt_s'"):
        _ = load_run(run_dir).allocators["contiguous-max"].memory


def test_non_numeric_column_is_rejected(run_dir):
    path = run_dir / "paged" / "requests.parquet"
    df = pd.read_parquet(path)
    df["ttft_s"] = "soon"
    df.to_parquet(path)
    with pytest.raises(VizError, match=r"requests\.parquet: column 'ttft_s' must be numeric"):
        _ = load_run(run_dir).allocators["paged"].requests


def test_csv_tables_are_accepted(run_dir):
    folder = run_dir / "paged"
    pd.read_parquet(folder / "requests.parquet").to_csv(folder / "requests.csv", index=False)
    (folder / "requests.parquet").unlink()
    assert load_run(run_dir).allocators["paged"].requests["request_id"].tolist() == [1, 2, 3, 4]


def test_bad_json_and_missing_summary_keys(run_dir):
    summary = run_dir / "paged" / "summary.json"
    data = json.loads(summary.read_text())
    del data["memory"]["free"]
    summary.write_text(json.dumps(data))
    with pytest.raises(VizError, match=r"paged/summary\.json: missing key 'memory\.free'"):
        load_run(run_dir).allocators["paged"].memory_fractions()
    (run_dir / "summary.json").write_text("{not json")
    with pytest.raises(VizError, match=r"summary\.json: not valid JSON"):
        load_run(run_dir)


def test_missing_allocator_folder(run_dir):
    (run_dir / "paged" / "config.json").unlink()
    with pytest.raises(VizError, match=r"paged/config\.json: file not found"):
        load_run(run_dir)


@pytest.mark.parametrize("part_groups", [1 << 10, 2])  # one file; a directory of parts (2 row groups each)
def test_big_events_tables_are_read_by_time_window(tmp_path, monkeypatch, part_groups):
    """A release-ordered Parquet events table (as simulate streams it) is read a window at a time."""
    import numpy as np

    import viz.load
    from pagelab.parquet_parts import PartedFile
    from simulator.config import SimConfig
    from simulator.loop import simulate
    from simulator.output import RunFolder, Sizes
    from traces import SyntheticConfig, generate_trace

    folder = tmp_path / "paged"
    folder.mkdir()
    trace = generate_trace(SyntheticConfig(num_requests=150, rate=40.0, seed=2))
    sizes = Sizes(tenure_batch=200, event_group_rows=200, event_part_groups=part_groups)
    res = simulate(trace, SimConfig(capacity_tokens=6000), RunFolder(folder, sizes=sizes))
    (folder / "config.json").write_text('{"allocator": "paged"}')
    (folder / "summary.json").write_text("{}")
    monkeypatch.setattr(viz.load, "WINDOW_READ_ROWS", 100)
    alloc = load_allocator(folder)
    assert alloc.num_events == res.num_events and "events" not in alloc.__dict__  # footer only
    whole = pd.read_parquet(folder / "events.parquet")
    t = whole["t_end_s"].to_numpy()
    for t0, t1 in [(0.0, t[len(t) // 3]), (t[len(t) // 2], t[len(t) // 2]), (t[-10], t[-1] + 1)]:
        want = whole[(whole["t_start_s"] <= t1) & (whole["t_end_s"] > t0)].reset_index(drop=True)
        pd.testing.assert_frame_equal(alloc.events_between(t0, t1).reset_index(drop=True), want)
    limit = len(whole) // 2
    end = alloc.early_events_end(limit)
    meta = PartedFile(folder / "events.parquet").metadata
    assert (folder / "events.parquet").is_dir() == (part_groups == 2)
    biggest = max(meta.row_group(g).num_rows for g in range(meta.num_row_groups))
    assert meta.num_row_groups > 5
    # Ended by T: at least `limit` tenures; ended before T: fewer than `limit` plus one row group.
    assert int((t <= end).sum()) >= limit > int((t < end).sum()) - biggest
    assert np.isfinite(end) and "events" not in alloc.__dict__


def test_a_folder_that_is_no_run_is_named_as_such(tmp_path):
    (tmp_path / "notes").mkdir()
    with pytest.raises(VizError, match=r"is not a pagelab run folder: it has no summary.json and no alloc"):
        load_run(tmp_path)

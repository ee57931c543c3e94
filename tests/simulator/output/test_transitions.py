"""The transitions table: the times of the preemptions the request table counts, and of swaps."""
from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from pagelab.run_format import TRANSITION_COLUMNS, TRANSITION_KINDS
from simulator.config import SimConfig
from simulator.loop import simulate
from simulator.output import RunFolder, Sizes
from traces import SyntheticConfig, generate_trace

SMALL = Sizes(tenure_batch=37, event_group_rows=300, event_part_groups=4, batch_rows=16)


def _trace(num: int = 200) -> pd.DataFrame:
    return generate_trace(SyntheticConfig(num_requests=num, rate=40.0, lengths="sharegpt", seed=3))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_every_counted_preemption_has_a_time_within_its_requests_life(mode):
    cfg = SimConfig(capacity_tokens=6000, preemption_mode=mode)  # a small pool preempts often
    res = simulate(_trace(), cfg)
    tr, req = res.transitions, res.requests.set_index("request_id")
    assert list(tr.columns) == list(TRANSITION_COLUMNS)
    assert {str(t) for t in tr.dtypes} == set(TRANSITION_COLUMNS.values())
    kinds = np.array(TRANSITION_KINDS)[tr["kind"]]
    out = tr[kinds != "swapped_in"]
    assert len(out) == req["num_preemptions"].sum() > 10
    counts = out.groupby("request_id").size()
    assert counts.to_dict() == req["num_preemptions"][req["num_preemptions"] > 0].to_dict()
    assert tr["t_s"].is_monotonic_increasing
    at = req.loc[tr["request_id"]]
    assert (tr["t_s"].to_numpy() >= at["admitted_s"].to_numpy()).all()
    assert (tr["t_s"].to_numpy() <= at["finish_s"].to_numpy()).all()
    if mode == "recompute":
        assert set(kinds) == {"preempted"}
    else:  # each swap-out is followed by a swap-in of the same request before the next swap-out
        assert "swapped_out" in set(kinds) and "swapped_in" in set(kinds)
        for _, group in tr.groupby("request_id"):
            names = np.array(TRANSITION_KINDS)[group["kind"]].tolist()
            swaps = [k for k in names if k != "preempted"]
            assert swaps == ["swapped_out", "swapped_in"] * (len(swaps) // 2)


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_the_run_folders_transitions_equal_the_in_memory_ones(tmp_path, fmt):
    trace = _trace()
    cfg = SimConfig(capacity_tokens=6000, preemption_mode="swap")
    kept = simulate(trace, cfg).transitions
    folder = simulate(trace, cfg, RunFolder(tmp_path, fmt, num_requests=len(trace), sizes=SMALL))
    assert folder.transitions is None  # streamed into the folder
    path = tmp_path / f"transitions.{fmt}"
    got = pd.read_parquet(path) if fmt == "parquet" else pd.read_csv(path).astype(kept.dtypes.to_dict())
    assert len(got) > SMALL.batch_rows  # written in several batches
    pd.testing.assert_frame_equal(got, kept)


def test_a_run_in_a_child_process_writes_the_same_transitions(tmp_path):
    trace = _trace(300)
    cfg = SimConfig(capacity_tokens=6000)
    kept = simulate(trace, cfg).transitions
    sizes = dataclasses.replace(SMALL, child_min_requests=len(trace))
    output = RunFolder(tmp_path, num_requests=len(trace), sizes=sizes)
    simulate(trace, cfg, output)
    assert output.in_child
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "transitions.parquet"), kept)

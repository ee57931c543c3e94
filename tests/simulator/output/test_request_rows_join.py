"""The events and transitions tables name a request by its row in the request table (0-based, arrival
order), whatever the trace's own ids and the order of its file, kept in memory, written here in parts, or
written by a child process: `requests.iloc[events.request_id]` is each tenure's request."""
from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from simulator.config import SimConfig
from simulator.loop import simulate
from simulator.output import RunFolder, Sizes
from traces import SyntheticConfig, generate_trace
from traces.schema import TraceWarning, validate_trace

# Row groups and parts small enough that 300 requests cross every boundary.
SMALL = Sizes(tenure_batch=37, event_group_rows=50, request_group_rows=64, memory_group_rows=512,
              memory_min_group_rows=64, table_part_groups=2, event_part_groups=2)
OUTPUTS = ("memory", "folder", "child")


def _trace() -> pd.DataFrame:
    """Own ids (not the position), rows out of arrival order."""
    t = generate_trace(SyntheticConfig(num_requests=300, rate=40.0, lengths="sharegpt", seed=3))
    t["request_id"] = 10_000 + 7 * np.arange(len(t))[::-1]
    return t.sample(frac=1.0, random_state=5).reset_index(drop=True)


def _run(tmp_path, where: str, config: SimConfig, trace: pd.DataFrame) -> dict[str, pd.DataFrame]:
    with pytest.warns(TraceWarning, match="sorted by arrival"):
        if where == "memory":
            r = simulate(trace, config)
            return {"requests": r.requests, "events": r.events, "transitions": r.transitions}
        sizes = dataclasses.replace(SMALL, child_min_requests=0 if where == "child" else len(trace) + 1)
        output = RunFolder(tmp_path, num_requests=len(trace), sizes=sizes)
        simulate(trace, config, output)
    assert output.in_child == (where == "child")
    assert all((tmp_path / f"{name}.parquet").is_dir() for name in ("requests", "events"))  # in parts
    return {name: pd.read_parquet(tmp_path / f"{name}.parquet")
            for name in ("requests", "events", "transitions")}


@pytest.mark.parametrize("where", OUTPUTS)
def test_a_tenure_is_the_region_of_the_request_in_its_row(tmp_path, where):
    trace = _trace()
    config = SimConfig(allocator="contiguous-oracle", placement="first-fit", capacity_tokens=8000)
    t = _run(tmp_path, where, config, trace)
    req, ev = t["requests"], t["events"]
    assert req["request_id"].tolist() == validate_trace(trace, warnings=[])["request_id"].tolist()  # sorted
    owner = req.iloc[ev["request_id"].to_numpy()]
    # The oracle reserves exactly a request's final length: one region each.
    np.testing.assert_array_equal(ev["size"].to_numpy(),
                                  (owner["prompt_len"] + owner["output_len"] - 1).to_numpy())
    assert sorted(ev["request_id"]) == list(range(len(req)))


@pytest.mark.parametrize("where", OUTPUTS)
def test_a_transition_is_counted_by_the_request_in_its_row(tmp_path, where):
    trace = _trace()
    t = _run(tmp_path, where, SimConfig(capacity_tokens=4000), trace)
    req, tr = t["requests"], t["transitions"]
    out = tr[tr["kind"] != 2]  # preempted or swapped out: what num_preemptions counts
    counts = np.bincount(out["request_id"].to_numpy(), minlength=len(req))
    assert counts.sum() > 10
    np.testing.assert_array_equal(counts, req["num_preemptions"].to_numpy())
    assert t["events"]["request_id"].max() < len(req)

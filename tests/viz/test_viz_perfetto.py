"""`pagelab export --format perfetto`: the trace-event JSON of a real run, checked against its tables."""
from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pandas as pd
import pytest

from pagelab.run_format import MEMORY_STATES
from tests.cli.clirun import one_line_error, pagelab
from viz.perfetto import PHASES, QUEUE_COUNTERS, request_phases

KNOWN_PHASES = {"M", "X", "C", "i"}
_COLUMN = {name: col for col, name in QUEUE_COUNTERS.items()}  # a counter's memory table column


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The default trace (azure-conv) simulated with every allocator, and its export."""
    tmp = tmp_path_factory.mktemp("perfetto")
    run = tmp / "run"
    result = pagelab("simulate", "--out", run, timeout=300)
    assert result.returncode == 0, result.stderr
    out = tmp / "trace.json"
    result = pagelab("export", run, "--format", "perfetto", "--out", out, timeout=300)
    assert result.returncode == 0, result.stderr
    return run, json.loads(out.read_text())


def test_trace_parses_as_trace_events(exported):
    _, trace = exported
    events = trace["traceEvents"]
    assert {e["ph"] for e in events} == KNOWN_PHASES
    for e in events:
        assert isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] != "M":
            assert isinstance(e["ts"], float | int) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["tid"], int)


def test_every_request_has_its_phases_in_order(exported):
    run, trace = exported
    processes = {e["args"]["name"]: e["pid"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert set(processes) == {"paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"}
    slices = defaultdict(list)
    instants = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            slices[e["pid"], e["tid"]].append(e)
        elif e["ph"] == "i":
            instants[e["pid"], e["tid"]].append(e["name"])
    for name, pid in processes.items():
        req = pd.read_parquet(run / name / "requests.parquet")
        for row in req.itertuples():  # a request's thread is its row
            if row.rejected:
                assert "rejected" in instants[pid, row.Index]
                continue
            got = sorted(slices[pid, row.Index], key=lambda e: e["ts"])
            assert [e["name"] for e in got] == list(PHASES), (name, row.request_id)
            assert got[0]["ts"] == pytest.approx(row.arrival_s * 1e6, abs=1e-3)
            for before, after in zip(got, got[1:], strict=False):  # each phase starts where the last ended
                assert after["ts"] == pytest.approx(before["ts"] + before["dur"], abs=2e-3)
            assert got[1]["ts"] == pytest.approx(row.admitted_s * 1e6, abs=1e-3)
            assert got[2]["ts"] == pytest.approx(row.first_token_s * 1e6, abs=1e-3)
            end = got[2]["ts"] + got[2]["dur"]
            assert end == pytest.approx(row.finish_s * 1e6, abs=2e-3)


def test_counters_follow_the_memory_table(exported):
    run, trace = exported
    pid = next(e["pid"] for e in trace["traceEvents"] if e["name"] == "process_name"
               and e["args"]["name"] == "paged")
    mem = pd.read_parquet(run / "paged" / "memory.parquet")
    tracks = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "C" and e["pid"] == pid:
            tracks[e["name"]].append((e["ts"], next(iter(e["args"].values()))))
    assert set(tracks) == set(MEMORY_STATES) | set(QUEUE_COUNTERS.values())
    # A counter holds its value until its next event: read each back at every row's time.
    t_us = mem["t_s"].to_numpy() * 1e6
    for state in MEMORY_STATES:
        ts, values = (np.array(x) for x in zip(*tracks[state], strict=True))
        held = values[np.searchsorted(ts, t_us + 1e-3, side="right") - 1]
        np.testing.assert_allclose(held, mem[state].to_numpy(), rtol=1e-5, atol=1e-9)
    ts, values = (np.array(x) for x in zip(*tracks["waiting"], strict=True))
    held = values[np.searchsorted(ts, t_us + 1e-3, side="right") - 1]
    np.testing.assert_array_equal(held, mem["num_waiting"].to_numpy())
    # Every request done at the end of the last row: the counters say so there, not the last row's values.
    end_us = (mem["t_s"].iloc[-1] + mem["dt_s"].iloc[-1]) * 1e6
    at_end = {name: max(track)[1] for name, track in tracks.items()}
    assert all(max(track)[0] == pytest.approx(end_us, abs=1e-3) for name, track in tracks.items()
               if mem[_COLUMN.get(name, name)].iloc[-1] != (1.0 if name == "free" else 0))
    assert {k: v for k, v in at_end.items() if k != "free"} == dict.fromkeys(set(at_end) - {"free"}, 0)
    assert at_end["free"] == 1.0


def test_phases_of_a_request_still_running_end_with_the_run():
    nan = float("nan")
    assert request_phases(1.0, 2.0, 3.0, 4.0, 9.0) == [("waiting", 1.0, 2.0), ("prefill", 2.0, 3.0),
                                                       ("decode", 3.0, 4.0)]
    assert request_phases(1.0, 2.0, nan, nan, 9.0) == [("waiting", 1.0, 2.0), ("prefill", 2.0, 9.0)]
    assert request_phases(1.0, nan, nan, nan, 9.0) == [("waiting", 1.0, 9.0)]


def test_unknown_format_and_missing_folder_are_one_line_errors(tmp_path):
    line = one_line_error(pagelab("export", tmp_path, "--format", "svg"))
    assert "--format 'svg'" in line and "perfetto" in line
    line = one_line_error(pagelab("export", tmp_path / "nope"))
    assert "nope" in line and "not found" in line
    assert not (tmp_path / "nope").exists()


def test_preemptions_and_swaps_are_instants_at_their_times(tmp_path):
    run = tmp_path / "run"
    result = pagelab("simulate", "azure-conv", "--limit", "600", "-a", "paged", "--kv-memory-gb", "0.3",
                     "--preemption", "swap", "--out", run)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "trace.json"
    assert pagelab("export", run, "--out", out).returncode == 0
    tr = pd.read_parquet(run / "paged" / "transitions.parquet")
    assert len(tr) > 10
    instants = sorted((e["tid"], e["ts"], e["name"]) for e in json.loads(out.read_text())["traceEvents"]
                      if e["ph"] == "i" and e["name"] != "rejected")
    kinds = ("preempted", "swapped_out", "swapped_in")
    expected = sorted((r.request_id, round(r.t_s * 1e6, 3), kinds[r.kind]) for r in tr.itertuples())
    assert instants == expected
    # A folder that lost the table exports without those markers, and says so.
    (run / "paged" / "transitions.parquet").unlink()
    result = pagelab("export", run, "--out", out)
    assert result.returncode == 0, result.stderr
    warned = " ".join(result.stderr.split())
    assert "warning:" in warned and "no transitions table, so the" in warned and "have no markers" in warned

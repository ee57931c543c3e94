"""The events and transitions tables name a request by its row in the request table, which names it by the
trace's id: viz joins the tables by row. So one workload written with its own ids, or with its rows out of
arrival order, draws exactly what it draws with default ids (docs/run-format.md)."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from tests.cli.clirun import pagelab
from viz.explorer import Window, window_detail
from viz.load import load_run
from viz.snapshot import SLOT_RESERVED, SLOT_TOKEN, pool_snapshot

ALLOCATORS = ("paged", "contiguous-oracle")
# arrival_s, prompt_len, output_len, n: prompts of different lengths, so a wrong join draws other fills; two
# samples and a small pool make the paged run preempt.
WORKLOAD = pd.DataFrame([(0.0, 40, 30, 1), (0.0, 10, 12, 2), (0.05, 70, 20, 1), (0.1, 25, 40, 2),
                         (0.2, 90, 10, 1), (0.3, 15, 25, 1)],
                        columns=["arrival_s", "prompt_len", "output_len", "n"])
OWN_IDS = [100, 205, 307, 411, 512, 613]
SHUFFLED = [3, 0, 5, 2, 1, 4]  # file order of the rows; the two at t=0 keep their order (the sort is stable)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The workload simulated into run folders from three files: default ids in arrival order, the trace's
    own ids, and default ids (the position in the file) with rows out of arrival order."""
    tmp = tmp_path_factory.mktemp("rows")
    files = {"default": WORKLOAD, "own_ids": WORKLOAD.assign(request_id=OWN_IDS),
             "unsorted": WORKLOAD.iloc[SHUFFLED]}
    out = {}
    for name, df in files.items():
        df.to_csv(tmp / f"{name}.csv", index=False)
        result = pagelab("simulate", tmp / f"{name}.csv", *(x for a in ALLOCATORS for x in ("-a", a)),
                         "--placement", "first-fit", "--capacity-tokens", "160", "--max-model-len", "128",
                         "--out", tmp / name, "--no-plot")
        assert result.returncode == 0, result.stderr
        out[name] = tmp / name
    return out


def test_the_request_table_names_requests_by_the_traces_id(runs):
    default = load_run(runs["default"]).allocators["paged"].requests
    ids = {"default": list(range(6)), "own_ids": OWN_IDS, "unsorted": [SHUFFLED.index(i) for i in range(6)]}
    for name, path in runs.items():
        req = load_run(path).allocators["paged"].requests
        assert req["request_id"].tolist() == ids[name]
        pd.testing.assert_frame_equal(req.drop(columns="request_id"), default.drop(columns="request_id"))


@pytest.mark.parametrize("name", ["own_ids", "unsorted"])
@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_snapshots_match_the_default_ids(runs, name, allocator):
    ref = load_run(runs["default"]).allocators[allocator]
    alloc = load_run(runs[name]).allocators[allocator]
    req = ref.requests
    moments = ((req["first_token_s"] + req["finish_s"]) / 2).to_numpy()  # mid-decode of each request
    seen = set()
    for at in moments:
        want, got = pool_snapshot(ref, at), pool_snapshot(alloc, at)
        np.testing.assert_array_equal(got.owner, want.owner, err_msg=f"{allocator} at {at}")
        np.testing.assert_array_equal(got.state, want.state, err_msg=f"{allocator} at {at}")
        np.testing.assert_array_equal(got.ref_count, want.ref_count, err_msg=f"{allocator} at {at}")
        seen |= set(want.state.tolist())
    assert {SLOT_TOKEN, SLOT_RESERVED} <= seen  # the fills come from the request table


def _export(path):
    out = path.parent / f"{path.name}.json"
    result = pagelab("export", path, "--out", out)
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text())["traceEvents"]


@pytest.mark.parametrize("name", ["own_ids", "unsorted"])
def test_perfetto_tracks_match_the_default_ids(runs, name):
    """Same slices and instants on the same threads; each thread named by its request's id in the trace."""
    want, got = _export(runs["default"]), _export(runs[name])
    is_name = lambda e: e["name"] == "thread_name"  # noqa: E731
    assert [e for e in got if not is_name(e)] == [e for e in want if not is_name(e)]
    assert any(e["ph"] == "i" and e["name"] == "preempted" for e in got)
    run = load_run(runs[name])
    for pid, allocator in enumerate(run.allocators, start=1):
        ids = run.allocators[allocator].requests["request_id"].tolist()
        names = {e["tid"]: e["args"]["name"] for e in got if is_name(e) and e["pid"] == pid}
        assert names == {row: f"request {rid}" for row, rid in enumerate(ids)}


@pytest.mark.parametrize("name", ["own_ids", "unsorted"])
def test_the_explorer_pages_requests_by_row(runs, name):
    """The page's tenures and transitions name rows; its requests carry their row beside the trace's id."""
    for allocator in ALLOCATORS:
        ref = load_run(runs["default"]).allocators[allocator]
        alloc = load_run(runs[name]).allocators[allocator]
        w = Window(0.0, float(alloc.requests["finish_s"].max()))
        want, got = window_detail(ref, w), window_detail(alloc, w)
        assert got["requests"].pop("request_id") != want["requests"].pop("request_id")
        assert got == want and "row" in got["requests"]

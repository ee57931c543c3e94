"""`pagelab view`'s page data and HTML, checked without a browser (tests/viz/test_viz_explorer_browser.py
drives the page)."""
from __future__ import annotations

import base64
import json
import re

import numpy as np
import pandas as pd
import pytest

from tests.cli.clirun import one_line_error, pagelab
from tests.viz.viz_fixtures import write_small_run
from viz.errors import VizError
from viz.explorer import Window, check_windows, default_window, page_data
from viz.explorer_page import ASSETS, UPLOT_VERSION, render_page
from viz.load import load_run
from viz.palette import OWNER_COLORS, STATE_COLORS
from viz.snapshot import peak_time


def decode(column: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(column["b"]), {"f8": "<f8", "i4": "<i4", "i8": "<i8"}[column["t"]])


@pytest.fixture
def run(tmp_path):
    return load_run(write_small_run(tmp_path / "run"))


def test_a_small_runs_page_holds_every_tenure_sorted_by_start(run):
    data = page_data(run)
    assert data["windows"] == [[0.0, 4.0]]  # small: the whole run in full detail
    for alloc in data["allocators"]:
        ev = run.allocators[alloc["name"]].events.sort_values("t_start_s", kind="stable")
        got = alloc["windows"][0]["tenures"]
        assert got["count"] == len(ev)
        for col in ("request_id", "start", "size", "t_start_s", "t_end_s", "max_ref_count", "filled"):
            np.testing.assert_array_equal(decode(got[col]), ev[col].to_numpy())


def test_the_page_uses_the_figures_palette(run):
    pal = page_data(run)["palette"]
    assert pal["state_colors"] == STATE_COLORS and pal["owner_colors"] == list(OWNER_COLORS)


def test_a_window_holds_the_tenures_held_inside_it(run):
    data = page_data(run, [Window(2.5, 3.5)])
    tenures = data["allocators"][0]["windows"][0]["tenures"]
    start, end = decode(tenures["t_start_s"]), decode(tenures["t_end_s"])
    assert ((start <= 3.5) & (end > 2.5)).all()
    assert sorted(decode(tenures["request_id"])) == [1, 1, 2, 3]  # rows: req 1 (row 0) left at 2.0


def test_the_default_window_keeps_to_its_budget_around_the_peak(run):
    total = sum(a.num_events for a in run.allocators.values())
    w = default_window(run, budget=total - 2)  # the budget can never be below what the peak holds
    assert w.end - w.start < 4.0 and w.start <= peak_time(run.allocators["paged"]) <= w.end
    counts = sum(len(a.events_between(w.start, w.end)) for a in run.allocators.values())
    assert counts <= total - 2


def test_the_page_is_self_contained(run):
    html = render_page(page_data(run))
    assert not re.search(r"<script[^>]*\bsrc=|<link\b|@import|https?://(?!github\.com/leeoniya)", html)
    data = re.search(r'<script id="pagelab-data" type="application/json">(.*?)</script>', html, re.S)
    assert json.loads(data.group(1))["label"] == "run"


def test_the_vendored_uplot_is_the_pinned_version_with_its_license():
    assert (ASSETS / "uPlot.iife.min.js").read_text().startswith(f"/*! https://github.com/leeoniya/uPlot "
                                                                 f"(v{UPLOT_VERSION}) */")
    assert "MIT License" in (ASSETS / "uPlot-LICENSE").read_text()


@pytest.mark.parametrize("text, message", [("5", "expected START:END"), ("3:1", "0 <= START < END"),
                                           ("9:10", "starts after the end")])
def test_bad_windows_are_named(text, message):
    with pytest.raises(VizError, match=message):
        check_windows([text], 4.0)


def test_view_writes_the_page_and_refuses_a_bad_window(tmp_path):
    root = write_small_run(tmp_path / "run")
    result = pagelab("view", root, "--window", "1:2", "--window", "2.5:9")
    assert result.returncode == 0, result.stderr
    html = (root / "view.html").read_text()
    assert '"windows":[[1.0,2.0],[2.5,4.0]]' in html
    line = one_line_error(pagelab("view", root, "--window", "x"))
    assert "--window 'x'" in line


@pytest.fixture(scope="module")
def parted_run(tmp_path_factory):
    """A simulated run whose events table has many row groups in several part files."""
    from simulator.config import SimConfig
    from simulator.loop import simulate
    from simulator.output import RunFolder, Sizes
    from traces import SyntheticConfig, generate_trace

    root = tmp_path_factory.mktemp("parted") / "run"
    folder = root / "paged"
    folder.mkdir(parents=True)
    trace = generate_trace(SyntheticConfig(num_requests=300, rate=40.0, lengths="sharegpt", seed=3))
    res = simulate(trace, SimConfig(capacity_tokens=6000),
                   RunFolder(folder, num_requests=len(trace), sizes=Sizes(event_group_rows=500,
                                                                          event_part_groups=3)))
    (folder / "config.json").write_text(json.dumps(res.config))
    (folder / "summary.json").write_text(json.dumps(res.summary))
    return load_run(folder)


@pytest.mark.parametrize("span", [(0.0, 1.0), (3.0, 3.5), (5.0, 100.0)])
def test_a_big_tables_window_is_scanned_a_row_group_at_a_time(parted_run, monkeypatch, span):
    import viz.explorer as explorer

    alloc = parted_run.allocators["paged"]
    assert alloc.num_events > 5 * 500  # several row groups and parts
    whole = alloc.events_between(*span)
    monkeypatch.setattr(explorer, "WINDOW_READ_ROWS", 0)
    got = explorer.events_in(alloc, Window(*span), explorer.EVENT_FIELDS)
    key = ["t_end_s", "start", "t_start_s"]
    assert len(got) == len(whole) > 0
    np.testing.assert_array_equal(got.sort_values(key)[list(whole.columns)].to_numpy(),
                                  whole.sort_values(key).to_numpy())


def test_a_window_carries_each_tenures_sequence_when_the_run_has_them(parted_run, run):
    import viz.explorer as explorer

    alloc, w = parted_run.allocators["paged"], Window(2.0, 2.5)
    got = explorer.window_detail(alloc, w)["tenures"]
    ev = alloc.events_between(w.start, w.end).sort_values("t_start_s", kind="stable")
    assert got["seq_id"]["t"] == "i8"
    np.testing.assert_array_equal(decode(got["seq_id"]), ev["seq_id"].to_numpy())
    # A run folder written before the column existed has no sequences: the page leaves them out.
    assert "seq_id" not in explorer.window_detail(run.allocators["paged"], Window(0.0, 4.0))["tenures"]


def test_a_window_carries_the_served_requests_and_the_earliest_waiting(parted_run, monkeypatch):
    import viz.explorer as explorer

    monkeypatch.setattr(explorer, "WAITING_ROWS", 3)
    alloc = parted_run.allocators["paged"]
    w = Window(2.0, 2.5)
    got = decode(explorer.window_detail(alloc, w)["requests"]["request_id"])
    req = alloc.requests
    alive = (req["arrival_s"] <= w.end) & ~(req["finish_s"] < w.start)
    served = req[alive & (req["admitted_s"] <= w.end)]["request_id"]
    waiting = req[alive & ~(req["admitted_s"] <= w.end)]["request_id"]
    assert len(waiting) > 3
    assert sorted(got) == sorted([*served, *waiting.iloc[:3]])


def test_the_server_sends_the_page_and_any_windows_detail(run, tmp_path):
    import threading
    import urllib.request

    from viz.explorer_page import make_server, write_page

    page = tmp_path / "view.html"
    write_page(run, page, [Window(0.0, 1.0)], serve=True)
    server = make_server(run, page.read_bytes())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        assert urllib.request.urlopen(f"{base}/").read() == page.read_bytes()
        got = json.loads(urllib.request.urlopen(f"{base}/window?t=3.0").read())
        paged = got["allocators"][0]
        assert paged["start"] <= 3.0 <= paged["end"]
        ev = run.allocators["paged"].events_between(paged["start"], paged["end"])
        assert sorted(decode(paged["tenures"]["request_id"])) == sorted(ev["request_id"])
        with pytest.raises(urllib.error.HTTPError, match="400"):
            urllib.request.urlopen(f"{base}/window?t=x")
    finally:
        server.shutdown()
        server.server_close()


def test_shared_tenures_carry_their_owner_counts(tmp_path):
    from simulator.config import SimConfig
    from simulator.loop import simulate
    from simulator.output import RunFolder
    from traces import load_trace
    from viz.explorer import tenure_refcounts

    folder = tmp_path / "paged"
    folder.mkdir()
    trace = load_trace("mooncake-conv").iloc[:60].reset_index(drop=True)
    res = simulate(trace, SimConfig(enable_prefix_caching=True, capacity_tokens=40_000),
                   RunFolder(folder, num_requests=len(trace)))
    (folder / "config.json").write_text(json.dumps(res.config))
    (folder / "summary.json").write_text(json.dumps(res.summary))
    alloc = load_run(folder).allocators["paged"]
    ev = alloc.events.sort_values("t_start_s", kind="stable", ignore_index=True)
    end = float(ev["t_end_s"].max())
    rc = {k: decode(v) for k, v in tenure_refcounts(alloc, ev, Window(0.0, end)).items()}
    assert len(rc["tenure"]) > 0 and (np.diff(rc["tenure"]) >= 0).all()
    peaks = pd.Series(rc["ref_count"]).groupby(rc["tenure"]).max()
    shared = ev["max_ref_count"][ev["max_ref_count"] > 1]
    assert peaks[peaks > 1].to_dict() == shared.to_dict()  # each shared tenure's changes reach its peak
    starts = ev["t_start_s"].to_numpy()[rc["tenure"]]
    assert (rc["t_s"] >= starts).all() and (rc["t_s"] <= ev["t_end_s"].to_numpy()[rc["tenure"]]).all()


def test_the_chart_series_say_where_their_last_row_ends(run):
    """A row holds from its t_s for dt_s: the page draws the charts on to the end of the last one."""
    data = page_data(run, [Window(0.5, 1.5)])
    for alloc in data["allocators"]:
        mem = run.allocators[alloc["name"]].memory
        assert alloc["summary"]["t_end"] == pytest.approx(mem["t_s"].iloc[-1] + mem["dt_s"].iloc[-1])
        inside = mem[(mem["t_s"] + mem["dt_s"] > 0.5) & (mem["t_s"] < 1.5)].iloc[-1]
        assert alloc["windows"][0]["memory"]["t_end"] == pytest.approx(inside["t_s"] + inside["dt_s"])

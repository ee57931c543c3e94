"""`pagelab view`'s page in headless Chromium (Debian's package, driven by Playwright with the system
executable): it renders without errors, the scrubber sets the block map to the tables' state at that
moment, a hover names the block's request, and nothing is fetched from the network.

Without Chromium or Playwright these tests are skipped, except under CI=true, where they fail.
"""
from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_rgb

from tests.cli.clirun import pagelab
from tests.viz.viz_fixtures import EVENTS, write_small_run
from viz.palette import OWNER_COLORS, OWNER_STRIDE, STATE_COLORS

CHROMIUM = os.environ.get("PAGELAB_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def _missing(what: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is needed for the browser tests (make env installs it)")
    pytest.skip(f"{what} not installed")


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright (pip install playwright)")
    if CHROMIUM is None:
        _missing("chromium (apt-get install chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def _open(browser, path):
    """A page of `path` with no network: returns (page, console errors, URLs it tried to fetch)."""
    context = browser.new_context(offline=True, viewport={"width": 1500, "height": 1000})
    page = context.new_page()
    errors, fetched = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))

    def route(r):
        if not r.request.url.startswith("file:"):
            fetched.append(r.request.url)
            return r.abort()
        return r.continue_()

    page.route("**/*", route)
    page.goto(path.as_uri())
    page.wait_for_function("window.pagelabView && window.pagelabView.frames.length > 0")
    return page, errors, fetched


def _scrub_to(page, t: float) -> None:
    """Move the scrubber as a user does (its input event), then wait for the frame it draws."""
    page.evaluate("t => { const s = document.getElementById('scrub'); s.value = t; "
                  "s.dispatchEvent(new Event('input')); }", t)
    page.wait_for_function("t => Math.abs(pagelabView.t - t) < 1e-9", arg=t)


def _cells(page, k: int) -> np.ndarray:
    """RGB of each block-map cell of allocator column `k` (the cell's top-right pixel, never hatched)."""
    rgba = page.evaluate("""k => { const c = pagelabView.columns[k], m = c.map;
        const d = c.ctx.getImageData(0, 0, m.width, m.height).data, out = [];
        for (let i = 0; i < c.cells; i++) {
          const x = (i % c.cols) * 2 + 1, y = Math.floor(i / c.cols) * 2, p = (y * m.width + x) * 4;
          out.push([d[p], d[p + 1], d[p + 2]]);
        } return out; }""", k)
    return np.array(rgba)


def _expected(name: str, t: float, slots_per_cell: int, num_cells: int) -> np.ndarray:
    """Each cell's colour from the events table at `t`: owner where filled, never-filled red, free white."""
    rgb = np.full((num_cells, 3), 255)
    owner = lambda rid: to_rgb(OWNER_COLORS[rid * OWNER_STRIDE % len(OWNER_COLORS)])  # noqa: E731
    unfilled = to_rgb(STATE_COLORS["internal_fragmentation"])
    for rid, start, size, t0, t1, _, filled in EVENTS[name]:
        if t0 <= t < t1:
            for c in range(start // slots_per_cell, (start + size - 1) // slots_per_cell + 1):
                held = filled > 0 and c <= (start + filled - 1) // slots_per_cell
                rgb[c] = np.round(255 * np.array(owner(rid) if held else unfilled))
    return rgb


@pytest.fixture(scope="module")
def small_page(tmp_path_factory):
    root = write_small_run(tmp_path_factory.mktemp("view") / "run")
    events = pd.read_parquet(root / "paged" / "events.parquet")  # the shared block gets a prefix key
    events["prefix_key"] = np.where(events["max_ref_count"] > 1, 1 << 40, 0).astype(np.int64)
    events["seq_id"] = (events["request_id"] * 10).astype(np.int64)  # the contiguous run has none
    events.to_parquet(root / "paged" / "events.parquet")
    result = pagelab("view", root)
    assert result.returncode == 0, result.stderr
    return root / "view.html"


def test_the_page_renders_offline_without_errors(browser, small_page):
    page, errors, fetched = _open(browser, small_page)
    assert errors == [] and fetched == []
    assert page.locator("section.alloc").count() == 2
    assert page.locator(".uplot").count() == 4  # memory and counts per allocator
    page.close()


@pytest.mark.parametrize("t", [0.5, 1.5, 2.3, 2.7, 3.5])
def test_scrubbing_sets_the_block_map_to_the_tables_state(browser, small_page, t):
    page, errors, _ = _open(browser, small_page)
    _scrub_to(page, t)
    for k, name in enumerate(("paged", "contiguous-max")):
        spc, cells = page.evaluate("k => [pagelabView.columns[k].spc, pagelabView.columns[k].cells]", k)
        expected = _expected(name, t, spc, cells)
        np.testing.assert_array_equal(_cells(page, k), expected, err_msg=f"{name} at {t}")
    assert errors == []
    page.close()


def test_hovering_a_block_names_its_request(browser, small_page):
    page, _, _ = _open(browser, small_page)
    _scrub_to(page, 1.5)
    canvas = page.locator("canvas.map").first
    box = canvas.bounding_box()
    cols = page.evaluate("pagelabView.columns[0].cols")
    rows = page.evaluate("pagelabView.columns[0].map.height / 2")
    for cell, rid in ((1, 2), (3, 3), (0, 1)):  # paged at 1.5 s: blocks 0-3 held by requests 1, 2, 2, 3
        x = box["x"] + (cell % cols + 0.5) / cols * box["width"]
        y = box["y"] + (cell // cols + 0.5) / rows * box["height"]
        page.mouse.move(x, y)
        tip = page.locator(".tip").first
        assert tip.get_attribute("data-request") == str(rid)  # the trace's id, not the row the tenure names
        assert tip.inner_text().startswith(f"request {rid} · sequence {(rid - 1) * 10} · block ")
        assert (f"prefix key {1 << 40}" in tip.inner_text()) == (rid == 3)  # request 3's block is shared
    page.close()


def test_the_default_run_opens_and_scrubs(browser, tmp_path):
    """The azure-conv run of four allocators: time to first frame and scrub frame rate, printed (they
    depend on the machine: reported, not asserted)."""
    run = tmp_path / "run"
    assert pagelab("simulate", "--out", run, timeout=300).returncode == 0
    t0 = time.perf_counter()
    assert pagelab("view", run, timeout=300).returncode == 0
    view_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    page, errors, fetched = _open(browser, run / "view.html")
    open_s = time.perf_counter() - t0
    assert errors == [] and fetched == []
    fps = page.evaluate("""async () => {
        const [a, b] = [pagelabView.columns[0].windows[0].start, pagelabView.columns[0].windows[0].end];
        const s = document.getElementById('scrub'), n = 120, t0 = performance.now();
        for (let i = 0; i < n; i++) {
          s.value = a + (b - a) * i / n; s.dispatchEvent(new Event('input'));
          await new Promise(r => requestAnimationFrame(r));  // after the frame the input event asked for
        }
        return n / ((performance.now() - t0) / 1000); }""")
    draw_ms = page.evaluate("(f => f.slice(-100).sort((a, b) => a - b)[50])(pagelabView.frames)")
    size_mb = (run / "view.html").stat().st_size / 1e6
    print(f"\nazure-conv page: view {view_s:.1f} s, {size_mb:.1f} MB, opens in {open_s:.2f} s, scrubs at "
          f"{fps:.0f} frames/s (median draw {draw_ms:.1f} ms)")
    assert fps > 0 and draw_ms > 0
    page.close()


def test_a_served_page_loads_a_moment_outside_its_windows(browser, tmp_path):
    import threading

    from viz.explorer import Window
    from viz.explorer_page import make_server, write_page
    from viz.load import load_run

    run = load_run(write_small_run(tmp_path / "run"))
    page_path = tmp_path / "view.html"
    write_page(run, page_path, [Window(0.0, 1.0)], serve=True)
    server = make_server(run, page_path.read_bytes())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        page = browser.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"http://127.0.0.1:{server.server_port}/")
        page.wait_for_function("window.pagelabView && window.pagelabView.frames.length > 0")
        _scrub_to(page, 3.5)
        page.wait_for_function("!!pagelabView.columns[0].current")  # the window around 3.5 s arrived
        spc, cells = page.evaluate("[pagelabView.columns[0].spc, pagelabView.columns[0].cells]")
        np.testing.assert_array_equal(_cells(page, 0), _expected("paged", 3.5, spc, cells))
        assert errors == []
        page.close()
    finally:
        server.shutdown()
        server.server_close()


def test_padding_and_window_blocks_are_hatched_bands_inside_their_states(browser, tmp_path):
    """A gemma-3-27b run (padding layers, 1024-token windows) draws both parts as series stacked from the
    foot of their state and names them in the legend; the same run in one group draws neither."""
    labels = {}
    for name, extra in (("hybrid", ()), ("one-group", ("--disable-hybrid-kv-cache-manager",))):
        run = tmp_path / name
        assert pagelab("simulate", "mooncake-conv", "--limit", "12", "--model", "gemma-3-27b", "--gpu",
                       "h100-80gb", "--max-model-len", "32768", "-a", "paged", *extra, "-o", run,
                       timeout=300).returncode == 0
        assert pagelab("view", run, timeout=300).returncode == 0
        page, errors, fetched = _open(browser, run / "view.html")
        assert errors == [] and fetched == []
        labels[name] = page.evaluate("pagelabView.columns[0].mem.series.map(s => s.label)")[1:]
        legend = page.locator("p.legend").inner_text()
        # Each part's band starts at the foot of its state: the cumulative curve below that state.
        bands = page.evaluate("""() => {
            const u = pagelabView.columns[0].mem, lab = u.series.map(s => s.label);
            const at = l => u.data[lab.indexOf(l)];
            const out = {};
            for (const [part, state, below] of [["padding layers", "internal fragmentation", "reservation"],
                ["window blocks kept for prefix caching", "free", "external fragmentation"]]) {
              if (lab.indexOf(part) < 0) continue;
              out[part] = at(part).map((v, i) => [at(below)[i], v, at(state)[i]]);
            }
            return out; }""")
        page.close()
        if name == "hybrid":
            assert "padding layers" in legend and "window blocks kept for prefix caching" in legend
            assert len(bands) == 2
            for rows in bands.values():
                foot, top, state_top = np.array(rows).T
                assert (foot <= top + 1e-12).all() and (top <= state_top + 1e-12).all() and (top > foot).any()
        else:
            assert "padding layers" not in legend and bands == {}
    assert labels["hybrid"] == ["free", "window blocks kept for prefix caching", "external fragmentation",
                                "internal fragmentation", "padding layers", "reservation", "token states"]
    assert labels["one-group"] == [x for x in labels["hybrid"] if x not in (
        "padding layers", "window blocks kept for prefix caching")]


@pytest.fixture(scope="module")
def uneven_page(tmp_path_factory):
    """The small run with contiguous-max's memory table ending at 2 s, half-way through paged's 4 s."""
    root = write_small_run(tmp_path_factory.mktemp("uneven") / "run")
    folder = root / "contiguous-max"
    pd.read_parquet(folder / "memory.parquet").iloc[:8].to_parquet(folder / "memory.parquet")
    summary = json.loads((folder / "summary.json").read_text())
    (folder / "summary.json").write_text(json.dumps({**summary, "sim_duration_s": 2.0}))
    result = pagelab("view", root)
    assert result.returncode == 0, result.stderr
    return root / "view.html"


def test_the_charts_share_the_runs_clock_and_keep_their_markers(browser, uneven_page):
    page, errors, _ = _open(browser, uneven_page)
    charts = "pagelabView.columns.flatMap(c => [c.mem, c.count])"
    # One x range, the whole run, in every chart; each chart's data run to the end of its last row.
    assert page.evaluate(f"{charts}.map(u => [u.scales.x.min, u.scales.x.max])") == [[0, 4.0]] * 4
    assert page.evaluate(f"{charts}.map(u => u.data[0][u.data[0].length - 1])") == [4.0, 4.0, 2.0, 2.0]
    for t in (1.0, 3.5, 4.0):  # past 2 s, contiguous-max's marker would leave its chart
        page.evaluate("t => pagelabView.setTime(t)", t)
        boxes = page.evaluate(f"""{charts}.map(u => [u.marker, u.over].map(e => e.getBoundingClientRect())
                                                   .map(r => [r.left, r.right]))""")
        for (left, right), (lo, hi) in boxes:
            assert lo - 0.5 <= left and right <= hi + 0.5, (t, boxes)
    assert page.evaluate("document.documentElement.scrollWidth <= innerWidth")
    # The counts' y axis reaches their peak (4 running) with integer ticks between.
    ticks = page.evaluate("pagelabView.columns.map(c => c.count.axes[1]._splits)")
    assert ticks[0] == [0, 2, 4] and all(len(s) > 1 and s[-1] == max(s) for s in ticks)
    assert errors == []
    page.close()


def test_the_lanes_caption_and_the_note_read_right(browser, small_page):
    page, _, _ = _open(browser, small_page)
    _scrub_to(page, 0.2)  # one block and one region held
    notes = page.locator(".note").all_inner_texts()
    assert [n.split(";")[0] for n in notes] == ["1 block held", "1 region held"]
    # The centre line starts below the caption: clear at the top, drawn at the foot.
    alpha = page.evaluate("""() => { const c = pagelabView.columns[0].lanes, x = c.getContext('2d');
        return [0, c.height - 1].map(y => x.getImageData(c.width / 2, y, 1, 1).data[3]); }""")
    assert alpha == [0, 255]
    page.close()

"""Block map and block snapshot figures on the hand-built run: matrices, slot states, axes, legend."""
from __future__ import annotations

import numpy as np
import pytest
from viz_fixtures import write_small_run

from viz.blockmap import plot_block_map, zoom_window
from viz.load import load_run
from viz.snapshot import (
    SLOT_FREE,
    SLOT_HOLE,
    SLOT_INTERNAL,
    SLOT_RESERVED,
    SLOT_TOKEN,
    peak_time,
    plot_block_snapshot,
    pool_snapshot,
    tokens_at,
)


@pytest.fixture
def run(tmp_path):
    return load_run(write_small_run(tmp_path / "small"))


def test_block_map_rasters_side_by_side(run):
    result = plot_block_map(run, num_bins=4, max_rows=4)
    full = result.data["full"]
    assert list(full) == ["paged", "contiguous-max"]
    paged = full["paged"]
    assert paged.owner.tolist() == [[0, 0, 3, 3], [-1, 1, 1, -1], [-1, 1, 1, -1], [2, 2, 2, -1]]
    assert paged.ref_count[3].tolist() == [2, 2, 2, 0]
    assert paged.unfilled[0].tolist() == [False, False, True, True]
    assert full["contiguous-max"].pos_edges.tolist() == [0, 16, 32, 48, 64]
    assert full["contiguous-max"].owner[3].tolist() == [-1, -1, -1, -1]  # the hole above slot 48
    assert result.data["window"] is None  # a 4 s run needs no zoom
    axes = result.figure.axes
    assert len(axes) == 2
    assert axes[0].get_ylabel() == "pool position (token slot)"
    assert axes[1].get_xlabel() == "simulated time (s)"
    assert "paged (vLLM)" in axes[0].get_title() and "contiguous (Max)" in axes[1].get_title()
    assert axes[0].get_ylim() == (0, 64) and axes[0].get_xlim() == (0, 4)
    assert len(axes[0].images) == 1
    image = axes[0].images[0].get_array()
    assert image.shape == (4, 4, 3)
    assert image[1, 0].tolist() == [1.0, 1.0, 1.0]                 # free is white
    assert image[1, 1].tolist() == image[2, 1].tolist() != [1.0, 1.0, 1.0]  # one colour per request
    labels = [t.get_text() for t in result.figure.legends[0].get_texts()]
    assert "shared block, ref count 2" in labels
    assert "internal fragmentation (held, never filled)" in labels


def test_each_block_map_panel_shows_its_whole_pool(run):
    # A hybrid model's paged pool spans more slots than the contiguous one: neither may be cut to the other.
    run.allocators["paged"].summary["capacity_slots"] = 4 * 64
    axes = plot_block_map(run, num_bins=4, max_rows=4).figure.axes
    assert axes[0].get_ylim() == (0, 256) and axes[1].get_ylim() == (0, 64)
    assert "256 slots" in axes[0].get_title() and "64 slots" in axes[1].get_title()


def test_zoom_row_for_long_runs(run):
    # Stretch the run: same lifetimes, 100x longer span -> a zoom window of 8 median lifetimes.
    for alloc in run.allocators.values():
        alloc.summary["sim_duration_s"] = 400.0
    window = zoom_window(run, 400.0)
    life = run.allocators["paged"].requests.eval("finish_s - admitted_s").median()
    assert window[1] - window[0] == pytest.approx(8 * life)
    assert window[0] <= peak_time(run.allocators["paged"]) <= window[1]
    result = plot_block_map(run, num_bins=50, max_rows=4)
    assert len(result.figure.axes) == 4
    assert result.data["zoom"]["paged"].time_edges[0] == pytest.approx(window[0])
    assert "zoom" in result.figure.axes[2].get_title()


def test_tokens_at_interpolates_between_first_token_and_finish(run):
    tok = tokens_at(run.allocators["paged"].requests, 2.0)  # by row: req N is row N - 1
    # req 2: prompt 20, 6 outputs, first token 1.5, finish 3.0 -> 1 + floor(5/3) generated
    assert tok[1] == 22
    assert tok[3] == 3            # req 4 has not produced a token yet: just its prompt
    assert tok[0] == 12 + 4       # finished: prompt + all output


def test_paged_snapshot_slot_states(run):
    snap = pool_snapshot(run.allocators["paged"], 2.0)
    state, owner = snap.state, snap.owner
    assert (state[:16] == SLOT_FREE).all() and (owner[:16] == -1).all()   # req 1 left at t=2
    assert (state[16:38] == SLOT_TOKEN).all() and (owner[16:48] == 1).all()  # req 2, row 1
    assert (state[38:42] == SLOT_RESERVED).all()    # last block: 6 of its final 10 filled
    assert (state[42:48] == SLOT_INTERNAL).all()    # never filled
    assert (state[48:51] == SLOT_TOKEN).all() and (state[51:64] == SLOT_RESERVED).all()
    assert (snap.ref_count[48:64] == 2).all()
    assert not (state == SLOT_HOLE).any()           # 64 is a whole number of blocks


def test_contiguous_snapshot_marks_holes(run):
    snap = pool_snapshot(run.allocators["contiguous-max"], 1.5)
    state = snap.state
    assert (state[:17] == SLOT_TOKEN).all() and (state[17:20] == SLOT_RESERVED).all()
    assert (state[20:24] == SLOT_INTERNAL).all()
    assert (state[24:45] == SLOT_TOKEN).all() and state[45] == SLOT_RESERVED
    assert (state[46:48] == SLOT_INTERNAL).all()
    assert snap.hole_slots == 24 and (state[48:] == SLOT_HOLE).all()


def test_snapshot_figure_defaults_to_peak_usage(run):
    result = plot_block_snapshot(run)
    assert result.data["paged"].at_s == pytest.approx(1.375)   # the row with most blocks in use
    axes = [ax for ax in result.figure.axes if ax.images]
    assert len(axes) == 2
    assert "t = 1.375 s (peak usage)" in axes[0].get_title()
    assert axes[0].get_ylabel() == "first slot of row"
    assert axes[0].images[0].get_array().shape == (4, 16, 3)
    labels = [t.get_text() for t in result.figure.legends[0].get_texts()]
    expected = {"reserved, not yet filled", "hole (external fragmentation)", "shared block, ref count 2"}
    assert expected <= set(labels)
    at = plot_block_snapshot(run, at=2.0)
    assert np.array_equal(at.data["paged"].state, pool_snapshot(run.allocators["paged"], 2.0).state)
    assert "requested time" in at.figure.axes[0].get_title()


def test_time_bins_shrink_only_when_the_exact_majority_gets_expensive(run, monkeypatch):
    from viz import blockmap

    events = run.allocators["paged"].events
    # Rows of 32 slots: every 16-slot block covers half a row, so it is contested in every bin it spans.
    assert blockmap.time_bins_for(events, 64, 32, 0.0, 4.0, 400) == 400
    monkeypatch.setattr(blockmap, "CONTESTED_BUDGET", 500)
    monkeypatch.setattr(blockmap, "MIN_TIME_BINS", 10)
    # fixed = 5 partial rows, per bin = (2 + 2 + 2 + 2.2 + 1.75) s / 4 s: (500 - 5) / 2.4875 = 198.99
    assert blockmap.time_bins_for(events, 64, 32, 0.0, 4.0, 400) == 198
    assert blockmap.time_bins_for(events, 64, 16, 0.0, 4.0, 400) == 400  # whole-row blocks: cheap
    monkeypatch.setattr(blockmap, "CONTESTED_BUDGET", 10)
    assert blockmap.time_bins_for(events, 64, 32, 0.0, 4.0, 400) == 10

"""Request colours cannot be mistaken for memory states, and the legends say which colours are requests."""
from __future__ import annotations

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from viz_fixtures import write_small_run

from viz.blockmap import WINDOW_HINT, plot_block_map
from viz.errors import VizError
from viz.load import load_run
from viz.palette import FREE_RGB, OUTSIDE_POOL_RGB, OWNER_COLORS, OWNER_FAMILY, STATE_COLORS, owner_rgb
from viz.snapshot import SLOT_RESERVED, plot_block_snapshot, snapshot_image

MIN_DELTA_E = 35.0  # CIELAB distance: two colours this far apart are not taken for one another


def lab(colour) -> np.ndarray:
    """sRGB (D65) to CIELAB."""
    rgb = np.asarray(to_rgb(colour))
    rgb = np.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ rgb
    xyz = xyz / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def test_lab_distance_of_known_colours():
    assert np.allclose(lab("#FFFFFF"), [100, 0, 0], atol=0.1)
    assert np.allclose(lab("#000000"), [0, 0, 0], atol=0.1)
    assert np.linalg.norm(lab("#88CCEE") - lab(STATE_COLORS["reservation"])) < 10  # a near-miss is caught


@pytest.mark.parametrize("owner", OWNER_COLORS)
def test_no_request_colour_is_near_a_state_colour(owner):
    states = [*STATE_COLORS.values(), FREE_RGB, OUTSIDE_POOL_RGB]
    nearest = min(np.linalg.norm(lab(owner) - lab(state)) for state in states)
    assert nearest >= MIN_DELTA_E, owner


def test_neighbouring_requests_get_distinct_blues():
    colours = owner_rgb(np.arange(48))
    gaps = [np.linalg.norm(lab(a) - lab(b)) for a, b in zip(colours[:-1], colours[1:], strict=True)]
    assert min(gaps) >= 15


def _legend_texts(fig) -> list[str]:
    return [t.get_text() for t in fig.legends[0].get_texts()]


def test_legends_name_the_request_colours_and_reserved_slots_take_the_reservation_colour(tmp_path):
    run = load_run(write_small_run(tmp_path / "small"))
    block_map = plot_block_map(run, num_bins=4, max_rows=4)
    held = f"held ({OWNER_FAMILY}: one shade per request"
    assert any(text.startswith(held) for text in _legend_texts(block_map.figure))
    snapshot = plot_block_snapshot(run)
    assert f"tokens ({OWNER_FAMILY}: one shade per request)" in _legend_texts(snapshot.figure)
    snap = snapshot.data["paged"]
    assert (snap.state == SLOT_RESERVED).any()
    grid = snapshot_image(snap, width=16).reshape(-1, 3)[: len(snap.state)]
    assert {tuple(np.round(c, 6)) for c in grid[snap.state == SLOT_RESERVED]} == \
        {tuple(np.round(to_rgb(STATE_COLORS["reservation"]), 6))}


def test_a_block_map_window_says_what_it_shows_and_how_to_ask_for_another(tmp_path):
    run = load_run(write_small_run(tmp_path / "small"))
    whole = plot_block_map(run, num_bins=4, max_rows=4)
    assert WINDOW_HINT not in whole.figure.get_suptitle()
    end = whole.data["span"][1]
    part = plot_block_map(run, num_bins=4, max_rows=4, window=(1.0, 2.5))
    assert part.data["span"] == (1.0, 2.5)
    assert f"(1 to 2.5 s of {end:g} s; {WINDOW_HINT})" in part.figure.get_suptitle()
    assert part.figure.axes[0].get_xlim() == (1.0, 2.5)
    with pytest.raises(VizError, match="starts after the end of the run"):
        plot_block_map(run, window=(end + 1, end + 2))
    with pytest.raises(VizError, match="expected START:END seconds"):
        plot_block_map(run, window=(2.0, 1.0))

"""The validation figure: each run against the targets, the part's noise floor, unjudged runs in grey."""
import numpy as np
import pytest
from matplotlib.colors import to_hex

from viz.common import save_figure
from viz.validation import MET_COLOR, MISSED_COLOR, UNJUDGED_LABEL_COLOR, HeldOutRun, plot_validation

RUNS = [HeldOutRun("A", "A", 0.044, 0.005), HeldOutRun("B", "B", 0.123, -0.024),
        HeldOutRun("C", "C", 0.02, None), HeldOutRun("B-repeat", "B", 0.05, -0.061)]
FLOOR = {"B": (0.099, 0.025), "C": (0.041, 0.062)}  # A not repeated; C's throughput floor over 5 %


def test_data_has_each_runs_verdicts_and_its_parts_floor():
    data = plot_validation(RUNS, FLOOR, 0.10, 0.05).data
    assert data["runs"] == ["A", "B", "C", "B-repeat"]
    assert data["e2e_pct"] == pytest.approx([4.4, 12.3, 2.0, 5.0])
    assert data["e2e_met"] == [True, False, True, True]
    assert data["throughput_met"] == [True, True, False, False]  # no value is no verdict
    assert data["floor_e2e_pct"][0] is None and data["floor_e2e_pct"][3] == pytest.approx(9.9)
    # Judged: only where the part was repeated within both targets (B), never A (no floor) or C.
    assert data["judged"] == [False, True, False, True]


def test_figure_draws_a_bar_and_floor_marker_per_run_and_greys_unjudged_names(tmp_path):
    result = plot_validation(RUNS, FLOOR, 0.10, 0.05, title="t")
    e2e_ax, thr_ax = result.figure.axes[:2]
    bars = e2e_ax.containers[0]
    assert len(bars) == 4
    assert [b.get_width() for b in bars] == pytest.approx([4.4, 12.3, 2.0, 5.0])
    colors = [to_hex(b.get_facecolor()).upper() for b in bars]
    assert colors == [MET_COLOR, MISSED_COLOR, MET_COLOR, MET_COLOR]
    assert [b.get_width() for b in thr_ax.containers[0]] == pytest.approx([0.5, -2.4, 0.0, -6.1])
    floors = np.ma.filled(e2e_ax.collections[0].get_offsets()[:, 0], np.nan)  # no floor: no marker
    assert np.isnan(floors[0]) and floors[1:] == pytest.approx([9.9, 4.1, 9.9])
    greys = [label.get_text() for label in e2e_ax.get_yticklabels()
             if label.get_color() == UNJUDGED_LABEL_COLOR]
    assert greys == ["A", "C"]
    assert save_figure(result.figure, tmp_path / "validation.png", "png").stat().st_size > 1000

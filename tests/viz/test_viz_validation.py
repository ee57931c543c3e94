"""The validation figure: each run against the targets, the part's noise floor, unjudged runs in grey."""
import numpy as np
import pytest
from matplotlib.colors import to_hex

from viz.common import save_figure
from viz.validation import MET_COLOR, MISSED_COLOR, UNJUDGED_LABEL_COLOR, HeldOutRun, plot_validation

# Verdicts as bench.calibration gives them (tests/bench/test_calibration.py checks how it decides them).
RUNS = [HeldOutRun("A", 0.044, 0.005, True, True, judged=False),
        HeldOutRun("B", 0.123, -0.024, False, True, judged=True, floor_e2e=0.099, floor_throughput=0.025),
        HeldOutRun("C", 0.02, None, True, False, judged=False, floor_e2e=0.041, floor_throughput=0.062),
        HeldOutRun("B-repeat", 0.05, -0.061, True, False, judged=True, floor_e2e=0.099,
                   floor_throughput=0.025)]


def test_data_has_each_runs_values_in_percent_and_its_verdicts():
    data = plot_validation(RUNS, 0.10, 0.05).data
    assert data["runs"] == ["A", "B", "C", "B-repeat"]
    assert data["e2e_pct"] == pytest.approx([4.4, 12.3, 2.0, 5.0])
    assert data["throughput_pct"][2] is None
    assert data["floor_e2e_pct"][0] is None and data["floor_e2e_pct"][3] == pytest.approx(9.9)
    assert data["floor_throughput_pct"][2] == pytest.approx(6.2)
    assert data["e2e_met"] == [True, False, True, True] and data["judged"] == [False, True, False, True]


def test_figure_draws_a_bar_and_floor_marker_per_run_and_greys_unjudged_names(tmp_path):
    result = plot_validation(RUNS, 0.10, 0.05, title="t")
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

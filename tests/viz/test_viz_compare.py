"""The simulated-vs-measured latency overlay draws both runs' CDFs from request tables."""
import numpy as np
import pandas as pd

from viz.common import save_figure
from viz.compare import METRICS, plot_latency_overlay


def _requests(scale: float, n: int = 50) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    e2e = scale * rng.uniform(1, 5, n)
    df = pd.DataFrame({"ttft_s": e2e / 4, "tpot_s": e2e / 40, "e2e_s": e2e})
    df.loc[0, "e2e_s"] = np.nan  # an unfinished request is left out
    return df


def test_overlay_has_both_runs_per_metric_and_saves(tmp_path):
    real, sim = _requests(1.0), _requests(1.5)
    result = plot_latency_overlay(sim, real)
    assert set(result.data) == set(METRICS)
    x_real, y_real = result.data["e2e_s"]["measured"]
    x_sim, _ = result.data["e2e_s"]["simulated"]
    assert len(x_real) == 49 and y_real[-1] == 1.0 and np.all(np.diff(x_real) >= 0)
    assert np.median(x_sim) == np.median(x_real) * 1.5
    axes = result.figure.axes
    assert all(len(ax.lines) == 2 for ax in axes[:3])
    path = save_figure(result.figure, tmp_path / "overlay.png", "png")
    assert path.stat().st_size > 1000

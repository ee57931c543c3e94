"""Downsampling keeps time-weighted means exact and never loses a peak."""
from __future__ import annotations

import numpy as np
import pytest

from viz.downsample import bin_envelope, bin_mean, cdf_points, downsample_steps


def _rows(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Back-to-back rows with random widths (some zero) and values."""
    dt = rng.exponential(1.0, n) * (rng.random(n) > 0.1)
    t = np.concatenate([[0.0], np.cumsum(dt)[:-1]])
    return t, dt, rng.normal(size=n)


def test_single_step_spike_survives_downsampling():
    n = 200_000
    t = np.arange(n) * 0.01
    values = np.full(n, 0.3)
    spike = 123_457
    values[spike] = 1.0
    out = downsample_steps(t, np.full(n, 0.01), values, max_bins=500)
    assert len(out.edges) == 501
    b = np.searchsorted(out.edges, t[spike], side="right") - 1
    assert out.hi[b] == 1.0
    assert np.nanmax(out.hi) == 1.0
    assert out.mean[b] == pytest.approx(0.3 + 0.7 / 400)  # one row of the 400 in its bin
    assert np.nanmax(np.delete(out.hi, b)) == 0.3


def test_zero_width_spike_is_kept_in_its_bin():
    t = np.array([0.0, 1.0, 1.0, 3.0])
    dt = np.array([1.0, 0.0, 2.0, 1.0])
    lo, hi = bin_envelope(t, dt, np.array([0.0, 9.0, 1.0, 2.0]), np.array([0.0, 2.0, 4.0]))
    assert hi.tolist() == [9.0, 2.0]
    assert lo.tolist() == [0.0, 1.0]


@pytest.mark.parametrize("seed", range(4))
def test_bin_statistics_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    t, dt, v = _rows(rng, 300)
    edges = np.sort(np.concatenate([[0.0, t[-1] + dt[-1]], rng.uniform(0, t[-1] + dt[-1], 25)]))
    mean = bin_mean(t, dt, v, edges)
    lo, hi = bin_envelope(t, dt, v, edges)
    for i in range(len(edges) - 1):
        a, b = edges[i], edges[i + 1]
        overlap = np.clip(np.minimum(t + dt, b) - np.maximum(t, a), 0, None)
        touching = (overlap > 0) | ((dt == 0) & (t >= a) & (t < b))
        if overlap.sum() > 0:
            assert mean[i] == pytest.approx(np.sum(overlap * v) / overlap.sum())
        if touching.any():
            assert hi[i] == v[touching].max()
            assert lo[i] == v[touching].min()
        else:
            assert np.isnan(hi[i])


def test_binned_fractions_still_sum_to_one():
    rng = np.random.default_rng(3)
    t, dt, _ = _rows(rng, 5000)
    fractions = rng.dirichlet(np.ones(5), 5000)
    out = downsample_steps(t, dt, fractions, max_bins=100)
    covered = ~np.isnan(out.mean[:, 0])
    assert covered.sum() > 90
    assert np.allclose(out.mean[covered].sum(axis=1), 1.0)
    assert (out.hi >= out.mean - 1e-12)[covered].all()


def test_short_series_pass_through_unchanged():
    t = np.array([0.0, 0.5, 2.0])
    dt = np.array([0.5, 1.5, 1.0])
    v = np.array([1.0, 2.0, 3.0])
    out = downsample_steps(t, dt, v, max_bins=10)
    assert out.edges.tolist() == [0.0, 0.5, 2.0, 3.0]
    assert out.mean.tolist() == out.hi.tolist() == out.lo.tolist() == [1.0, 2.0, 3.0]


def test_cdf_points_keep_extremes_and_drop_nans():
    rng = np.random.default_rng(5)
    values = np.concatenate([rng.lognormal(size=50_000), [np.nan, np.nan]])
    x, y = cdf_points(values, max_points=300)
    assert len(x) <= 300
    assert x[0] == np.nanmin(values) and x[-1] == np.nanmax(values)
    assert y[-1] == 1.0 and np.all(np.diff(x) >= 0) and np.all(np.diff(y) > 0)
    xs, ys = cdf_points(np.array([3.0, 1.0, 2.0]))
    assert xs.tolist() == [1.0, 2.0, 3.0]
    assert ys.tolist() == pytest.approx([1 / 3, 2 / 3, 1.0])

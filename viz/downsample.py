"""Shrink long time series for plotting without hiding peaks.

A memory row covers [t_s, t_s + dt_s). Binned series keep, per time bin, the time-weighted mean
(for stacked areas, so the five fractions still sum to 1) and the exact min and max over every row
that overlaps the bin (so a single-step spike always survives as an envelope).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

DEFAULT_MAX_BINS = 1500


@dataclass(frozen=True)
class Binned:
    """A step series on `edges` (len n+1): per bin mean, min and max (each shape (n,) or (n, k))."""

    edges: np.ndarray
    mean: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


def _as_2d(values: np.ndarray) -> tuple[np.ndarray, bool]:
    """View values as (rows, k) and remember whether they were 1-D."""
    values = np.asarray(values, dtype=float)
    return (values[:, None], True) if values.ndim == 1 else (values, False)


def _integral(t: np.ndarray, dt: np.ndarray, v: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Area under the step series v (rows, k) and time covered by its rows, up to each x: additive over
    disjoint sets of rows, so a series read in chunks sums its chunks' integrals."""
    area = np.vstack([np.zeros((1, v.shape[1])), np.cumsum(v * dt[:, None], axis=0)])
    covered = np.concatenate([[0.0], np.cumsum(dt)])
    k = np.searchsorted(t, x, side="right") - 1
    inside = k >= 0
    kc = np.clip(k, 0, None)
    part = np.where(inside, np.clip(x - t[kc], 0.0, dt[kc]), 0.0)
    base_area = np.where(inside[:, None], area[kc], 0.0)
    base_cov = np.where(inside, covered[kc], 0.0)
    return base_area + part[:, None] * v[kc], base_cov + part


def _mean_from(a: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Per-bin means from the integrals at the bin edges (NaN where no row covers the bin)."""
    da, dc = np.diff(a, axis=0), np.diff(c)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(dc[:, None] > 0, da / dc[:, None], np.nan)


def bin_mean(t: np.ndarray, dt: np.ndarray, values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Time-weighted mean of the step series per bin (NaN where no row covers the bin).

    Uses the running integral evaluated at the bin edges, so it costs O(rows + bins).
    """
    t, dt = np.asarray(t, dtype=float), np.asarray(dt, dtype=float)
    v, flat = _as_2d(values)
    mean = _mean_from(*_integral(t, dt, v, np.asarray(edges, dtype=float)))
    return mean[:, 0] if flat else mean


def bin_envelope(t: np.ndarray, dt: np.ndarray, values: np.ndarray, edges: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Exact min and max per bin over every row overlapping it (NaN where none does).

    The rows overlapping bin [e_i, e_i+1) are the row active at e_i plus the rows starting inside
    the bin; rows with dt_s == 0 count in the bin that holds their instant.
    """
    t, dt = np.asarray(t, dtype=float), np.asarray(dt, dtype=float)
    v, flat = _as_2d(values)
    edges = np.asarray(edges, dtype=float)
    nbins = len(edges) - 1
    lo = np.full((nbins, v.shape[1]), np.inf)
    hi = np.full((nbins, v.shape[1]), -np.inf)
    # Rows active at each left edge (they started before it and end after it).
    k = np.searchsorted(t, edges[:-1], side="right") - 1
    kc = np.clip(k, 0, None)
    active = (k >= 0) & (t[kc] + dt[kc] > edges[:-1]) & (t[kc] < edges[:-1])
    lo[active], hi[active] = v[kc[active]], v[kc[active]]
    # Rows starting inside each bin: sorted by t, so each bin's rows are one slice.
    b = np.searchsorted(edges, t, side="right") - 1
    keep = (b >= 0) & (b < nbins)
    if np.any(keep):
        bk, vk = b[keep], v[keep]
        first = np.flatnonzero(np.concatenate([[True], bk[1:] != bk[:-1]]))
        bins = bk[first]
        lo[bins] = np.minimum(lo[bins], np.minimum.reduceat(vk, first, axis=0))
        hi[bins] = np.maximum(hi[bins], np.maximum.reduceat(vk, first, axis=0))
    empty = ~np.isfinite(lo)
    lo[empty], hi[empty] = np.nan, np.nan
    return (lo[:, 0], hi[:, 0]) if flat else (lo, hi)


def downsample_steps(t: np.ndarray, dt: np.ndarray, values: np.ndarray,
                     max_bins: int = DEFAULT_MAX_BINS) -> Binned:
    """Step series ready to plot: unchanged when short, else binned with mean and min/max envelope."""
    t, dt = np.asarray(t, dtype=float), np.asarray(dt, dtype=float)
    v = np.asarray(values, dtype=float)
    if len(t) == 0:
        empty = np.zeros((0,) + v.shape[1:])
        return Binned(np.zeros(1), empty, empty, empty)
    if len(t) <= max_bins:
        edges = np.append(t, t[-1] + dt[-1])
        return Binned(edges, v, v, v)
    edges = np.linspace(t[0], max(t[-1] + dt[-1], t[0] + 1e-12), max_bins + 1)
    lo, hi = bin_envelope(t, dt, v, edges)
    return Binned(edges, bin_mean(t, dt, v, edges), lo, hi)


def downsample_chunks(chunks: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]], num_rows: int,
                      span: tuple[float, float], max_bins: int = DEFAULT_MAX_BINS) -> Binned:
    """`downsample_steps` of a series read in time-ordered chunks (t, dt, values) of `num_rows` rows in
    all, the first starting at span[0] and the last ending at span[1]: memory is one chunk plus the bins.

    Means and envelopes are additive over chunks (integrals at the edges, min/max of the rows that
    overlap each bin); means equal the whole-series ones up to float rounding.
    """
    if num_rows <= max_bins:
        parts = list(chunks)
        if not parts:
            return downsample_steps(np.zeros(0), np.zeros(0), np.zeros(0), max_bins)
        t, dt, v = (np.concatenate([p[i] for p in parts]) for i in range(3))
        return downsample_steps(t, dt, v, max_bins)
    edges = np.linspace(span[0], max(span[1], span[0] + 1e-12), max_bins + 1)
    a = c = lo = hi = None
    flat = False
    for t, dt, values in chunks:
        t, dt = np.asarray(t, dtype=float), np.asarray(dt, dtype=float)
        v, flat = _as_2d(values)
        if not len(t):
            continue
        ca, cc = _integral(t, dt, v, edges)
        clo, chi = bin_envelope(t, dt, v, edges)
        if a is None:
            a, c, lo, hi = ca, cc, clo, chi
        else:
            a, c, lo, hi = a + ca, c + cc, np.fmin(lo, clo), np.fmax(hi, chi)
    mean = _mean_from(a, c)
    return Binned(edges, *((m[:, 0] for m in (mean, lo, hi)) if flat else (mean, lo, hi)))


def cdf_points(values: np.ndarray, max_points: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    """Empirical CDF (x sorted, y in (0, 1]) thinned to about max_points, always keeping min and max."""
    x = np.sort(np.asarray(values, dtype=float)[np.isfinite(values)])
    n = len(x)
    if n == 0:
        return x, x
    y = np.arange(1, n + 1) / n
    if n <= max_points:
        return x, y
    idx = np.unique(np.linspace(0, n - 1, max_points).round().astype(np.int64))
    return x[idx], y[idx]

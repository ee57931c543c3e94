"""pagelab.column_stats: exact percentiles of a column read in blocks, equal to numpy's on the whole."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagelab import column_stats as cs


def blocks_of(values: np.ndarray, cuts: list[int], weights: np.ndarray | None = None):
    """A Batches reader over `values` cut at the (sorted) positions `cuts`."""
    edges = [0, *sorted(c % (len(values) + 1) for c in cuts), len(values)]

    def read():
        for a, b in zip(edges[:-1], edges[1:], strict=True):
            yield values[a:b], None if weights is None else weights[a:b]
    return read


# Few distinct values, so selection runs all the way down the key and through collected buckets.
FLOATS = st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=64),
                   st.sampled_from([0.0, -0.0, 1e-300, -1.5, 0.035, 0.0351, 7.0, 1e300]))


@settings(max_examples=150, deadline=None)
@given(st.lists(FLOATS, min_size=1, max_size=60), st.lists(st.integers(0, 60), max_size=4),
       st.lists(st.floats(0, 100), min_size=1, max_size=5))
def test_percentiles_and_median_equal_numpy(values, cuts, qs):
    v = np.array(values)
    read = blocks_of(v, cuts)
    with np.errstate(over="ignore", invalid="ignore"):
        expect = [float(np.percentile(v, q)) for q in qs]
        med, got = cs.median_and_percentiles(read, len(v), qs)
        expect_med = float(np.median(v))
    np.testing.assert_array_equal(got, expect)
    np.testing.assert_array_equal(med, expect_med)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(FLOATS, st.integers(1, 20)), min_size=1, max_size=40),
       st.lists(st.integers(0, 40), max_size=4), st.lists(st.floats(0, 100), min_size=1, max_size=4))
def test_weighted_percentiles_equal_the_repeated_sample(pairs, cuts, qs):
    values = np.array([v for v, _ in pairs])
    weights = np.array([w for _, w in pairs], dtype=float)
    sample = np.repeat(values, weights.astype(int))
    with np.errstate(over="ignore", invalid="ignore"):
        expect = [float(np.percentile(sample, q)) for q in qs]
        med, got = cs.median_and_percentiles(blocks_of(values, cuts, weights), len(sample), qs)
        expect_med = float(np.median(sample))
    np.testing.assert_array_equal(got, expect)
    np.testing.assert_array_equal(med, expect_med)


def test_a_bucket_too_large_to_collect_is_split_again():
    # 200k values sharing their top 32 key bits: two histogram passes cannot narrow them below the
    # collect limit, so selection goes on down the key.
    rng = np.random.default_rng(0)
    base = np.float64(0.035).view(np.uint64)
    v = (base + rng.integers(0, 1 << 20, 200_000).astype(np.uint64)).view(np.float64)
    read = blocks_of(v, [70_000, 140_000])
    qs = [0, 12.5, 50, 99, 100]
    assert cs.median_and_percentiles(read, len(v), qs)[1] == [float(np.percentile(v, q)) for q in qs]
    same = np.full(100_000, 0.25)
    assert cs.median_and_percentiles(blocks_of(same, [1]), len(same), ())[0] == 0.25


def test_weighted_selection_through_several_histogram_passes():
    # 200k values in one binade with uneven weights: the first passes cannot collect, so the weights'
    # histogram (not the counts') must pick each bucket.
    rng = np.random.default_rng(2)
    base = np.float64(1.0).view(np.uint64)
    v = (base + rng.integers(0, 1 << 40, 200_000).astype(np.uint64)).view(np.float64)
    w = np.where(v < 1.25, 9.0, 1.0)  # a quarter of the values carry most of the weight
    qs = [1, 25, 50, 75, 99.9]
    expect = [float(np.percentile(np.repeat(v, w.astype(int)), q)) for q in qs]
    assert cs.median_and_percentiles(blocks_of(v, [65_536, 131_072], w), int(w.sum()), qs)[1] == expect


def test_select_reads_the_column_a_few_times_only():
    reads = []
    v = np.random.default_rng(1).lognormal(size=300_000)

    def read():
        reads.append(1)
        yield from blocks_of(v, [100_000, 200_000])()
    _, got = cs.median_and_percentiles(read, len(v), [50, 90, 99])
    assert got == pytest.approx(np.percentile(v, [50, 90, 99]), abs=0)
    assert len(reads) <= 4  # two histogram passes and one collect pass here (each a read of the column)


def test_known_ranks_are_reused_and_only_missing_ones_selected():
    v = np.random.default_rng(3).normal(size=5000)
    passes = []
    inner = blocks_of(v, [700, 2100, 4000])

    def read():
        passes.append(1)
        yield from inner()
    known: dict[int, float] = {}
    first = cs.median_and_percentiles(read, len(v), (50, 90, 99), known)
    assert passes and len(known) >= 4  # the median's and each percentile's ranks were selected
    passes.clear()
    again = cs.median_and_percentiles(read, len(v), (99, 50), known)
    assert passes == []  # every rank asked was known: no pass over the blocks
    assert again == (first[0], [first[1][2], first[1][0]])
    more = cs.median_and_percentiles(read, len(v), (10,), known)
    assert passes and more[1] == [float(np.percentile(v, 10))] and more[0] == float(np.median(v))


def test_weighted_sums_are_the_same_whatever_the_number_of_blas_threads():
    # A BLAS dot product splits a long vector among threads: its last bits would follow the core count.
    code = ("import numpy as np; from pagelab.column_stats import weighted_sum; "
            "rng = np.random.default_rng(0); w, a, m = rng.random(1_000_003), rng.random(1_000_003), "
            "rng.random((50_000, 12)); "
            "print(repr(float(weighted_sum(w, a))), weighted_sum(m[:, 0], m).tolist())")
    root = Path(__file__).resolve().parents[2]
    outs = {subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                           env={**os.environ, "OPENBLAS_NUM_THREADS": str(n)}).stdout for n in (1, 2, 4)}
    assert len(outs) == 1, outs


GAP = st.one_of(st.just(0.0), st.floats(1e-6, 1e6), st.sampled_from([0.0125, 0.0126, 2.5]))
GAPS = st.lists(st.tuples(GAP, st.integers(1, 20)), min_size=1, max_size=80)


@settings(max_examples=150, deadline=None)
@given(GAPS, st.lists(st.floats(0, 100), min_size=1, max_size=5))
def test_gap_histogram_is_numpys_within_a_bins_width(pairs, qs):
    h = cs.GapHistogram()
    for gap, count in pairs:
        h.add(gap, count)
    pooled = np.repeat([g for g, _ in pairs], [c for _, c in pairs])
    n, mean, std = h.moments()
    assert n == len(pooled)
    assert mean == pytest.approx(pooled.mean(), rel=1e-12, abs=1e-300)
    # A bin's spread is its sum of squares less its squared sum: it keeps ~half the float digits.
    assert std == pytest.approx(pooled.std(), rel=1e-6, abs=1e-7 * pooled.max())
    median, got = h.median_and_percentiles(qs)
    width = 2.0 ** -cs.GAP_BITS
    for value, expect in zip([median, *got], [np.median(pooled), *np.percentile(pooled, qs)], strict=True):
        assert abs(value - expect) <= width * abs(expect) + 1e-15


@settings(max_examples=60, deadline=None)
@given(GAPS, st.lists(st.integers(0, 80), max_size=4))
def test_gap_histogram_bits_do_not_depend_on_how_gaps_were_buffered(pairs, cuts):
    one = cs.GapHistogram()
    for gap, count in pairs:
        one.add(gap, count)
    two = cs.GapHistogram()
    edges = [0, *sorted(c % (len(pairs) + 1) for c in cuts), len(pairs)]
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        for gap, count in pairs[a:b]:
            two.add_each([gap], count)
        two.flush()
    one.flush()
    for name in ("counts", "sums", "squares"):
        assert np.array_equal(getattr(one, name), getattr(two, name))

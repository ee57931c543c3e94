"""Exact statistics of a column read in batches: memory bounded by a batch, not by the column.

A 10M-request table's latency column is 80 MB; sorting it whole at the end of a 10M-request run takes a
few times that, more than a whole 1M-request run. Here percentiles are found by radix selection over
the file: each pass reads the column batch by batch and histograms the next 12 bits of an
order-preserving integer key of the values that can still hold the answer; once the candidates are few
they are collected and sorted. The answers are exactly numpy's: `median_and_percentiles` as np.median
and np.percentile (linear), of the values themselves or, where the batches carry integer weights, of
the values repeated by their weights. Sums add batch partial sums in batch order, so a table gives the
same numbers in memory and streamed when both are read in the same batches (`BATCH_ROWS`).
`GapHistogram` pools a run's inter-token gaps (the ITL), too many to keep, in fixed bins.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np

# Rows per batch: the request table's row groups (simulator/output, Sizes.request_group_rows), so a batch
# is one row group read as is; larger batches would concatenate groups and enlarge a selection pass's
# temporaries in proportion.
BATCH_ROWS = 1 << 14
_BITS = 12  # key bits decided per pass (the first pass: sign and exponent)
_FEW = 1 << 16  # candidates collected and sorted at once
_SIGN = np.uint64(1 << 63)

Batches = Callable[[], Iterator[tuple[np.ndarray, np.ndarray | None]]]  # (values, weights or None) batches


def weighted_sum(weights: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The sum over rows of `weights[i] * values[i]`: a 0-d array for a column, one sum per column for a
    2-D `values`. The same on every machine: a BLAS dot product splits long vectors among as many threads
    as there are cores (so its last bits follow the core count), and its idle threads then spin for a
    while, burning a core a run's child process could use."""
    return np.einsum("i,i...->...", weights, values)


def _keys(values: np.ndarray) -> np.ndarray:
    """uint64 keys ordered as the (non-NaN) float64 values; -0.0 and 0.0 get the same key."""
    # In place on one copy: a batch's keys are the pass's largest temporary (8 bytes a row).
    bits = np.array(values, np.float64)
    bits += 0.0  # turns -0.0 into 0.0
    bits = bits.view(np.uint64)
    negative = bits >= _SIGN
    np.invert(bits, out=bits, where=negative)
    np.bitwise_or(bits, _SIGN, out=bits, where=~negative)
    return bits


def _value(key: int) -> float:
    """The float64 of a key (inverse of `_keys`)."""
    k = np.uint64(key)
    bits = k & ~_SIGN if k & _SIGN else ~k
    return float(np.array([bits], np.uint64).view(np.float64)[0])


class _Target:
    """One order statistic being selected: the first value, in sorted order, at which the cumulative
    weight reaches `want` (an unweighted rank r, 0-based, is want = r + 1)."""

    __slots__ = ("want", "below", "prefix", "shift", "collect", "num_candidates", "value")

    def __init__(self, want: float) -> None:
        self.want, self.below = want, 0.0  # weight of the values under the prefix's range
        self.prefix, self.shift = 0, 0  # the top `shift` bits of the answer's key
        self.collect = False
        self.num_candidates = 0  # of the values sharing the prefix, once `collect` is set
        self.value: float | None = None

    def matches(self, keys: np.ndarray) -> np.ndarray | None:
        """Which keys share the decided top bits (None: all of them)."""
        if self.shift == 0:
            return None
        return (keys >> np.uint64(64 - self.shift)) == np.uint64(self.prefix)

    def key_range(self) -> tuple[np.uint64, np.uint64]:
        """The lowest and the highest key that `matches` (its decided top bits, then all 0s or all 1s)."""
        low = self.prefix << (64 - self.shift)
        return np.uint64(low), np.uint64(low + (1 << (64 - self.shift)) - 1)


def select(batches: Batches, wants: Iterable[float]) -> list[float]:
    """The first value, in sorted order, where the cumulative weight reaches each of `wants`."""
    targets = [_Target(float(w)) for w in wants]
    while any(t.value is None for t in targets):
        _histogram_pass(batches, [t for t in targets if t.value is None and not t.collect])
        _collect_pass(batches, [t for t in targets if t.value is None and t.collect])
    return [t.value for t in targets]


def _histogram_pass(batches: Batches, targets: list[_Target]) -> None:
    """Decide the next `_BITS` bits of each target (targets on the same prefix share one histogram)."""
    groups: dict[tuple[int, int], list[_Target]] = {}
    for t in targets:
        groups.setdefault((t.shift, t.prefix), []).append(t)
    if not groups:
        return
    bits = {g: min(_BITS, 64 - g[0]) for g in groups}  # the last pass decides what is left of 64
    counts = {g: np.zeros(1 << n, np.int64) for g, n in bits.items()}
    sums: dict[tuple[int, int], np.ndarray] = {}  # of the weights, when the batches carry weights
    for values, weights in batches():
        keys = _keys(values)
        for g, members in groups.items():
            sel = members[0].matches(keys)
            k = keys if sel is None else keys[sel]
            bucket = k >> np.uint64(64 - g[0] - bits[g])
            bucket &= np.uint64((1 << bits[g]) - 1)
            bucket = bucket.view(np.int64)  # bins fit: under 2^bits
            counts[g] += np.bincount(bucket, minlength=1 << bits[g])
            if weights is not None:
                w = weights if sel is None else weights[sel]
                sums.setdefault(g, np.zeros(1 << bits[g]))
                sums[g] += np.bincount(bucket, w, minlength=1 << bits[g])
    for g, members in groups.items():
        cum = np.cumsum(sums.get(g, counts[g]))  # unweighted: the counts are the sums
        for t in members:
            b = min(int(np.searchsorted(cum, t.want - t.below, side="left")), (1 << bits[g]) - 1)
            t.below += float(cum[b - 1]) if b else 0.0
            t.prefix, t.shift = t.prefix << bits[g] | b, t.shift + bits[g]
            if t.shift == 64:
                t.value = _value(t.prefix)  # every candidate has this very key
            elif counts[g][b] <= _FEW:
                t.collect, t.num_candidates = True, int(counts[g][b])


def _collect_pass(batches: Batches, targets: list[_Target]) -> None:
    """Gather each target's few candidates, sort them and pick the answer.

    A batch's candidates are copied into one buffer per target from the batch's keys sorted (a
    contiguous run: they share the key's top bits), not taken as a small array of their own per batch:
    numpy keeps freed arrays under 1 KB in a cache, up to seven of each size, and a 10M-row column's
    batches hold ~50-95 candidates each, so their arrays would fill the cache's buckets with pieces of the
    heap allocated in the middle of a run's trace check, and the loop's pages would spread over the holes
    under them.
    """
    if not targets:
        return
    keys_of = [np.empty(t.num_candidates, np.uint64) for t in targets]
    weights_of = [np.empty(t.num_candidates) for t in targets]
    filled = [0] * len(targets)
    ranges = [t.key_range() for t in targets]
    for values, weights in batches():
        keys = _keys(values)  # a copy of the batch's values: sorted in place
        if weights is None:
            keys.sort()
        else:
            order = np.argsort(keys, kind="stable")  # equal keys keep their weights in batch order
            np.take(keys, order, out=keys)
        for i, (low, high) in enumerate(ranges):
            start = int(np.searchsorted(keys, low, side="left"))
            end = int(np.searchsorted(keys, high, side="right"))
            n, at = end - start, filled[i]
            keys_of[i][at:at + n] = keys[start:end]
            if weights is None:
                weights_of[i][at:at + n] = 1.0
            else:
                np.take(weights, order[start:end], out=weights_of[i][at:at + n], mode="clip")  # no copy
            filled[i] += n
    for t, keys, ws, n in zip(targets, keys_of, weights_of, filled, strict=True):
        keys, ws = keys[:n], ws[:n]
        order = np.argsort(keys, kind="stable")
        cum = np.cumsum(ws[order])
        at = min(int(np.searchsorted(cum, t.want - t.below, side="left")), len(order) - 1)
        t.value = _value(int(keys[order[at]]))


def median_and_percentiles(batches: Batches, count: int, qs: Iterable[float],
                           known: dict[int, float] | None = None) -> tuple[float, list[float]]:
    """np.median and np.percentile (linear) at each q of `count` values, in one selection; batches with
    integer weights stand for their values repeated, `count` being the weights' sum. `known` (0-based
    rank -> value) holds values selected earlier from the same batches: only the ranks it lacks are
    selected, and they are added to it."""
    qs = list(qs)
    virtual = [(count - 1) * (q / 100) for q in qs]
    lows = [int(np.floor(v)) for v in virtual]
    mid = count // 2
    middle = [mid] if count % 2 else [mid - 1, mid]
    ranks = sorted({*middle, *(r for lo in lows for r in (lo, min(lo + 1, count - 1)))})
    found = {} if known is None else known
    missing = [r for r in ranks if r not in found]
    if missing:
        found.update(zip(missing, select(batches, [r + 1 for r in missing]), strict=True))
    out = []
    for v, lo in zip(virtual, lows, strict=True):
        a, b, t = found[lo], found[min(lo + 1, count - 1)], v - lo
        out.append(float(b - (b - a) * (1 - t)) if t >= 0.5 else float(a + (b - a) * t))  # numpy's _lerp
    return float(np.mean(np.array([found[r] for r in middle]))), out


GAP_BITS = 12  # bins per octave 2**12: a bin's gaps differ by under 2**-12 of their value (0.025 %)
_GAP_OCTAVES = (-20, 20)  # binary exponents of gaps from 2**-21 s (~0.5 us) to 2**20 s (~12 days); others
# share the end bins
_GAP_BUFFER = 1 << 12


class GapHistogram:
    """Inter-token gaps (s) pooled over a run, as `vllm bench serve` pools every request's ITLs, in a
    fixed-size histogram: a run of any length keeps ~4 MB (pages touched only where gaps fall).

    A bin keeps the count, sum and sum of squares of its gaps: the mean and std are exact, a percentile
    is numpy's linear one over the bins' mean values, so within a bin's width of the exact one. Gaps are
    buffered and binned in the order added (np.add.at adds in order), so the same gaps added in the same
    order give the same bits however they were buffered.
    """

    def __init__(self) -> None:
        lo, hi = _GAP_OCTAVES
        size = ((hi - lo + 1) << GAP_BITS) + 1  # bin 0: gaps under 2**(lo - 1) s, zero included
        self.counts = np.zeros(size, np.int64)
        self.sums = np.zeros(size)
        self.squares = np.zeros(size)
        self.gaps: list[float] = []
        self.weights: list[int] = []

    def add(self, gap: float, weight: int = 1) -> None:
        """`weight` gaps of `gap` seconds."""
        self.gaps.append(gap)
        self.weights.append(weight)
        if len(self.gaps) >= _GAP_BUFFER:
            self.flush()

    def add_each(self, gaps: list[float], weight: int) -> None:
        """`weight` gaps of each of `gaps`, in order."""
        self.gaps.extend(gaps)
        self.weights.extend([weight] * len(gaps))
        if len(self.gaps) >= _GAP_BUFFER:
            self.flush()

    def flush(self) -> None:
        """Bin the buffered gaps."""
        if not self.gaps:
            return
        v = np.asarray(self.gaps, np.float64)
        w = np.asarray(self.weights, np.int64)
        self.gaps, self.weights = [], []
        mantissa, exponent = np.frexp(v)  # v = mantissa * 2**exponent, mantissa in [0.5, 1): exact
        lo, hi = _GAP_OCTAVES
        sub = ((mantissa - 0.5) * (2 << GAP_BITS)).astype(np.int64)  # exact: a power-of-two scaling
        idx = ((exponent.astype(np.int64) - lo) << GAP_BITS) + sub + 1
        idx = np.where(v > 0, np.clip(idx, 0, len(self.counts) - 1), 0)
        wv = w * v
        np.add.at(self.counts, idx, w)
        np.add.at(self.sums, idx, wv)
        np.add.at(self.squares, idx, wv * v)

    def moments(self) -> tuple[int, float, float]:
        """(number of gaps, mean, std) of every gap added (NaNs without gaps)."""
        self.flush()
        n = int(self.counts.sum())
        if not n:
            return 0, np.nan, np.nan
        mean = float(self.sums.sum()) / n
        at = np.flatnonzero(self.counts)
        counts, sums = self.counts[at], self.sums[at]
        # Within each bin about its own mean (its gaps differ by under a bin's width: little cancels),
        # then the bins' means about the mean.
        within = np.maximum(self.squares[at] - sums * sums / counts, 0.0)
        between = counts * (sums / counts - mean) ** 2
        return n, mean, float(np.sqrt((within.sum() + between.sum()) / n))

    def median_and_percentiles(self, qs: Iterable[float]) -> tuple[float, list[float]]:
        """np.median and np.percentile (linear) of the gaps, each gap taken as its bin's mean."""
        self.flush()
        at = np.flatnonzero(self.counts)
        cum = np.cumsum(self.counts[at])
        means = self.sums[at] / self.counts[at]
        count = int(cum[-1])

        def rank(r: int) -> float:  # the gap of 0-based rank r
            return float(means[np.searchsorted(cum, r, side="right")])

        out = []
        for q in qs:
            v = (count - 1) * (q / 100)
            lo = int(np.floor(v))
            a, b, t = rank(lo), rank(min(lo + 1, count - 1)), v - lo
            out.append(float(b - (b - a) * (1 - t)) if t >= 0.5 else float(a + (b - a) * t))  # numpy's _lerp
        mid = count // 2
        median = rank(mid) if count % 2 else float(np.mean([rank(mid - 1), rank(mid)]))
        return median, out

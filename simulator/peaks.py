"""`vllm bench serve`'s peak lines: output tokens, and requests between arrival and finish, in each whole
second counted from the first finished request's arrival (vLLM's `calculate_metrics`).

The request table holds a request's first and last token times: its tokens are spaced evenly between
them, n samples counting n times. The work and the memory follow the tokens, not the run's length: a
request's tokens are bucketed second by second or token by token, whichever are fewer, and the counts
live in chunks of seconds made when first touched, so a trace whose arrivals lie years apart costs what
its tokens do.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np

Columns = Callable[[tuple[str, ...]], Iterator[dict[str, np.ndarray]]]  # a request table's columns, batch
# by batch (simulator.metrics.request_batches)
_PAIRS = 1 << 12  # (request, second) or (request, token) pairs expanded at a time
_CHUNK_BITS = 16  # seconds per chunk of counts: 2**16


class Seconds:
    """Counts per whole second from 0 to `num_seconds` - 1, stored in chunks made when first touched."""

    def __init__(self, num_seconds: int, dtype) -> None:
        self.num_seconds = num_seconds
        self.dtype = dtype
        self.chunks: dict[int, np.ndarray] = {}

    def add_at(self, index: np.ndarray, weights) -> None:
        """`np.add.at(counts, index, weights)`; `weights` an array, or one number for every index."""
        chunk = index >> _CHUNK_BITS
        first, last = int(chunk.min()), int(chunk.max())
        for c in (first,) if first == last else np.unique(chunk).tolist():
            sel = None if first == last else chunk == c
            local = (index if sel is None else index[sel]) - (c << _CHUNK_BITS)
            w = weights if np.isscalar(weights) or sel is None else weights[sel]
            low = int(local.min())
            added = np.bincount(local - low, None if np.isscalar(w) else w)
            counts = self.chunks.get(c)
            if counts is None:
                counts = self.chunks[c] = np.zeros(1 << _CHUNK_BITS, self.dtype)
            counts[low:low + len(added)] += added * w if np.isscalar(w) else added

    def dense(self) -> np.ndarray:
        """Every second's count."""
        out = np.zeros(self.num_seconds, self.dtype)
        for c, counts in self.chunks.items():
            at = c << _CHUNK_BITS
            if at < self.num_seconds:
                out[at:at + len(counts)] = counts[:self.num_seconds - at]
        return out

    def max(self) -> float:
        """The largest count (0 without any)."""
        return max((float(self._valid(c).max()) for c in self.chunks), default=0.0)

    def cumulative_max(self) -> int:
        """The largest running sum over the seconds in order (0 without any)."""
        best = carry = 0
        for c in sorted(self.chunks):
            run = np.cumsum(self.chunks[c]) + carry
            valid = run[:max(self.num_seconds - (c << _CHUNK_BITS), 0)]
            if len(valid):
                best = max(best, int(valid.max()))
            carry = int(run[-1])
        return best

    def _valid(self, c: int) -> np.ndarray:
        return self.chunks[c][:max(self.num_seconds - (c << _CHUNK_BITS), 0)]


def _tokens_before(bound: np.ndarray, rel: np.ndarray, gap: np.ndarray, count: np.ndarray) -> np.ndarray:
    """How many of `count` tokens at `rel + k * gap` (k = 0, 1, ...) fall before `bound`, elementwise."""
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(gap > 0, np.ceil((bound - rel) / gap), np.where(rel < bound, count, 0))
    k = np.clip(np.nan_to_num(k), 0, count).astype(np.int64)
    # The division can round either way by one token; the token times as written decide.
    k -= (k > 0) & (rel + (k - 1) * gap >= bound)
    k += (k < count) & (rel + k * gap < bound)
    return k


def per_second(columns: Columns) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens, and finished requests between arrival and finish, in each whole second (see the
    module docstring), as arrays."""
    tokens, active = _counts(columns)
    return tokens.dense(), np.cumsum(active.dense())


def peak_metrics(columns: Columns) -> dict:
    """`vllm bench serve`'s peak output tokens per second and peak concurrent requests."""
    tokens, active = _counts(columns)
    return {"max_output_tokens_per_s": tokens.max(), "max_concurrent_requests": active.cumulative_max()}


def _counts(columns: Columns) -> tuple[Seconds, Seconds]:
    """Tokens per second, and +1 at each finished request's first second, -1 after its last."""
    start, end = math.inf, -math.inf
    for b in columns(("arrival_s", "finish_s")):
        done = ~np.isnan(b["finish_s"])
        if done.any():
            start = min(start, float(b["arrival_s"][done].min()))
            end = max(end, float(b["finish_s"][done].max()))
    num_seconds = math.ceil(end - start) + 1 if start < math.inf else 0
    tokens, active = Seconds(num_seconds, np.float64), Seconds(num_seconds, np.int64)
    names = ("arrival_s", "first_token_s", "finish_s", "output_len", "n", "beam_width")
    for b in columns(names):
        done = ~np.isnan(b["finish_s"])
        if not done.any():
            continue
        finish = b["finish_s"][done] - start
        active.add_at((b["arrival_s"][done] - start).astype(np.int64), 1)
        active.add_at(finish.astype(np.int64) + 1, -1)
        count = np.maximum(b["output_len"][done].astype(np.int64), 1)
        rel = b["first_token_s"][done] - start
        gap = np.where(count > 1, (finish - rel) / np.maximum(count - 1, 1), 0.0)
        weight = np.where(b["beam_width"][done] <= 1, b["n"][done], 1)
        first_s = rel.astype(np.int64)
        spans = (rel + (count - 1) * gap).astype(np.int64) - first_s + 1
        by_second = spans <= count
        for add, sel, sizes in ((_add_by_second, by_second, spans), (_add_by_token, ~by_second, count)):
            # Usually every request goes one way: slices then, not copies.
            rows = np.arange(len(sel)) if sel.all() else np.flatnonzero(sel)
            if not len(rows):
                continue
            whole = len(rows) == len(sel)
            # At most ~_PAIRS pairs at a time: a long run's requests decode for many seconds, and the
            # pairs would outgrow the run's own memory.
            ends = np.cumsum(sizes if whole else sizes[rows])
            cuts = [0, *np.searchsorted(ends, np.arange(_PAIRS, int(ends[-1]), _PAIRS)), len(rows)]
            for lo, hi in zip(cuts, cuts[1:], strict=False):
                if hi > lo:
                    r = slice(lo, hi) if whole else rows[lo:hi]
                    add(tokens, first_s[r], spans[r], rel[r], gap[r], count[r], weight[r])
    return tokens, active


def _add_by_second(tokens: Seconds, first_s, spans, rel, gap, count, weight) -> None:
    """Add each request's tokens (at `rel + k * gap`, `weight` each) to each second they span."""
    row = np.repeat(np.arange(len(rel)), spans)
    second = first_s[row] + np.arange(len(row)) - np.repeat(np.cumsum(spans) - spans, spans)
    r, g, c = rel[row], gap[row], count[row]
    per = _tokens_before(second + 1.0, r, g, c) - _tokens_before(second.astype(np.float64), r, g, c)
    tokens.add_at(second, per * weight[row])


def _add_by_token(tokens: Seconds, first_s, spans, rel, gap, count, weight) -> None:
    """Add each request's tokens to the seconds they fall in, token by token (tokens over a second apart)."""
    row = np.repeat(np.arange(len(rel)), count)
    k = np.arange(len(row)) - np.repeat(np.cumsum(count) - count, count)
    tokens.add_at((rel[row] + k * gap[row]).astype(np.int64), weight[row])

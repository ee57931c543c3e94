"""Prefix-block reuse of a trace: the hit ratio a prefix cache of a given capacity reaches on it.

A request's blocks are the full prompt blocks at the simulator's block size whose content the trace's keys
give (traces/prefix.py); two blocks are the same when their whole chain of keys is (the prefix cache's
chained hashes). As in the prefix cache, a request's hits are the leading run of its blocks found cached,
among the first (prompt_len - 1) // block_size (the last prompt token is always computed); then every
block of the request is cached, the first block most recently used (the order in which a finished
request's blocks are released).

For LRU one pass gives every capacity at once (Mattson's stack distances): a block is found in an LRU
cache of C blocks exactly when fewer than C distinct blocks were used since its last use. The distance
is counted per request rather than per block: a block last used by request r' is preceded in the stack by
the distinct blocks of the requests between r' and this one, plus the blocks of r' used after it and not
since (an offline dominance count, `_nested`, in numpy). The result equals an LRU prefix cache that holds
C blocks of cached content while requests are served one at a time (tests/test_reuse.py checks it against
the simulator's prefix cache). Other policies are simulated at each requested capacity (reuse_policies.py).

When the simulator's block size divides the recorded one, a recorded block stands for several blocks; a
recorded block used with different coverages (a partial last block) is counted with the coverage of its
last use.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from traces.errors import TraceError
from traces.prefix import _ratio

NO_KEYS = "{}: the trace records no prefix keys (prefix_blocks), so it shows no reuse"
BIG = 1 << 40  # larger than any distance in blocks


@dataclass(frozen=True)
class Refs:
    """Every request's cacheable blocks at one block size, one row per recorded unit, in request order."""

    block_size: int
    num_requests: int
    prompt_tokens: int  # prompt tokens of all requests (the prefix cache's queried tokens)
    request: np.ndarray  # request row of each unit
    unit: np.ndarray  # chain id: equal ids are the same content
    weight: np.ndarray  # blocks of the unit this request holds
    queried: np.ndarray  # of those, blocks the prefix cache looks up
    recorded_repeats: int  # recorded keys whose whole chain appeared before (any block size)
    recorded_refs: int


def _dense(values: np.ndarray, keep_compact: bool = True) -> tuple[np.ndarray, int]:
    """Values renumbered 0..k-1 (equal stay equal) and k; with `keep_compact`, small non-negative values
    are kept as they are and k is their maximum + 1."""
    if not len(values):
        return values.astype(np.int64), 0
    lo, hi = int(values.min()), int(values.max())
    if keep_compact and lo >= 0 and hi < 4 * len(values) + 1024:
        return values.astype(np.int64, copy=False), hi + 1
    order = np.argsort(values, kind="stable")
    step = np.empty(len(values), np.int64)
    step[0] = 0
    step[1:] = values[order[1:]] != values[order[:-1]]
    dense = np.empty(len(values), np.int64)
    dense[order] = np.cumsum(step)
    return dense, int(dense.max()) + 1


def distinct(values: np.ndarray) -> int:
    """How many distinct values there are."""
    dense, width = _dense(values)
    if not width:
        return 0
    marks = np.zeros(width, bool)
    marks[dense] = True
    return int(marks.sum())


def chain_ids(keys: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, int]:
    """One id per chain of keys up to each position (equal ids exactly where the chains are equal), and
    how many distinct chains there are."""
    dense, width = _dense(keys)
    # The parent is the key before, except at a request's first key (position 0, the first key too).
    parent = np.empty(len(dense), np.int64)
    if len(dense):
        parent[0] = -1
        parent[1:] = dense[:-1]
        parent[pos == 0] = -1
    # Where every key always follows the same parent key at the same position (the Mooncake semantics:
    # a key names the whole prefix), the key already is the chain's id.
    parent_of = np.full(width, -2, np.int64)
    parent_of[dense] = parent
    pos_of = np.zeros(width, np.int64)
    pos_of[dense] = pos
    if (parent_of[dense] == parent).all() and (pos_of[dense] == pos).all():
        return dense, int((parent_of > -2).sum())
    ids = np.empty(len(keys), np.int64)
    order = np.argsort(pos, kind="stable")
    start, next_id = 0, 0
    for count in np.bincount(pos).tolist():
        idx = order[start:start + count]
        first = start == 0
        start += count
        links = dense[idx] if first else (ids[idx - 1] + 1) * width + dense[idx]
        level, num = _dense(links, keep_compact=False)
        ids[idx] = next_id + level
        next_id += num
    return ids, next_id


def build_refs(prompt_len: np.ndarray, keys: np.ndarray, nkeys: np.ndarray, recorded: int,
               block_size: int) -> Refs:
    """The units of every request at `block_size` from its recorded keys (flat, `nkeys` per request)."""
    m, k = _ratio(recorded, block_size)
    prompt_len = prompt_len.astype(np.int64)
    nkeys = nkeys.astype(np.int64)
    num = len(prompt_len)
    owner = np.repeat(np.arange(num), nkeys)
    pos = np.arange(len(keys))
    pos -= np.repeat(np.cumsum(nkeys) - nkeys, nkeys)
    ids, distinct = chain_ids(keys, pos)
    # Blocks at block_size that lie in the prompt and are covered by keys; the last token never hits.
    full = prompt_len // block_size
    count = np.minimum(full, nkeys * m) if k == 1 else np.minimum(full, nkeys // k)
    query = np.minimum(count, (prompt_len - 1) // block_size)
    if k > 1:  # one unit per k recorded keys: the last of them names the whole block
        take = pos % k == k - 1
        take &= pos // k < count[owner]
        sel = np.flatnonzero(take)
        upos = pos[sel] // k
        weight = np.ones(len(sel), np.int64)
        queried = (upos < query[owner[sel]]).astype(np.int64)
    else:
        units = -(-count // m)
        sel = np.flatnonzero(pos < units[owner])
        if len(sel) == len(pos):  # every key makes a unit: the arrays as they are, no copies
            sel = slice(None)
        o = owner[sel]
        start = pos[sel] * m
        weight = count[o]
        weight -= start
        np.minimum(weight, m, out=weight)
        queried = query[o]
        queried -= start
        np.clip(queried, 0, weight, out=queried)
        del start
    return Refs(block_size, num, int(prompt_len.sum()), owner[sel], ids[sel], weight, queried,
                len(ids) - distinct, len(ids))


def _nested(pa: np.ndarray, pb: np.ndarray, pw: np.ndarray, qa: np.ndarray, qb: np.ndarray) -> np.ndarray:
    """For each query i, the sum of pw over points with pa > qa[i] and pb < qb[i] (one sort per bit of
    the a coordinate: a point is above a query at their highest differing bit)."""
    out = np.zeros(len(qa), np.int64)
    if not len(pa) or not len(qa):
        return out
    width = int(max(pb.max(), qb.max())) + 2
    for bit in range(int(max(pa.max(), qa.max())).bit_length()):
        p = np.flatnonzero((pa >> bit) & 1)
        q = np.flatnonzero(((qa >> bit) & 1) == 0)
        if not len(p) or not len(q):
            continue
        pkey = (pa[p] >> (bit + 1)) * width + pb[p]
        order = np.argsort(pkey, kind="stable")
        pkey = pkey[order]
        cum = np.concatenate(([0], np.cumsum(pw[p][order])))
        qbase = (qa[q] >> (bit + 1)) * width
        lo = np.searchsorted(pkey, qbase, "left")
        hi = np.searchsorted(pkey, qbase + qb[q], "left")
        out[q] += cum[hi] - cum[lo]
    return out


@dataclass(frozen=True)
class LRUCurve:
    """Hits of every capacity at once: a unit of `base`, `length` blocks hits min(C, base + length) - base
    blocks at capacity C >= `start` (C in blocks); grouped views make each capacity O(log n)."""

    block_size: int
    queried_blocks: int
    prompt_tokens: int
    infinite_hits: int
    distances: np.ndarray  # stack distance, in blocks, of each reused unit's first block

    start: np.ndarray
    length: np.ndarray
    end: np.ndarray

    @cached_property
    def _sorted(self) -> tuple[np.ndarray, ...]:
        """Grouped views `hits` searches, each as distinct values ascending with suffix sums: the starts
        with the lengths, and for the units that ramp (start <= end) their ends with counts and sums,
        their starts with counts and sums of their ends."""
        start, length, end = self.start, self.length, self.end
        starts, _, lengths = _grouped(start, length)
        ramp = start <= end
        r_start, r_end = start[ramp], end[ramp]
        ends, end_count, end_sum = _grouped(r_end, r_end)
        ramp_starts, ramp_count, ramp_sum = _grouped(r_start, r_end)
        return starts, lengths, ends, end_count, end_sum, ramp_starts, ramp_count, ramp_sum

    def hits(self, capacity_blocks) -> np.ndarray:
        """Blocks hit at each capacity (in blocks)."""
        c = np.asarray(capacity_blocks, np.int64)
        starts, lengths, ends, end_count, end_sum, ramp_starts, ramp_count, ramp_sum = self._sorted
        total = lengths[0] - lengths[np.searchsorted(starts, c, "right")]
        # Units that ramp (start <= end) lose end - C while start <= C < end; the others hit all at once.
        k = np.searchsorted(ends, c, "right")
        over_end = end_sum[k] - end_count[k] * c
        j = np.searchsorted(ramp_starts, c, "right")
        not_started = ramp_sum[j] - ramp_count[j] * c
        return total - (over_end - not_started)


def _grouped(values: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct values ascending, and from each of them on (one more entry, 0, at the end) how many
    values there are and the sum of their weights.

    Counting replaces sorting where the values are small (stack distances are at most the blocks
    used): it is one pass where a sort of tens of millions of values takes several."""
    lo, hi = (int(values.min()), int(values.max())) if len(values) else (0, -1)
    if lo >= 0 and hi < 4 * len(values) + 1024:
        dense, width = values, hi + 1
        ranked = np.arange(width, dtype=np.int64)
    else:
        dense, width = _dense(values, keep_compact=False)
        ranked = np.empty(width, np.int64)  # _dense numbers them in ascending order
        ranked[dense] = values
    count = np.bincount(dense, minlength=width)
    present = np.flatnonzero(count)
    if len(weights) and int(np.abs(weights).max()) * len(weights) < 1 << 53:  # float sums stay exact
        total = np.rint(np.bincount(dense, weights, minlength=width)).astype(np.int64)
    else:
        total = np.zeros(width, np.int64)
        np.add.at(total, dense, weights)

    def suffix(x: np.ndarray) -> np.ndarray:
        return np.concatenate((np.cumsum(x[::-1])[::-1], [0])).astype(np.int64)

    return ranked[present], suffix(count[present]), suffix(total[present])


def _pair_run_starts(a: np.ndarray, b: np.ndarray, also: np.ndarray | None = None) -> np.ndarray:
    """Indices where a run of equal consecutive (a, b) pairs starts, and every i where also[i] holds.

    Compared column by column rather than as one combined key, because each full-length temporary
    costs fresh pages here: allocation, not arithmetic, is most of the pass's time."""
    if not len(a):
        return np.zeros(0, np.int64)
    change = a[1:] != a[:-1]
    change |= b[1:] != b[:-1]
    if also is not None:
        change |= also[1:]
    return np.flatnonzero(np.concatenate(([True], change)))


def lru_curve(refs: Refs) -> LRUCurve:
    """Stack distances of every block: the LRU hit count at any capacity."""
    # Arrays here are as long as the trace's block references (tens of millions): operations work in
    # place where they can, since each fresh temporary of that size is paid for in page faults.
    req, unit, w, qw = refs.request, refs.unit, refs.weight, refs.queried
    n, span = len(req), refs.num_requests + 1
    order = np.argsort(unit, kind="stable")
    sorted_unit = unit[order]
    same = sorted_unit[1:] == sorted_unit[:-1]
    del sorted_unit
    later, earlier = order[1:][same], order[:-1][same]
    del order, same
    prev_req = np.full(n, -1, np.int64)
    prev_req[later] = req[earlier]
    prev_w = np.zeros(n, np.int64)
    prev_w[later] = w[earlier]
    next_req = np.full(n, span, np.int64)  # span: never used again
    next_req[earlier] = req[later]
    del later, earlier
    has = prev_req >= 0
    # A request's units are a chain: an earlier unit was used whenever a later one was, so along a
    # request the previous use never increases and the next use never decreases, and the units sharing
    # a (request, previous use) or (request, next use) pair are consecutive (chain_ids makes it so).
    same_req = req[1:] == req[:-1]
    bad = prev_req[1:] > prev_req[:-1]
    bad &= same_req
    if not bad.any():
        np.less(next_req[1:], next_req[:-1], out=bad)
        bad &= same_req
    if bad.any():
        raise RuntimeError("lru_curve needs each request's units to be one chain of prefix blocks")
    del bad
    # S(r', r): distinct blocks of the requests strictly between r' and r, at their last coverage, is
    # their blocks minus those used again before r (nested reuses: `_nested`).
    per_req = np.bincount(req, weights=w, minlength=refs.num_requests).astype(np.int64)
    cum = np.concatenate(([0], np.cumsum(per_req)))
    pstart = _pair_run_starts(req, next_req)
    pweight = np.add.reduceat(w, pstart) if n else np.zeros(0, np.int64)
    pa, pb = req[pstart], next_req[pstart]
    del next_req, pstart
    keep = pb < span
    pa, pb, pweight = pa[keep], pb[keep], pweight[keep]
    # A unit never used before is a run of its own; the others run by (request, previous use).
    gstart = _pair_run_starts(req, prev_req, ~has)
    qr, qrp = req[gstart], prev_req[gstart]
    del prev_req
    between = cum[qr] - cum[qrp + 1]
    q = qrp >= 0
    between[q] -= _nested(pa, pb, pweight, qrp[q], qr[q])
    run_len = np.diff(np.append(gstart, n))
    # Blocks of r' used after this one (its chain ancestors, released after it) and untouched since:
    # the earlier units of this request whose previous use is r' too.
    base = np.cumsum(prev_w)
    base -= prev_w
    between -= base[gstart]
    base += np.repeat(between, run_len)
    del between, run_len, gstart
    length = np.minimum(qw, prev_w)
    end = base + length
    broken = qw > prev_w  # a miss: every later block of the request misses too
    broken |= ~has & (qw > 0)
    del prev_w, has
    # The largest `mark` (end, or BIG - 1 past a miss) of the earlier units of the same request
    # (requests ascend in order).
    before = np.empty(n, np.int64)
    if n:
        before[0] = 0
        before[1:] = end[:-1]
        np.copyto(before[1:], BIG - 1, where=broken[:-1])
        before[1:][~same_req] = 0
    del broken, same_req
    offset = req * BIG
    before += offset
    np.maximum.accumulate(before, out=before)
    before -= offset
    del offset
    live = length > 0
    live &= before < BIG - 1
    distances = base[live]
    distances += 1
    start = np.maximum(before[live], distances)
    length = length[live]
    return LRUCurve(refs.block_size, int(qw.sum()), refs.prompt_tokens, int(length.sum()),
                    distances, start, length, end[live])


def load_refs(path: str, block_size: int, format: str = "auto",
              warnings: list[str] | None = None) -> tuple[Refs, dict | None]:
    """The units of a trace file or bundled name, and trace info's prefix statistics of it."""
    from traces.formats import parquet_prefix_columns
    from traces.loaders import detect_format, load_trace, resolve_trace

    try:
        file, _ = resolve_trace(path)
        fmt = detect_format(file) if format == "auto" else format
    except Exception:  # noqa: BLE001 - load_trace below reports the problem in its own words
        file, fmt = None, format
    columns = parquet_prefix_columns(file) if fmt == "parquet" and file is not None else None
    if columns is not None:
        keys, nkeys, prompt, sizes = columns
    else:
        from itertools import chain

        trace = load_trace(path, format, warnings=warnings)
        if "prefix_blocks" not in trace.columns:
            raise TraceError(NO_KEYS.format(path))
        cells = trace["prefix_blocks"]
        nkeys = np.fromiter(map(len, cells), np.int64, len(cells))
        keys = np.fromiter(chain.from_iterable(cells), np.int64, int(nkeys.sum()))
        prompt = trace["prompt_len"].to_numpy(np.int64)
        sizes = trace["prefix_block_size"].to_numpy()
    used = np.unique(sizes[nkeys > 0])
    if len(used) != 1:
        raise TraceError(f"{path}: prefix keys are recorded at {len(used)} block sizes "
                         f"({', '.join(map(str, used[:5]))}); reuse needs one")
    recorded = int(used[0])
    refs = build_refs(prompt, keys, nkeys, recorded, block_size)
    unique = distinct(keys)
    info = {"block_size": recorded, "requests_with_prefix": int((nkeys > 0).sum()),
            "references": int(len(keys)), "unique_blocks": unique,
            "repeat_fraction": (len(keys) - unique) / len(keys) if len(keys) else 0.0}
    return refs, info

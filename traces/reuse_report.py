"""`pagelab trace reuse`: the reuse analysis of a trace as one JSON-ready report.

LRU comes from the one-pass stack distances (traces/reuse.py); LFU and S3-FIFO (pagelab/eviction.py) are
not stack algorithms (a larger cache does not always hold what a smaller one holds), so they are simulated
at each requested capacity, request by request with the same leading-run rule.
"""
from __future__ import annotations

import numpy as np

from pagelab.eviction import POLICIES, make_policy
from traces.reuse import LRUCurve, Refs, lru_curve

CURVE_POINTS = 64
PERCENTILES = (50, 90, 99)


def simulate_policy(refs: Refs, policy: str, capacity_blocks: int) -> int:
    """Blocks hit by a prefix cache of `capacity_blocks` blocks under `policy`, requests one at a time."""
    cache = make_policy(policy, capacity_blocks)
    size = cache.size
    req = refs.request.tolist()
    unit = refs.unit.tolist()
    weight = refs.weight.tolist()
    queried = refs.queried.tolist()
    bounds = [0, *(np.flatnonzero(np.diff(refs.request)) + 1).tolist(), len(req)]
    hits = 0
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        for x in range(a, b):
            q = queried[x]
            if not q:
                break
            got = min(size.get(unit[x], 0), q)
            hits += got
            if got < q:
                break
        for x in range(b - 1, a - 1, -1):  # the first block ends up the most recently used
            cache.admit(unit[x], weight[x])
    return hits


def unique_blocks(refs: Refs) -> int:
    """Distinct blocks at the block size: each distinct unit at the largest coverage it was used with."""
    if not len(refs.unit):
        return 0
    unit, weight = refs.unit, refs.weight
    widest = np.zeros(int(unit.max()) + 1, np.int64)
    widest[unit] = weight  # one coverage per unit; then the few used wider elsewhere
    wider = weight > widest[unit]
    np.maximum.at(widest, unit[wider], weight[wider])
    return int(widest.sum())


def curve_capacities(curve: LRUCurve) -> np.ndarray:
    """Log-spaced capacities (blocks) from one block to past the largest reuse distance."""
    top = max(int(curve.distances.max()) if len(curve.distances) else 1, 2)
    return np.unique(np.geomspace(1, top * 1.05, CURVE_POINTS).astype(np.int64))


def reuse_report(refs: Refs, recorded: dict | None, capacities_tokens: list[int],
                 policies: list[str]) -> tuple[dict, LRUCurve]:
    """The report (JSON-ready) and the LRU curve it came from."""
    for name in policies:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    bs = refs.block_size
    curve = lru_curve(refs)
    queried = curve.queried_blocks
    ratio = (lambda blocks: blocks / queried if queried else 0.0)  # noqa: E731
    dist_tokens = curve.distances * bs
    pct = np.percentile(dist_tokens, PERCENTILES).tolist() if len(dist_tokens) else [None] * 3
    unique = unique_blocks(refs)
    report = {
        "block_size": bs,
        "num_requests": refs.num_requests,
        "prompt_tokens": refs.prompt_tokens,
        "recorded": None if recorded is None else {
            **recorded, "infinite_hit_ratio": refs.recorded_repeats / refs.recorded_refs
            if refs.recorded_refs else 0.0},
        "queried_blocks": queried,
        "unique_blocks": unique,
        "reuse_distance_tokens": dict(zip((f"p{p}" for p in PERCENTILES), pct, strict=True)),
        "infinite": {"hit_blocks": curve.infinite_hits, "hit_ratio": ratio(curve.infinite_hits),
                     "hit_tokens": curve.infinite_hits * bs,
                     "token_hit_ratio": curve.infinite_hits * bs / refs.prompt_tokens
                     if refs.prompt_tokens else 0.0},
        "capacities": [],
    }
    lru_hits = curve.hits(np.array([c // bs for c in capacities_tokens], np.int64)).tolist()
    for cap, lru in zip(capacities_tokens, lru_hits, strict=True):
        row = {"capacity_tokens": cap, "capacity_blocks": cap // bs}
        for name in policies:
            hits = lru if name == "lru" else simulate_policy(refs, name, cap // bs)
            row[name] = {"hit_blocks": hits, "hit_ratio": ratio(hits),
                         "token_hit_ratio": hits * bs / refs.prompt_tokens if refs.prompt_tokens else 0.0}
        report["capacities"].append(row)
    grid = curve_capacities(curve)
    report["lru_curve"] = {"capacity_tokens": (grid * bs).tolist(),
                           "hit_ratio": [ratio(h) for h in curve.hits(grid).tolist()]}
    return report, curve

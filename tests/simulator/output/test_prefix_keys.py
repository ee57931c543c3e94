"""The events table's prefix_key: the content key a block had in the prefix cache when it was released."""
from __future__ import annotations

from simulator.config import SimConfig
from simulator.loop import simulate
from traces import load_trace


def _run(prefix_caching: bool):
    trace = load_trace("mooncake-conv").iloc[:60].reset_index(drop=True)
    return simulate(trace, SimConfig(enable_prefix_caching=prefix_caching, capacity_tokens=40_000))


def test_blocks_shared_through_the_prefix_cache_carry_their_key():
    ev = _run(True).events
    shared = ev[ev["max_ref_count"] > 1]
    assert len(shared) > 0 and (shared["prefix_key"] != 0).all()
    keyed = ev[ev["prefix_key"] != 0]
    assert (keyed["filled"] == keyed["size"]).all()  # only full blocks are published


def test_without_the_prefix_cache_no_block_has_a_key():
    ev = _run(False).events
    assert len(ev) > 0 and (ev["prefix_key"] == 0).all()


def test_reference_count_changes_rebuild_each_tenures_peak():
    res = _run(True)
    ev, rc = res.events, res.refcounts
    assert len(rc) > 0 and rc["t_s"].is_monotonic_increasing and (rc["ref_count"] >= 1).all()
    peaks = {}
    for start, group in rc.groupby("start"):
        held = ev[ev["start"] == start]
        for row in group.itertuples():  # each change falls within a tenure of that block
            inside = held[(held["t_start_s"] <= row.t_s) & (held["t_end_s"] >= row.t_s)]
            assert len(inside) >= 1, (start, row.t_s)
            key = inside.index[-1]
            peaks[key] = max(peaks.get(key, 1), row.ref_count)
    shared = ev[ev["max_ref_count"] > 1]
    assert {k: v for k, v in peaks.items() if v > 1} == shared["max_ref_count"].to_dict()

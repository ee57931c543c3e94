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

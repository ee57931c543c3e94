"""The reuse analysis: LRU stack distances against the simulator's prefix cache and a direct LRU cache,
the recorded keys' repeat share against `trace info`, and the other policies' simulation."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from simulator.config import SimConfig
from simulator.loop.simulate import simulate
from traces import load_trace
from traces.multiturn import MultiTurnConfig, generate_multiturn
from traces.reuse import LRUCurve, build_refs, chain_ids, lru_curve
from traces.reuse_report import reuse_report, simulate_policy, unique_blocks
from traces.stats import prefix_reuse

BS = 16


def _chat_trace(seed: int, num: int = 120) -> pd.DataFrame:
    """Conversations whose turns extend their history; every prompt is whole keyed blocks plus one token and
    every answer fits in that last block, so a request holds exactly one block the cache never keeps."""
    rng = np.random.default_rng(seed)
    conversations: list[list[int]] = []
    next_key = 10
    rows = []
    for i in range(num):
        if not conversations or rng.random() < 0.35:
            system = [0, 1] if rng.random() < 0.5 else [2]
            conversations.append(system)
        s = int(rng.integers(len(conversations)))
        grow = int(rng.integers(1, 6))
        keys = conversations[s] + list(range(next_key, next_key + grow))
        next_key += grow
        conversations[s] = keys
        rows.append({"request_id": i, "arrival_s": float(i), "prompt_len": len(keys) * BS + 1,
                     "output_len": int(rng.integers(1, BS)), "prefix_blocks": list(keys),
                     "prefix_block_size": BS})
    return pd.DataFrame(rows)


def _refs(trace: pd.DataFrame, block_size: int = BS):
    cells = trace["prefix_blocks"]
    nkeys = np.array([len(c) for c in cells])
    keys = np.array([k for c in cells for k in c], np.int64)
    return build_refs(trace["prompt_len"].to_numpy(), keys, nkeys, int(trace["prefix_block_size"].iloc[0]),
                      block_size)


@pytest.mark.parametrize("seed", [0, 1])
def test_lru_hits_equal_the_simulators_prefix_cache_one_request_at_a_time(seed):
    trace = _chat_trace(seed)
    curve = lru_curve(_refs(trace))
    longest = int(trace["prefix_blocks"].map(len).max())
    capacities = sorted({longest, longest + 3, 2 * longest, 5 * longest, 40 * longest})
    expected = curve.hits(np.array(capacities))
    for cap, hits in zip(capacities, expected.tolist(), strict=True):
        # The pool holds `cap` cached blocks plus the one block each request keeps private.
        config = SimConfig(capacity_tokens=(cap + 1) * BS, block_size=BS, max_num_seqs=1, watermark=0.0,
                           record_events=False)
        stats = simulate(trace, config).summary["allocator_stats"]
        assert stats["prefix_hit_tokens"] == hits * BS, cap
    assert len(set(expected.tolist())) > 2  # the capacities do tell the cache sizes apart


def _one_block_units(refs):
    """The same references with every recorded block split into its blocks (a cache of single blocks)."""
    w = refs.weight
    j = np.arange(int(w.sum())) - np.repeat(np.cumsum(w) - w, w)
    return replace(refs, request=np.repeat(refs.request, w), unit=np.repeat(refs.unit, w) * 64 + j,
                   weight=np.ones(len(j), np.int64),
                   queried=(j < np.repeat(refs.queried, w)).astype(np.int64))


@pytest.mark.parametrize(("recorded", "block_size"), [(16, 16), (16, 32), (32, 16)])
def test_lru_curve_equals_a_direct_lru_cache(recorded, block_size):
    trace = generate_multiturn(MultiTurnConfig(num_requests=250, first_prompt_len=300, user_len=60,
                                               output_len=30, system_prompt_len=40, think_time_s=20,
                                               prefix_block_size=recorded, seed=3))
    refs = _refs(trace, block_size)
    curve = lru_curve(refs)
    caps = [4, 20, 60, 150, 400, 1000, 4000, 10**6]
    direct = [simulate_policy(_one_block_units(refs), "lru", c) for c in caps]
    assert curve.hits(np.array(caps)).tolist() == direct
    assert direct[0] < direct[-1] == curve.infinite_hits
    assert unique_blocks(refs) == len(set(_one_block_units(refs).unit.tolist()))


def test_chains_tell_equal_keys_after_different_prefixes_apart():
    # Key 7 follows key 1 in one request and key 2 in another: two different blocks to the prefix cache.
    trace = pd.DataFrame({"request_id": [0, 1, 2], "arrival_s": [0.0, 1.0, 2.0],
                          "prompt_len": [33, 33, 33], "output_len": [2, 2, 2],
                          "prefix_blocks": [[1, 7], [2, 7], [1, 7]], "prefix_block_size": [16, 16, 16]})
    refs = _refs(trace)
    assert refs.recorded_repeats == 2  # only the third request's two keys repeat a chain
    assert lru_curve(refs).infinite_hits == 2
    assert simulate_policy(refs, "lru", 100) == 2
    ids, distinct = chain_ids(np.array([5, 9, 5, 9]), np.array([0, 1, 1, 2]))
    assert distinct == 4 and len(set(ids.tolist())) == 4


@pytest.mark.parametrize("offset", [0, 10**12])
def test_curve_hits_equal_each_units_hits_summed_for_small_and_spread_distances(offset):
    # offset 10**12 makes the distances too spread out to be counted by value, so they are ranked first.
    rng = np.random.default_rng(3)
    start = rng.integers(1, 60, 400) + offset
    length = rng.integers(0, 9, 400)
    end = start + rng.integers(-20, 20, 400)
    curve = LRUCurve(BS, 0, 0, 0, start, start, length, end)
    caps = np.arange(-2, 90) + offset
    # A unit hits its length from its start on, less what lies past C while C is short of its end.
    short = np.where(start <= end, np.maximum(end[None, :] - caps[:, None], 0), 0)
    direct = ((start[None, :] <= caps[:, None]) * (length[None, :] - short)).sum(axis=1)
    assert curve.hits(caps).tolist() == direct.tolist()


def test_recorded_repeat_share_equals_trace_info_on_the_mooncake_conversation_trace():
    trace = load_trace("mooncake-conv")
    refs = _refs(trace)
    info = prefix_reuse(trace)
    assert refs.recorded_refs == info["references"]
    assert refs.recorded_repeats / refs.recorded_refs == pytest.approx(info["repeat_fraction"], abs=0)
    report, curve = reuse_report(refs, info, [10**6], ["lru"])
    assert report["recorded"]["infinite_hit_ratio"] == info["repeat_fraction"]
    assert 0 < report["capacities"][0]["lru"]["hit_ratio"] < report["infinite"]["hit_ratio"] <= 1


def test_other_policies_are_simulated_at_each_capacity():
    trace = _chat_trace(5, 200)
    refs = _refs(trace)
    report, _ = reuse_report(refs, None, [16 * 10, 16 * 60, 16 * 10**5], ["lru", "lfu", "s3fifo"])
    rows = report["capacities"]
    for name in ("lru", "lfu", "s3fifo"):
        assert rows[-1][name]["hit_blocks"] == report["infinite"]["hit_blocks"]
        assert rows[0][name]["hit_blocks"] <= rows[-1][name]["hit_blocks"]
    assert rows[0]["lfu"]["hit_blocks"] != rows[0]["lru"]["hit_blocks"] \
        or rows[1]["lfu"]["hit_blocks"] != rows[1]["lru"]["hit_blocks"]

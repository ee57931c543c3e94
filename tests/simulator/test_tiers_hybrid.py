"""Simulations of a model with several KV cache groups (sliding and full attention) with KV tiers under
each eviction policy."""
from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from pagelab.eviction import POLICIES
from simulator.config import SimConfig
from simulator.loop import simulate
from tests.simulator.test_simulate_fast import assert_identical
from traces.multiturn import MultiTurnConfig, generate_multiturn

BASE = SimConfig(model="gemma-3-27b", gpu="h100-80gb", max_model_len=32768, kv_memory_gb=1.2)


@pytest.fixture(scope="module")
def trace() -> pd.DataFrame:
    """Conversations whose turns reuse their prefixes, more than the small pool keeps."""
    return generate_multiturn(MultiTurnConfig(num_requests=40, rate=2.0, think_time_s=10.0))


def _comparable(result) -> dict:
    summary = {k: v for k, v in result.summary.items() if k not in ("wall_s", "kv_tiers")}
    return {"summary": summary, "requests": result.requests, "memory": result.memory, "events": result.events}


def test_a_zero_size_tier_changes_nothing(trace):
    gpu_only = simulate(trace, dataclasses.replace(BASE, swap_space_gb=0.0))  # the tier's CPU budget: 0
    tiered = simulate(trace, dataclasses.replace(BASE, kv_offloading_size=0.0))
    a, b = _comparable(gpu_only), _comparable(tiered)
    assert a["summary"] == b["summary"]
    for name in ("requests", "memory", "events"):
        pd.testing.assert_frame_equal(a[name], b[name])
    assert tiered.summary["kv_tiers"]["tokens_by_source"]["cpu_hit"] == 0


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("store", ["lazy", "eager"])
def test_prompt_tokens_by_source_add_up_and_tiers_serve_some(trace, store, policy):
    config = dataclasses.replace(BASE, kv_offloading_size=0.5, kv_offloading_disk_size=2.0,
                                 kv_offloading_store=store, kv_offloading_policy=policy,
                                 debug=True)  # debug: invariants every step
    s = simulate(trace, config).summary
    assert s["kv_tiers"]["cpu"]["policy"] == s["kv_tiers"]["disk"]["policy"] == policy
    by = s["kv_tiers"]["tokens_by_source"]
    assert sum(by.values()) == s["allocator_stats"]["prefix_query_tokens"]
    assert by["gpu_hit"] == s["allocator_stats"]["prefix_hit_tokens"]
    assert min(by.values()) >= 0 and by["cpu_hit"] + by["disk_hit"] > 0
    for name in ("cpu", "disk"):
        tier = s["kv_tiers"][name]
        assert tier["blocks"] <= tier["capacity_blocks"]
        assert (tier["load_seconds"] > 0) == (tier["hit_blocks"] > 0)


def test_the_policies_evict_differently(trace):
    evicted = {policy: simulate(trace, dataclasses.replace(BASE, kv_offloading_size=0.5,
                                                            kv_offloading_disk_size=2.0,
                                                            kv_offloading_policy=policy)).summary["kv_tiers"]
               for policy in POLICIES}
    assert len({tiers["cpu"]["evicted_blocks"] for tiers in evicted.values()}) == len(POLICIES), evicted


@pytest.mark.parametrize("store", ["lazy", "eager"])
def test_tiers_extend_hits_of_prompts_allocated_chunk_by_chunk_fast_as_step(trace, store):
    """Chunked prefill over a grouped pool with tiers: each prompt takes its first chunk past the hit the
    tiers extend, then a chunk at a time, so the small pool serves prompts it refuses whole; the
    invariants hold every step and fast mode is step mode."""
    tiered = dataclasses.replace(BASE, kv_offloading_size=0.5, kv_offloading_disk_size=2.0,
                                 kv_offloading_store=store)
    config = dataclasses.replace(tiered, enable_chunked_prefill=True, max_num_batched_tokens=1024, debug=True)
    fast = simulate(trace, config)
    step = simulate(trace, dataclasses.replace(config, mode="step"))
    assert_identical(fast, step)
    assert fast.summary["kv_tiers"] == step.summary["kv_tiers"]
    by = fast.summary["kv_tiers"]["tokens_by_source"]
    assert by["cpu_hit"] + by["disk_hit"] > 0
    assert fast.summary["num_finished"] > simulate(trace, tiered).summary["num_finished"]


def test_a_turn_sharing_a_thousand_blocks_with_the_last_one_hits_the_tiers():
    # Each turn's chain of content keys is built apart from the one published before it, a thousand
    # parents deep: comparing the two must not recurse once per parent.
    n = 16000
    trace = pd.DataFrame({"request_id": [0, 1], "arrival_s": [0.0, 100.0], "prompt_len": [n, n + 1600],
                          "output_len": [4, 4], "prefix_block_size": [16, 16],
                          "prefix_blocks": [list(range(n // 16)), list(range(n // 16 + 100))]})
    config = SimConfig(model="gemma-3-27b", capacity_tokens=100_000, max_model_len=32768,
                       enable_chunked_prefill=True, max_num_batched_tokens=2048, kv_offloading_size=1.0)
    result = simulate(trace, config)
    assert result.summary["num_finished"] == 2
    sources = result.summary["kv_tiers"]["tokens_by_source"]
    assert sources["gpu_hit"] + sources["cpu_hit"] >= n - 16

"""A tiered run's numbers do not depend on the path its bookkeeping takes: fast mode with events off (the
pool evicts in bulk, the tiers settle queued stores a batch at a time) equals step mode with events on
(the pool evicts one logged block at a time)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from simulator.config import SimConfig
from simulator.loop.simulate import simulate
from traces.multiturn import MultiTurnConfig, generate_multiturn

COLUMNS = ["admitted_s", "first_token_s", "finish_s", "num_preemptions", "prefix_hit_tokens"]


def _chat(num: int, seed: int):
    return generate_multiturn(MultiTurnConfig(num_requests=num, first_prompt_len=400, user_len=80,
                                              output_len=60, mean_turns=4, think_time_s=2, rate=4,
                                              system_prompt_len=64, prefix_block_size=16, seed=seed))


def _assert_same_run(trace, config: SimConfig) -> dict:
    """Fast mode without events and step mode with events agree on every simulated number."""
    fast = simulate(trace, dataclasses.replace(config, record_events=False))
    step = simulate(trace, dataclasses.replace(config, record_events=True, mode="step"))
    for col in COLUMNS:
        np.testing.assert_array_equal(fast.requests[col].to_numpy(), step.requests[col].to_numpy(),
                                      err_msg=col)
    for key in ("kv_tiers", "allocator_stats", "num_steps", "sim_duration_s", "ttft_s"):
        assert fast.summary[key] == step.summary[key], key
    return fast.summary["kv_tiers"]


def test_a_cpu_and_disk_tiered_run_is_the_same_batched_or_block_by_block():
    config = SimConfig(capacity_tokens=16 * 160, block_size=16, kv_offloading_size=0.05,
                       kv_offloading_disk_size=0.2)
    tiers = _assert_same_run(_chat(120, seed=2), config)
    # The run exercises what batching changes: both tiers store, hit and evict.
    for name in ("cpu", "disk"):
        assert tiers[name]["stored_blocks"] > 0 and tiers[name]["hit_blocks"] > 0
        assert tiers[name]["evicted_blocks"] > 0


@pytest.mark.parametrize("seed,store", [(256, "lazy"), (251, "eager"), (257, "eager")])
def test_tiny_tiers_that_evict_within_a_batch_are_the_same_batched_or_block_by_block(seed, store):
    """A CPU tier of 5 blocks under batches of up to 24: blocks it holds are among those that make room,
    blocks the disk holds may leave it before their turn, eager stores repeat hashes."""
    config = SimConfig(capacity_tokens=16 * 120, block_size=16, kv_offloading_size=0.01,
                       kv_offloading_disk_size=0.1, kv_offloading_store=store)
    tiers = _assert_same_run(_chat(40, seed), config)
    assert tiers["cpu"]["capacity_blocks"] == 5 and tiers["disk"]["evicted_blocks"] > 0

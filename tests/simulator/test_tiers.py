"""KV tiers below the GPU: invariants under random use, hits extend the GPU's, loads cost step time."""
from __future__ import annotations

import gc
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.config import SimConfig
from simulator.core.errors import ConfigError
from simulator.core.paged.block_manager import BlockManager
from simulator.core.paged.tier import TierSpec
from simulator.core.paged.tiers import Tiers, attach
from simulator.core.sequence import Sequence, SequenceGroup
from simulator.loop.simulate import simulate
from traces.multiturn import MultiTurnConfig, generate_multiturn

BS = 4


def _manager(gpu_blocks: int, cpu: int, disk: int = 0, store: str = "lazy", per_tier: int = 1,
             policy: str = "lru"):
    """A BlockManager with tiers, and the set of block hashes its pool hands them (recorded)."""
    bm = BlockManager(gpu_blocks, BS, num_cpu_blocks=cpu, watermark=0.0)
    specs = [TierSpec("cpu", cpu, per_tier, policy)]
    if disk:
        specs.append(TierSpec("disk", disk, per_tier, policy, bandwidth=5e9, latency_s=1e-4))
    tiers = Tiers(specs, store, BS, bytes_per_token=1024)
    attach(bm, tiers)
    handed: set[int] = set()
    hook = "on_release" if store == "eager" else "on_evict"
    inner = getattr(bm.pool, hook)

    def recording(hashes, keys):
        handed.update(hashes)
        inner(hashes, keys)

    setattr(bm.pool, hook, recording)
    return bm, tiers, handed


def _check(tiers: Tiers, handed: set[int], swap_used: int = 0) -> None:
    """Capacities hold, a block is in one tier at most, tiers hold only blocks the GPU let go."""
    tiers.flush()
    assert tiers.cpu.used + swap_used <= tiers.cpu.spec.num_blocks
    seen: set[int] = set()
    for tier in tiers.tiers:
        held = list(tier.keys)
        assert len(held) == len(set(held)) == tier.used <= tier.capacity <= tier.spec.num_blocks
        if tier.lru:  # the numbered stack finds each held block by its hash
            assert all(h in tier.keys for h in held)
        else:
            assert set(held) == set(tier.cache.size)
        assert not (seen & set(held))
        seen |= set(held)
        assert set(held) <= handed
    if tiers.tiers and tiers.tiers[0].lru:  # one index entry per held block, and no other
        s = tiers.stack
        assert len(s.loc) + len(s.clash) == len(seen)
        assert {s.hashes[g - s.base] for g in [*s.loc.values(), *s.clash.values()]} == seen


def _group(i: int, conv: int, nblocks: int, extra: int = 1) -> SequenceGroup:
    keys = [conv * 100 + j for j in range(nblocks)]
    n = nblocks * BS + extra
    return SequenceGroup(i, [Sequence(i, n, n, request_id=i, prefix_keys=keys)], 0.0)


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 8)), min_size=1, max_size=40),
       store=st.sampled_from(["lazy", "eager"]), disk=st.sampled_from([0, 6]),
       policy=st.sampled_from(["lru", "lfu", "s3fifo"]), per_tier=st.sampled_from([1, 2]))
def test_tier_invariants_hold_under_random_requests(requests, store, disk, policy, per_tier):
    bm, tiers, handed = _manager(12, 5, disk, store, per_tier, policy)
    live = []
    for i, (conv, nblocks) in enumerate(requests):
        group = _group(i, conv, nblocks)
        while live and bm.num_free_blocks < nblocks + 1:
            bm.free(live.pop(0))
        before = sum(t.stats.hit_blocks for t in tiers.tiers)
        gpu_before = bm.stats.prefix_hits
        cached = bm.allocate(group)
        loaded = sum(t.stats.hit_blocks for t in tiers.tiers) - before
        if loaded:  # a tier run ends on a whole tier block
            assert (bm.stats.prefix_hits - gpu_before + loaded) % per_tier == 0
        assert cached == (bm.stats.prefix_hits - gpu_before + loaded) * BS
        live.append(group.seqs[0])
        _check(tiers, handed)
    for seq in live:
        bm.free(seq)
    _check(tiers, handed)


def test_blocks_the_gpu_evicts_come_back_from_the_cpu_tier_and_cost_a_load():
    bm, tiers, _ = _manager(5, 10)
    a = _group(0, conv=1, nblocks=4)
    bm.allocate(a)
    bm.free(a.seqs[0])
    b = _group(1, conv=2, nblocks=4)  # evicts a's four cached blocks into the CPU tier
    bm.allocate(b)
    bm.free(b.seqs[0])
    tiers.flush()
    assert len(tiers.cpu.keys) == 4
    again = _group(2, conv=1, nblocks=4)
    assert bm.allocate(again) == 4 * BS
    assert bm.stats.prefix_hits == 0 and tiers.cpu.stats.hit_tokens == 4 * BS
    seconds = tiers.take_load_seconds(lambda tokens, bw, lat: lat + tokens * 1024 / bw)
    assert seconds == pytest.approx(1e-5 + 16 * 1024 / 25e9)
    assert tiers.take_load_seconds(lambda *a: 1.0) == 0.0  # taken once
    # The loaded blocks are published on the GPU again: a fourth request hits them there.
    bm.free(again.seqs[0])
    assert bm.allocate(_group(3, conv=1, nblocks=4)) == 4 * BS and bm.stats.prefix_hits == 4


def test_a_tier_block_of_two_gpu_blocks_is_hit_only_whole():
    bm, tiers, _ = _manager(5, 10, per_tier=2)
    a = _group(0, conv=1, nblocks=3)
    bm.allocate(a)
    bm.free(a.seqs[0])
    bm.allocate(b := _group(1, conv=2, nblocks=4))
    bm.free(b.seqs[0])
    assert bm.allocate(_group(2, conv=1, nblocks=3)) == 2 * BS  # blocks 0-1 whole, block 2 alone is not


def _chat(num: int = 120):
    return generate_multiturn(MultiTurnConfig(num_requests=num, first_prompt_len=400, user_len=80,
                                              output_len=60, mean_turns=4, think_time_s=2, rate=4,
                                              system_prompt_len=64, prefix_block_size=16, seed=2))


def _config(**kw) -> SimConfig:
    return SimConfig(capacity_tokens=16 * 160, block_size=16, record_events=False, **kw)


def test_a_cpu_tier_turns_recomputed_history_into_loads():
    trace = _chat()
    plain = simulate(trace, _config()).summary
    tiered = simulate(trace, _config(kv_offloading_size=1.0)).summary
    assert "kv_tiers" not in plain and "kv_offloading_size" not in _config().to_dict()
    source = tiered["kv_tiers"]["tokens_by_source"]
    stats = tiered["allocator_stats"]
    assert source["cpu_hit"] > 0
    assert sum(source.values()) == stats["prefix_query_tokens"]
    assert source["gpu_hit"] == stats["prefix_hit_tokens"]
    assert source["computed"] < stats["prefix_query_tokens"] - plain["allocator_stats"]["prefix_hit_tokens"]
    assert tiered["kv_tiers"]["cpu"]["load_seconds"] > 0
    slow = simulate(trace, _config(kv_offloading_size=1.0, cpu_offload_bandwidth_gbps=0.01)).summary
    assert slow["sim_duration_s"] > tiered["sim_duration_s"]  # the loads are charged to the steps


def test_swapped_blocks_take_their_room_from_the_cpu_tier():
    trace = generate_multiturn(MultiTurnConfig(num_requests=80, first_prompt_len=200, user_len=40,
                                               output_len=400, sigma=0.5, mean_turns=2, think_time_s=1,
                                               rate=50, system_prompt_len=64, prefix_block_size=16))
    cpu_blocks = int(0.05 * 2**30) // (16 * SimConfig().bytes_per_token)

    def observe(run):
        tiers = run.alloc.tiers
        swap = run.alloc.swap
        used = swap.num_blocks - len(swap.free)
        assert swap.num_blocks == cpu_blocks
        assert tiers.cpu.used + used <= cpu_blocks
        observe.swapped = max(observe.swapped, used)

    observe.swapped = 0
    config = _config(kv_offloading_size=0.05, preemption_mode="swap", mode="step")
    simulate(trace, config, observer=observe)
    assert observe.swapped > 0


@pytest.mark.parametrize("store", ["lazy", "eager"])
@pytest.mark.parametrize("grouped", [False, True])
def test_a_tiered_run_frees_its_pool_and_tiers_when_it_ends(grouped, store):
    """No reference cycle holds the manager or its tiers: they go with the run, not at a later collection
    (which a following run in the same process would pay for)."""
    tiers = dict(kv_offloading_size=0.05, kv_offloading_disk_size=0.1, kv_offloading_store=store,
                 preemption_mode="swap", record_events=False)
    config = SimConfig(model="gemma-3-27b", gpu="h100-80gb", max_model_len=8192, kv_memory_gb=0.3, **tiers) \
        if grouped else _config(**{k: v for k, v in tiers.items() if k != "record_events"})
    refs: list[weakref.ref] = []

    def observe(run):
        if not refs:  # the manager, its tiers, and their own state where they keep it apart
            held = run.alloc.tiers
            refs.extend(weakref.ref(o) for o in (run.alloc, held, getattr(held, "stack", held)))

    gc.disable()  # only reference counts may free them
    try:
        summary = simulate(_chat(40), config, observer=observe).summary
        assert summary["kv_tiers"]["cpu"]["stored_blocks"] > 0
        assert len(refs) == 3 and all(r() is None for r in refs)
    finally:
        gc.enable()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("kv_offloading_block_size", 24, "multiple of block_size"),
    ("kv_offloading_policy", "arc", "kv_offloading_policy must be one of"),
    ("kv_offloading_store", "never", "kv_offloading_store must be one of"),
    ("allocator", "contiguous-max", "need the paged allocator"),
])
def test_bad_tier_settings_are_named(field, value, message):
    with pytest.raises(ConfigError, match=message):
        _config(kv_offloading_size=1.0, **{field: value})

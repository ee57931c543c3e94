"""The engine's tier data follows the core's tiers: each block a tier holds or loads carries the content
it was stored with, and the slots in use are exactly the tiers' keys.

Here a device pool of int64 holds, in each GPU block, the content hash of the block the allocator
published there (K) and its negation (V), so a copy to the wrong place, or from a slot reused too early,
shows up as a wrong hash.
"""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_backend.kv_cache import KVCache
from gpu_backend.kv_tiers import TierData
from simulator.core.allocator import AllocStatus
from simulator.core.paged.block_manager import BlockManager
from simulator.core.paged.tier import TierSpec
from simulator.core.paged.tier_log import TierLog, attach_log
from simulator.core.paged.tiers import Tiers, attach
from simulator.core.sequence import Sequence, SequenceGroup

BS = 4


def _setup(tmp_path, gpu_blocks: int, cpu: int, disk: int, store: str, per_tier: int, policy: str):
    bm = BlockManager(gpu_blocks, BS, num_cpu_blocks=8, watermark=0.0)
    specs = [TierSpec("cpu", cpu, per_tier, policy)] if cpu else []
    if disk:
        specs.append(TierSpec("disk", disk, per_tier, policy, bandwidth=5e9, latency_s=1e-4))
    tiers = Tiers(specs, store, BS, bytes_per_token=16)
    attach(bm, tiers)
    log = TierLog()
    attach_log(bm, log)
    pool = KVCache(2, gpu_blocks, 1, 1, 1, dtype=torch.int64)
    return bm, tiers, TierData(pool, tiers, log, str(tmp_path)), pool


def _check_held(bm, pool: KVCache, seq: Sequence, upto: int) -> None:
    """The first `upto` blocks of `seq` hold their published content."""
    for bid in seq.block_table[:upto]:
        if bm.pool.hash[bid] is not None:
            assert _content(pool, bid) == _label(bm.pool.hash[bid])


def _group(i: int, conv: int, nblocks: int) -> SequenceGroup:
    keys = [conv * 100 + j for j in range(nblocks)]
    n = nblocks * BS + 1
    return SequenceGroup(i, [Sequence(i, n, n, request_id=i, prefix_keys=keys)], 0.0)


def _content(pool: KVCache, bid: int) -> tuple[int, ...]:
    return tuple(int(t[bid].item()) for t in (*pool.k, *pool.v))


def _label(h: int) -> tuple[int, ...]:
    return (h, h, -h, -h)


def _compute(pool: KVCache, bid: int, h: int | None) -> None:
    """The forward writes block `bid`: its published content, or a marker for an unpublished block."""
    for t in pool.k:
        t[bid] = 0 if h is None else h
    for t in pool.v:
        t[bid] = 0 if h is None else -h


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 7), st.sampled_from("aaaaoi")),
                         min_size=1, max_size=30),
       store=st.sampled_from(["lazy", "eager"]), tiers_=st.sampled_from([(5, 0), (3, 6), (0, 5), (1, 3)]),
       policy=st.sampled_from(["lru", "lfu", "s3fifo"]), per_tier=st.sampled_from([1, 2]))
def test_loaded_blocks_carry_the_content_they_were_stored_with(tmp_path_factory, requests, store, tiers_,
                                                               policy, per_tier):
    cpu, disk = tiers_
    bm, tiers, data, pool = _setup(tmp_path_factory.mktemp("disk"), 10, cpu, disk, store, per_tier, policy)
    live, swapped, loads = [], [], 0
    swap = KVCache(2, 8, 1, 1, 1, dtype=torch.int64)
    for i, (conv, nblocks, action) in enumerate(requests):
        if action == "o" and live and bm.can_swap_out(live[0]):  # swap out the oldest sequence
            group = live.pop(0)
            copies = bm.swap_out(group)
            data.run()  # as CacheEngine.swap_out: the tiers' moves first
            pool.swap_out(swap, copies)
            swapped.append(group)
            continue
        if action == "i" and swapped and bm.can_swap_in(swapped[0]) is AllocStatus.OK:
            group = swapped.pop(0)
            copies = bm.swap_in(group)
            data.run()  # stores from blocks the swap-in takes read them before it writes them
            pool.swap_in(swap, copies)
            _check_held(bm, pool, group.seqs[0], len(group.seqs[0].block_table))
            live.append(group)
            continue
        group = _group(i, conv, nblocks)
        while live and bm.num_free_blocks < nblocks + 1:
            bm.free(live.pop(0).seqs[0])
        if bm.num_free_blocks < nblocks + 1:
            continue
        gpu_before = bm.stats.prefix_hits
        hit_before = sum(t.stats.hit_blocks for t in tiers.tiers)
        bm.allocate(group)
        hits = bm.stats.prefix_hits - gpu_before
        loaded = sum(t.stats.hit_blocks for t in tiers.tiers) - hit_before
        loads += loaded
        data.run()  # what the engine does before the forward
        assert data.problems() == []
        seq = group.seqs[0]
        for i_block, bid in enumerate(seq.block_table):
            h = bm.pool.hash[bid]
            if i_block < hits + loaded:  # a GPU hit or a tier load: the block already holds its content
                assert _content(pool, bid) == _label(h)
            else:
                _compute(pool, bid, h)
        live.append(group)
    for group in live + swapped:
        bm.free(group.seqs[0])
    data.run()
    assert data.problems() == []
    assert not (data.log.source or data.log.frames or data.log.unplaced)  # nothing left half-moved
    assert sum(data.copied_in.values()) == loads
    for tier in tiers.tiers:  # every block a tier holds carries its own content
        for h in tier.keys:
            block = data.block(tier.spec.name, h)
            assert block[:, 0].flatten().tolist() == [h, h] and block[:, 1].flatten().tolist() == [-h, -h]
    data.close()


def test_a_block_pushed_out_of_its_tier_by_the_stores_of_its_own_allocation_still_loads(tmp_path):
    # A one-block CPU tier and no disk: loading A's first block takes GPU blocks that evict B's cached
    # blocks into the CPU tier, which drops A's block from the tier before its load is written.
    bm, tiers, data, pool = _setup(tmp_path, 6, 1, 0, "lazy", 1, "lru")
    a = _group(0, conv=1, nblocks=1)
    bm.allocate(a)
    data.run()
    _compute(pool, a.seqs[0].block_table[0], bm.pool.hash[a.seqs[0].block_table[0]])
    h = bm.pool.hash[a.seqs[0].block_table[0]]
    bm.free(a.seqs[0])
    b = _group(1, conv=2, nblocks=5)  # takes every GPU block: A's is evicted into the CPU tier
    bm.allocate(b)
    data.run()
    for bid in b.seqs[0].block_table:
        _compute(pool, bid, bm.pool.hash[bid])
    assert list(tiers.cpu.keys) == [h]
    bm.free(b.seqs[0])
    again = _group(2, conv=1, nblocks=1)
    bm.allocate(again)
    assert h not in tiers.cpu.keys  # B's evicted blocks pushed it out during this allocation
    data.run()
    assert tiers.cpu.stats.hit_blocks == 1
    assert _content(pool, again.seqs[0].block_table[0]) == _label(h)
    assert data.problems() == []

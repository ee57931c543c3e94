"""The grouped paged pool, step by step against hand-worked states, and simulations that run on it."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from simulator import AllocStatus, Sequence, SequenceGroup
from simulator.config import SimConfig
from simulator.core.kv_layout import LayerKV, kv_cache_groups, model_kv_layout
from simulator.core.models import get_model
from simulator.core.paged.kv_groups import GroupedBlockManager
from simulator.loop import simulate
from traces import SyntheticConfig, generate_trace

# One sliding-window layer (window 4) and one full layer, blocks of 2 tokens.
LAYOUT = kv_cache_groups([LayerKV("sliding_window", 2, 8, 4), LayerKV("full", 2, 8)])


def _request(rid: int, prompt: list[int], final: int = 20) -> tuple[Sequence, SequenceGroup]:
    seq = Sequence(rid, len(prompt), final, token_ids=list(prompt))
    return seq, SequenceGroup(rid, [seq])


def test_a_window_hands_back_blocks_it_has_passed():
    bm = GroupedBlockManager(20, LAYOUT, debug=True)
    seq, group = _request(1, list(range(9)))
    assert bm.allocate(group) == 0
    # 9 tokens: 5 blocks in each group, 10 of 20 taken.
    assert [len(t) for t in bm.tables.tables[1]] == [5, 5] and bm.num_free_blocks == 10
    seq.token_ids.append(9)
    bm.append_slot(seq)
    # 9 tokens computed, window 4: tokens 0..5 are skipped, so blocks 0-2 of the sliding group go back;
    # the 10th token fits the last blocks.
    assert bm.tables.tables[1][0][:3] == [None] * 3 and None not in bm.tables.tables[1][1]
    assert bm.num_free_blocks == 13
    for t in range(10, 14):
        seq.token_ids.append(t)
        bm.append_slot(seq)
    # 13 computed -> tokens 0..9 skipped: 5 sliding blocks handed back; 14 tokens need 7 blocks each.
    assert bm.tables.tables[1][0].count(None) == 5 and len(bm.tables.tables[1][1]) == 7
    assert bm.num_used_blocks == 2 + 7
    b = bm.breakdown()
    # Layer slots: 14 tokens in the full layer + tokens 10..13 in the sliding one.
    assert b.token_states == 14 + 4 and b.capacity == 20 * 2
    # The five handed-back blocks were full and published: the prefix cache keeps them.
    assert bm.window_cached_blocks() == 5 == bm.num_cached_free_blocks


def test_padding_layers_are_counted_in_every_held_block():
    layout = model_kv_layout(get_model("gemma-3-27b"), 16, 2)
    bm = GroupedBlockManager(100, layout, debug=True)
    seq, group = _request(1, list(range(20)))
    bm.allocate(group)
    # 2 blocks in each of 7 groups; the sliding groups pad 1, 1, 1, 1, 2, 2 layers of 10.
    assert bm.num_used_blocks == 14 and bm.padding_slots() == 2 * 16 * 8
    assert bm.breakdown().internal_fragmentation >= bm.padding_slots()


def test_a_prefix_hit_holds_only_where_every_group_hits():
    bm = GroupedBlockManager(40, LAYOUT, debug=False)
    a, ga = _request(1, list(range(9)))
    bm.allocate(ga)
    for t in range(9, 14):
        a.token_ids.append(t)
        bm.append_slot(a)
    bm.free(a)
    b, gb = _request(2, list(range(9)))
    # At most (9 - 1) // 2 = 4 blocks; the full group has all four, the sliding group needs the last
    # ceil((4 - 1) / 2) = 2 before the end: blocks 2 and 3, both still cached.
    hit, blocks = bm.tables.longest_hit(b)
    assert hit == 4 and len(blocks[0]) == 2 and len(blocks[1]) == 4
    # Evict the sliding group's block 3: its longest hit ends at 3 (blocks 1, 2), and the full group
    # follows it down to 3.
    pool = bm.pool
    gone = blocks[0][1]
    del pool.cached[pool.hash[gone]]
    pool.key[gone] = pool.hash[gone] = None
    hit, blocks = bm.tables.longest_hit(b)
    assert hit == 3 and len(blocks[1]) == 3 and len(blocks[0]) == 2
    assert bm.allocate(gb) == 6


def test_no_group_evicts_a_block_another_group_is_about_to_reuse():
    bm = GroupedBlockManager(12, LAYOUT, debug=True)  # debug: the invariants are checked after each call
    a, ga = _request(1, list(range(6)), final=10)  # 3 full blocks per group, all published
    bm.allocate(ga)
    bm.free(a)
    c, gc = _request(2, [9, 9, 8, 8, 7, 7], final=10)  # 6 newer cached blocks
    bm.allocate(gc)
    bm.free(c)
    # All 12 blocks are free and cached, oldest first: a's sliding blocks, then a's full ones.
    assert [bm.tables.group_of[b] for b in bm.pool.free_cached][:6] == [0, 0, 0, 1, 1, 1]
    b, gb = _request(3, [0, 1, 2, 3, 4, 5, 6, 6, 6, 6], final=14)
    hit, blocks = bm.tables.longest_hit(b)
    assert hit == 3 and len(blocks[1]) == 3
    full_hits = list(blocks[1])
    # The sliding group takes 2 fresh blocks; evicting the oldest would take a's full blocks that the full
    # group reuses: every hit is held first, so the fresh blocks come from c's.
    assert bm.allocate(gb) == 6
    table = bm.tables.tables[3]
    assert table[1][:3] == full_hits and not set(table[0][3:]) & set(full_hits)
    assert all(bm.tables.group_of[bid] == g for g, t in enumerate(table) for bid in t if bid is not None)


def test_swap_keeps_the_window_holes():
    bm = GroupedBlockManager(20, LAYOUT, num_cpu_blocks=20, debug=True)
    seq, group = _request(1, list(range(9)))
    bm.allocate(group)
    seq.token_ids.append(9)
    bm.append_slot(seq)
    assert bm.can_swap_out(group)
    assert len(bm.swap_out(group)) == 2 + 5  # blocks 3-4 of the window, 5 of the full layer
    assert bm.num_used_blocks == 0 and bm.can_swap_in(group) is AllocStatus.OK
    assert len(bm.swap_in(group)) == 7
    assert bm.tables.tables[1][0][:3] == [None] * 3


def _trace():
    return generate_trace(SyntheticConfig(num_requests=60, rate=4, lengths="sharegpt", seed=3))


def test_a_hybrid_model_simulates_on_its_groups():
    base = SimConfig(model="gemma-3-27b", gpu="h100-80gb", kv_memory_gb=2, max_model_len=4096)
    hybrid = simulate(_trace(), base)
    flat = simulate(_trace(), base.__class__(**{**base.__dict__, "disable_hybrid_kv_cache_manager": True}))
    # 2 GiB: 2 GiB // (10 layers x 128 KiB) = 1,638 blocks for 7 groups, against 2 GiB // (62 x 128 KiB).
    assert hybrid.summary["num_blocks"] == 2 * 2**30 // (10 * 131072) == 1638
    assert flat.summary["num_blocks"] == 2 * 2**30 // (62 * 131072) == 264
    assert hybrid.summary["num_finished"] == flat.summary["num_finished"] == 60
    states = ["token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free"]
    np.testing.assert_allclose(hybrid.memory[states].sum(axis=1), 1.0, atol=1e-9)
    # Prompts shorter than the window keep every token in all 7 groups: 70 layer pages per 16 tokens
    # against 62, the 8 padding layers showing as internal fragmentation once blocks are held.
    busy = hybrid.memory["block_occupancy"] > 0.5
    assert (hybrid.memory.loc[busy, "internal_fragmentation"] >= 0.5 * 8 / 70).all()


def test_fast_and_step_mode_log_the_same_memory_rows_on_groups():
    config = SimConfig(model="gemma-3-27b", gpu="h100-80gb", kv_memory_gb=0.5, max_model_len=2048)
    fast = simulate(_trace(), config)
    step = simulate(_trace(), config.__class__(**{**config.__dict__, "mode": "step"}))
    pd.testing.assert_frame_equal(fast.requests, step.requests)
    pd.testing.assert_frame_equal(fast.memory, step.memory)  # blocks_used counts pages, not layer slots


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_hybrid_preemption_keeps_every_invariant(preemption):
    config = SimConfig(model="gemma-3-27b", gpu="h100-80gb", kv_memory_gb=0.3, max_model_len=2048,
                       preemption_mode=preemption, swap_space_gb=0.3, debug=True)
    res = simulate(_trace().iloc[:25].reset_index(drop=True), config)
    assert res.summary["num_finished"] + res.summary["num_rejected"] == 25
    assert res.summary["num_preemptions"] > 0


def test_recomputed_samples_share_the_prompts_full_blocks_in_every_group():
    bm = GroupedBlockManager(20, LAYOUT, debug=True)
    seqs = [Sequence(i, 5, 12, request_id=7) for i in (1, 2)]  # simulated: no token content
    for s in seqs:
        s.num_generated = 3  # re-admitted after a recompute: 8 tokens, 4 blocks of 2 in each group
    group = SequenceGroup(7, seqs, n=2)
    assert bm.allocate(group) == 0
    first, second = bm.tables.tables[1], bm.tables.tables[2]
    for g in range(2):
        assert first[g][:2] == second[g][:2]  # the prompt's two full blocks
        assert not set(first[g][2:]) & set(second[g][2:])  # the samples' own tokens
    assert bm.num_free_blocks == 20 - (4 + 2) * 2
    assert [s.num_cached_tokens for s in seqs] == [0, 4]
    # One more sample's 2 own blocks per group no longer fit 12 blocks: refused.
    small = GroupedBlockManager(12, LAYOUT, debug=True)
    three = [Sequence(i, 5, 9, request_id=8) for i in (3, 4, 5)]
    for s in three:
        s.num_generated = 3
    assert small.can_allocate(SequenceGroup(8, three, n=3)) is AllocStatus.NEVER
    assert small.can_allocate(SequenceGroup(8, three[:2], n=2)) is AllocStatus.OK


@pytest.mark.parametrize("prompt_len, need", [(3, 4 + 2), (4, 4 + 4)])
def test_swapping_in_asks_for_exactly_the_blocks_the_next_tokens_take(prompt_len, need):
    # Two samples share 2 blocks in each group. With 3 tokens each appends to the shared partial last
    # block: one copy per group; with 4 each next token starts a block in both groups.
    def swapped_pair(num_blocks):
        bm = GroupedBlockManager(num_blocks, LAYOUT, num_cpu_blocks=20, debug=True)
        seqs = [Sequence(i, prompt_len, prompt_len + 1, request_id=0, token_ids=list(range(prompt_len)))
                for i in (1, 2)]
        group = SequenceGroup(0, seqs, n=2)
        bm.allocate(group)
        bm.swap_out(group)
        return bm, group

    bm, group = swapped_pair(need - 1)
    assert bm.can_swap_in(group) is AllocStatus.NEVER
    bm, group = swapped_pair(need)
    assert bm.can_swap_in(group) is AllocStatus.OK
    bm.swap_in(group)
    for seq in group.seqs:
        seq.token_ids.append(7)
        bm.append_slot(seq)
    assert bm.num_free_blocks == 0

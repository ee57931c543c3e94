"""Unit tests of the paged BlockManager."""
from __future__ import annotations

import pytest

from simulator import AllocationError, AllocStatus, BlockManager, ConfigError, Sequence, SequenceGroup
from simulator.core.sequence import SequenceStatus


def test_allocate_then_free_returns_every_block(paged, make_group):
    bm = paged(8, 4)
    g = make_group(10, 14)
    assert bm.can_allocate(g) is AllocStatus.OK
    bm.allocate(g)
    seq = g.seqs[0]
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 5
    assert [bm.pool.filled[b] for b in seq.block_table] == [4, 4, 2]
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_append_inside_block_allocates_nothing_and_crossing_allocates_one(paged, make_group):
    bm = paged(8, 4)
    g = make_group(5)
    bm.allocate(g)
    seq = g.seqs[0]
    free = bm.num_free_blocks
    for _ in range(3):  # tokens 6, 7, 8 fill the second block
        assert bm.append_slot(seq) == []
    assert bm.num_free_blocks == free
    bm.append_slot(seq)  # token 9 opens a third block
    assert bm.num_free_blocks == free - 1
    assert seq.num_tokens == 9 and len(seq.block_table) == 3


def test_bulk_append_matches_single_appends(make_group):
    for k in (1, 3, 4, 5, 17, 64):
        one = BlockManager(60, 4, debug=True)
        bulk = BlockManager(60, 4, debug=True)
        g1, g2 = make_group(6, 200), make_group(6, 200)
        one.allocate(g1)
        bulk.allocate(g2)
        for _ in range(k):
            one.append_slot(g1.seqs[0])
        bulk.append_slot(g2.seqs[0], k)
        assert g1.seqs[0].block_table == g2.seqs[0].block_table
        assert one.breakdown() == bulk.breakdown()


def test_prefix_hits_across_requests(paged, make_group):
    bm = paged(16, 4)
    prompt = list(range(10))
    a = make_group(10, token_ids=prompt)
    bm.allocate(a)
    b = make_group(11, token_ids=prompt + [99])
    hit_tokens = bm.allocate(b)
    assert hit_tokens == 8  # two full blocks shared, the partial third is not cacheable
    assert b.seqs[0].block_table[:2] == a.seqs[0].block_table[:2]
    assert b.seqs[0].block_table[2] != a.seqs[0].block_table[2]
    assert bm.pool.ref[a.seqs[0].block_table[0]] == 2
    assert bm.stats.prefix_hits == 2


def test_freed_cached_block_stays_reusable_until_evicted(paged, make_group):
    bm = paged(4, 4)
    prompt = list(range(9))
    a = make_group(9, token_ids=prompt)
    bm.allocate(a)
    first_two = a.seqs[0].block_table[:2]
    bm.free(a.seqs[0])
    assert bm.num_cached_free_blocks == 2 and bm.num_free_blocks == 4
    assert bm.breakdown().cached_free == 8
    b = make_group(9, token_ids=prompt)
    assert bm.allocate(b) == 8
    assert b.seqs[0].block_table[:2] == first_two


def test_lru_eviction_order(paged, make_group):
    bm = paged(4, 2)
    old = make_group(3, token_ids=[1, 1, 7])  # caches block (1,1)
    new = make_group(3, token_ids=[2, 2, 7])  # caches block (2,2)
    bm.allocate(old)
    bm.allocate(new)
    bm.free(old.seqs[0])
    bm.free(new.seqs[0])  # (1,1) was freed first: least recently used
    filler = make_group(6)  # needs 3 blocks: 2 uncached free + evicts exactly one cached block
    bm.allocate(filler)
    assert bm.stats.evictions == 1
    bm.free(filler.seqs[0])
    assert bm.allocate(make_group(3, token_ids=[2, 2, 9])) == 2  # the more recently used survived
    assert bm.allocate(make_group(3, token_ids=[1, 1, 9])) == 0  # the older one was evicted


def test_a_hit_refreshes_lru_order(paged, make_group):
    bm = paged(4, 2)
    a, b = make_group(3, token_ids=[1, 1, 5]), make_group(3, token_ids=[2, 2, 5])
    bm.allocate(a)
    bm.allocate(b)
    bm.free(a.seqs[0])
    bm.free(b.seqs[0])  # LRU order now: (1,1), (2,2)
    reuse_a = make_group(3, token_ids=[1, 1, 6])
    assert bm.allocate(reuse_a) == 2
    bm.free(reuse_a.seqs[0])  # (1,1) is now the most recently used
    filler = make_group(5)  # 3 blocks: 2 uncached free + one eviction
    bm.allocate(filler)
    assert bm.stats.evictions == 1
    bm.free(filler.seqs[0])
    assert bm.allocate(make_group(3, token_ids=[1, 1, 7])) == 2
    assert bm.allocate(make_group(3, token_ids=[2, 2, 7])) == 0


def test_last_prompt_token_is_never_a_hit(paged, make_group):
    bm = paged(8, 4)
    prompt = list(range(8))  # exactly two full blocks
    bm.allocate(make_group(8, token_ids=prompt))
    b = make_group(8, token_ids=prompt)
    assert bm.allocate(b) == 4  # only the first block: the last token's logits must be computed
    assert bm.stats.prefix_hits == 1


def test_forced_hash_collision_does_not_alias(make_group):
    bm = BlockManager(8, 2, debug=True, hash_fn=lambda _: 0)  # every block hashes the same
    a = make_group(3, token_ids=[1, 2, 3])
    bm.allocate(a)
    b = make_group(3, token_ids=[4, 5, 6])
    assert bm.allocate(b) == 0
    assert b.seqs[0].block_table[0] != a.seqs[0].block_table[0]
    c = make_group(3, token_ids=[1, 2, 9])
    assert bm.allocate(c) == 2  # the genuine match still hits


def test_extra_key_separates_identical_tokens(paged):
    bm = paged(8, 2)
    a = Sequence(0, 3, token_ids=[1, 2, 3], extra_key="lora-a")
    b = Sequence(1, 3, token_ids=[1, 2, 3], extra_key="lora-b")
    bm.allocate(SequenceGroup(0, [a]))
    assert bm.allocate(SequenceGroup(1, [b])) == 0


def test_simulated_prefix_keys_hit(paged, make_group):
    bm = paged(16, 4)
    a = make_group(20, prefix_keys=(7, 8, 9))
    bm.allocate(a)
    b = make_group(30, prefix_keys=(7, 8, 10))
    assert bm.allocate(b) == 8


def test_parallel_sampling_shares_prompt_blocks(paged, make_group):
    bm = paged(32, 4)
    g = make_group(10, 20, n=4)
    bm.allocate(g)
    tables = {tuple(s.block_table) for s in g.seqs}
    assert len(tables) == 1
    assert all(bm.pool.ref[b] == 4 for b in g.seqs[0].block_table)
    assert bm.num_used_blocks == 3
    copies = [bm.append_slot(s) for s in g.seqs]
    # The shared partial block is copied for three samples; the last one writes it in place.
    assert sum(len(c) for c in copies) == 3
    assert bm.stats.cow_copies == 3
    assert bm.num_used_blocks == 3 + 3
    assert all(bm.pool.ref[b] == 4 for b in g.seqs[0].block_table[:2])


def test_diverging_beams_copy_only_the_last_partial_block(paged, make_group):
    bm = paged(32, 4)
    g = make_group(10, 30)
    bm.allocate(g)
    parent = g.seqs[0]
    child = parent.fork(99)
    assert bm.fork(parent, child) == []
    copies = bm.append_slot(child)
    assert copies == [(parent.block_table[2], child.block_table[2])]
    assert child.block_table[:2] == parent.block_table[:2]
    assert bm.append_slot(parent) == []  # parent now owns its last block alone


def test_shared_full_block_is_not_copied_on_append(paged, make_group):
    bm = paged(32, 4)
    g = make_group(8, 30)
    bm.allocate(g)
    child = g.seqs[0].fork(50)
    bm.fork(g.seqs[0], child)
    assert bm.append_slot(child) == []  # the last block is full: a new block, no copy
    assert bm.stats.cow_copies == 0


def test_swap_round_trip_keeps_sharing(paged, make_group):
    bm = paged(16, 4, num_cpu_blocks=16)
    g = make_group(10, 30, n=3)
    bm.allocate(g)
    for s in g.seqs:
        bm.append_slot(s)
    used = bm.num_used_blocks
    before = {s.seq_id: s.num_tokens for s in g.seqs}
    assert bm.can_swap_out(g)
    out = bm.swap_out(g)
    assert len(out) == used  # every distinct block copied once
    assert bm.num_used_blocks == 0
    assert bm.num_free_cpu_blocks == 16 - used
    assert bm.can_swap_in(g) is AllocStatus.OK
    back = bm.swap_in(g)
    assert len(back) == used and bm.num_used_blocks == used
    assert {s.seq_id: s.num_tokens for s in g.seqs} == before
    assert all(bm.pool.ref[b] == 3 for b in g.seqs[0].block_table[:2])
    assert bm.num_free_cpu_blocks == 16


def test_never_for_a_prompt_larger_than_the_pool(paged, make_group):
    bm = paged(4, 4)
    assert bm.can_allocate(make_group(17)) is AllocStatus.NEVER
    assert bm.can_allocate(make_group(16)) is AllocStatus.OK


def test_later_when_busy_and_queries_change_nothing(paged, make_group):
    bm = paged(4, 4)
    bm.allocate(make_group(12))
    g = make_group(8)
    snapshot = (bm.num_free_blocks, bm.breakdown(), bm.stats.as_dict())
    assert bm.can_allocate(g) is AllocStatus.LATER
    assert (bm.num_free_blocks, bm.breakdown(), bm.stats.as_dict()) == snapshot
    with pytest.raises(AllocationError, match="cannot allocate"):
        bm.allocate(g)
    assert (bm.num_free_blocks, bm.breakdown(), bm.stats.as_dict()) == snapshot


def test_watermark_holds_back_blocks(make_group):
    bm = BlockManager(100, 1, watermark=0.1, debug=True)
    assert bm.can_allocate(make_group(91)) is AllocStatus.NEVER
    assert bm.can_allocate(make_group(90)) is AllocStatus.OK
    bm.allocate(make_group(50))
    assert bm.can_allocate(make_group(41)) is AllocStatus.LATER


def test_bad_input_raises_typed_errors(paged, make_group):
    bm = paged(4, 4)
    g = make_group(4)
    bm.allocate(g)
    seq = g.seqs[0]
    with pytest.raises(AllocationError, match="already holds"):
        bm.allocate(g)
    with pytest.raises(AllocationError, match="negative"):
        bm.append_slot(seq, -1)
    with pytest.raises(AllocationError, match="out of KV blocks"):
        bm.append_slot(seq, 100)
    assert seq.num_tokens == 4  # the failed append changed nothing
    bm.free(seq)
    with pytest.raises(AllocationError, match="freed twice"):
        bm.free(seq)
    seq.status = SequenceStatus.FINISHED
    with pytest.raises(AllocationError, match="finished"):
        bm.append_slot(seq)
    with pytest.raises(AllocationError, match="prompt_len"):
        Sequence(1, -3)
    with pytest.raises(ConfigError):
        BlockManager(4, 0)


def test_taxonomy_splits_reservation_and_internal_fragmentation(paged, make_group):
    bm = BlockManager.from_capacity(43, 4, debug=True)  # 10 blocks, 3 slots can never form a block
    g = make_group(5, 10)  # final length 10 -> 3 blocks, 2 slots of the last never filled
    bm.allocate(g)
    b = bm.breakdown()
    assert (b.token_states, b.reservation, b.internal_fragmentation) == (5, 3, 0)
    assert b.external_fragmentation == 3 and b.free == 32
    bm.append_slot(g.seqs[0], 4)  # 9 tokens, now in the final block
    b = bm.breakdown()
    assert (b.token_states, b.reservation, b.internal_fragmentation) == (9, 1, 2)
    assert sum(b.fractions().values()) == pytest.approx(1.0)
    assert b.block_occupancy == pytest.approx(12 / 43)
    assert b.token_occupancy == pytest.approx(9 / 43)


@pytest.mark.parametrize("how", ["publish", "fork", "none"])
def test_a_release_takes_the_bulk_path_only_while_no_block_was_ever_shared_or_keyed(paged, make_group, how):
    bm = paged(16, 4, enable_prefix_caching=how == "publish")
    g = make_group(9, token_ids=list(range(9)) if how == "publish" else None)
    bm.allocate(g)
    if how == "fork":
        bm.fork(g.seqs[0], make_group(1).seqs[0])
    assert bm.pool.plain is (how == "none")
    bm.free(g.seqs[0])  # the debug checker verifies ref counts, pools and the cache after the release
    assert bm.pool.plain is (how == "none")  # a claim about the past: it never turns back on
    if how == "publish":
        assert len(bm.pool.cached) == 2 and bm.num_cached_free_blocks == 2


@pytest.mark.parametrize("debug", [False, True])
def test_a_forked_sequence_counts_the_waste_of_the_final_block_it_shares_at_once(make_group, debug):
    # A beam forked once the parent holds its final block adds no block of its own: its waste past the
    # final length must count at the fork, not at a block boundary it never reaches.
    bm = BlockManager(16, 4, debug=debug)
    group = make_group(6, 7)
    bm.allocate(group)
    parent = group.seqs[0]
    assert bm.num_internal_slots == 1  # 8 slots for 7 tokens
    child = Sequence(10**6, 6, 7, request_id=group.request_id)
    bm.fork(parent, child)
    assert bm.num_internal_slots == 2
    for seq in (parent, child):
        bm.append_slot(seq)  # the child copies the shared last block and still wastes one slot
    assert bm.num_internal_slots == 2


def _diverged(make_group, n: int, prompt_len: int, generated: int) -> SequenceGroup:
    """A simulated group of `n` samples re-admitted after a recompute: each generated `generated` tokens."""
    g = make_group(prompt_len, prompt_len + generated + 1, n=n)
    for s in g.seqs:
        s.num_generated = generated
    return g


def test_recomputed_samples_share_only_the_prompts_full_blocks(paged, make_group):
    bm = paged(32, 4)
    g = _diverged(make_group, 3, 10, 5)  # 15 tokens each: 2 full prompt blocks, then their own
    assert bm.can_allocate(g) is AllocStatus.OK
    assert bm.allocate(g) == 0  # sharing within the group is not a prefix-cache hit
    heads = {tuple(s.block_table[:2]) for s in g.seqs}
    tails = [b for s in g.seqs for b in s.block_table[2:]]
    assert len(heads) == 1 and all(bm.pool.ref[b] == 3 for b in g.seqs[0].block_table[:2])
    assert len(set(tails)) == len(tails) == 3 * 2  # each sample's generated tokens in blocks of its own
    assert bm.num_used_blocks == 2 + 6
    assert [s.num_cached_tokens for s in g.seqs] == [0, 8, 8]
    for s in g.seqs:
        bm.free(s)
    assert bm.num_free_blocks == 32


def test_recomputed_samples_that_never_fit_together_are_refused(paged, make_group):
    # 15 tokens each: 2 shared blocks + 3 x 2 of their own = 8 blocks, though one sample alone needs 4.
    assert paged(7, 4).can_allocate(_diverged(make_group, 3, 10, 5)) is AllocStatus.NEVER
    assert paged(8, 4).can_allocate(_diverged(make_group, 3, 10, 5)) is AllocStatus.OK


def test_swapping_a_group_that_holds_nothing_there_is_refused():
    bm = BlockManager(10, 4, num_cpu_blocks=10)
    group = SequenceGroup(10, [Sequence(10, 4, 8)])  # never allocated
    with pytest.raises(AllocationError, match="request 10: none of its sequences holds device blocks"):
        bm.swap_out(group)
    with pytest.raises(AllocationError, match="request 10: none of its sequences is swapped out"):
        bm.swap_in(group)
    bm.allocate(group)
    assert bm.swap_out(group) and bm.swap_in(group)  # once allocated, out and back

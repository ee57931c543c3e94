"""Prefix caching in the BlockManager with vLLM's semantics: publishing only computed blocks, re-sharing
cached blocks on swap-in, exact `can_swap_in`, resetting the cache, hit statistics in tokens."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator import AllocationError, AllocStatus
from simulator.core.paged.prefix_cache import same_key
from simulator.core.sequence import SequenceStatus


def _cached_blocks(bm) -> set[int]:
    return set(bm.pool.cached.values())


def test_allocate_publishes_only_the_blocks_its_first_chunk_computes(paged, make_group):
    bm = paged(16, 4)
    prompt = list(range(17))
    g = make_group(17, token_ids=prompt)
    assert bm.allocate(g, num_new_tokens=6) == 0
    table = g.seqs[0].block_table
    assert _cached_blocks(bm) == {table[0]}  # tokens 0-5: only block 0 is complete
    bm.cache_blocks(g, 17 - 13)  # a second chunk up to token 13: blocks 1 and 2 complete
    assert _cached_blocks(bm) == set(table[:3])
    other = make_group(17, token_ids=prompt)
    assert bm.allocate(other) == 12  # the uncomputed block 3 is no hit
    bm.cache_blocks(g, 1)
    # One block per content: the other request computed block 3 first, so its copy stays published.
    assert _cached_blocks(bm) == set(table[:3]) | {other.seqs[0].block_table[3]}


def test_diverged_sequences_publish_in_prefill_order(paged, make_group):
    bm = paged(32, 4)
    g = make_group(8, token_ids=list(range(8)), n=2)
    g.seqs[1].token_ids = list(range(100, 108))  # diverged: each sequence gets its own blocks
    bm.allocate(g, num_new_tokens=10)  # the first sequence's 8 tokens, then 2 of the second
    first, second = (s.block_table for s in g.seqs)
    assert _cached_blocks(bm) == set(first)
    bm.cache_blocks(g, 2)  # 14 of 16 computed: the second sequence's first block is done
    assert _cached_blocks(bm) == set(first) | {second[0]}


def test_prefix_stats_count_tokens_too(paged, make_group):
    bm = paged(16, 4)
    prompt = list(range(10))
    bm.allocate(make_group(10, token_ids=prompt))
    bm.allocate(make_group(11, token_ids=prompt + [5]))
    s = bm.stats
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (21, 8)
    assert (s.prefix_queries, s.prefix_hits) == (2 + 2, 2)


def _shared_pair(bm, make_group, prompt_len=12, tail=(50, 51)):
    """Two running requests whose first full blocks are shared through the prefix cache."""
    prompt = list(range(prompt_len))
    a = make_group(prompt_len, prompt_len + 2, token_ids=prompt)
    bm.allocate(a)
    b = make_group(prompt_len + len(tail), prompt_len + len(tail) + 2, token_ids=prompt + list(tail))
    hit = bm.allocate(b)
    for g in (a, b):
        for s in g.seqs:
            s.status = SequenceStatus.RUNNING
    return a, b, hit


def test_swap_in_reshares_blocks_still_cached_on_the_device(paged, make_group):
    bm = paged(16, 4, num_cpu_blocks=16)
    a, b, hit = _shared_pair(bm, make_group)
    assert hit == 12
    used = bm.num_used_blocks
    out = bm.swap_out(b)
    assert len(out) == len(b.seqs[0].cpu_block_table) == 4  # every block goes to the CPU
    copies = bm.swap_in(b)
    table = b.seqs[0].block_table
    assert table[:3] == a.seqs[0].block_table[:3]  # the cached full blocks are shared again
    assert [dst for _, dst in copies] == [table[3]]  # only the partial last block is copied
    assert bm.num_used_blocks == used and bm.pool.ref[table[0]] == 2
    assert bm.stats.swapped_in_blocks == 1


def test_swap_in_reshares_cached_free_blocks_without_copying(paged, make_group):
    bm = paged(16, 4, num_cpu_blocks=16)
    g = make_group(9, 12, token_ids=list(range(9)))
    bm.allocate(g)
    before = list(g.seqs[0].block_table)
    bm.swap_out(g)
    assert bm.num_cached_free_blocks == 2  # its two full blocks stay cached after leaving
    assert [dst for _, dst in bm.swap_in(g)] == [g.seqs[0].block_table[2]]
    assert g.seqs[0].block_table[:2] == before[:2]


def test_can_swap_in_counts_exactly(paged, make_group):
    # 5 tokens in blocks of 4: two blocks back, and the next token fits in the second one.
    bm = paged(4, 4, num_cpu_blocks=8)
    g = make_group(5, 8)
    bm.allocate(g)
    bm.swap_out(g)
    filler = make_group(8, 8)
    bm.allocate(filler)  # 2 of 4 blocks left: exactly enough
    assert bm.can_swap_in(g) is AllocStatus.OK
    bm.free(filler.seqs[0])
    filler = make_group(9, 9)
    bm.allocate(filler)  # 1 left: later
    assert bm.can_swap_in(g) is AllocStatus.LATER
    bm.free(filler.seqs[0])
    bm.swap_in(g)
    assert bm.append_slot(g.seqs[0]) == [] and bm.num_used_blocks == 2


def test_can_swap_in_adds_a_block_when_the_last_one_is_full(paged, make_group):
    bm = paged(4, 4, num_cpu_blocks=8)
    g = make_group(8, 12)
    bm.allocate(g)
    bm.swap_out(g)
    filler = make_group(8, 8)
    bm.allocate(filler)
    assert bm.can_swap_in(g) is AllocStatus.LATER  # two blocks back plus one for the next token
    bm.free(filler.seqs[0])
    assert bm.can_swap_in(g) is AllocStatus.OK


def test_can_swap_in_counts_copy_on_write_of_a_shared_partial_block(paged, make_group):
    bm = paged(6, 4, num_cpu_blocks=8)
    g = make_group(6, 8, n=3)  # three samples sharing two blocks, the second half full
    bm.allocate(g)
    bm.swap_out(g)
    filler = make_group(8, 8)
    bm.allocate(filler)  # 4 left: 2 blocks back + 2 copies (the last sharer writes in place)
    assert bm.can_swap_in(g) is AllocStatus.OK
    other = make_group(1, 1)
    bm.allocate(other)
    assert bm.can_swap_in(g) is AllocStatus.LATER
    bm.free(other.seqs[0])
    bm.swap_in(g)
    for s in g.seqs:
        bm.append_slot(s)
    assert bm.num_free_blocks == 0


def test_can_swap_in_says_never_when_the_group_outgrew_the_pool(paged, make_group):
    bm = paged(4, 4, num_cpu_blocks=8)
    g = make_group(4, 9, n=2)  # two samples: one shared block, then one block each
    bm.allocate(g)
    for s in g.seqs:
        bm.append_slot(s, 4)
    bm.swap_out(g)
    assert bm.can_swap_in(g) is AllocStatus.NEVER  # 3 blocks back + 2 for the next tokens > 4


def test_swap_in_evicts_other_cached_blocks_not_its_own(paged, make_group):
    # Free blocks: the group's two cached ones (oldest), then another request's cached block, no uncached
    # one. Taking a fresh block for the group's partial tail must evict the other's, not the group's.
    bm = paged(4, 4, num_cpu_blocks=8)
    g = make_group(9, 10, token_ids=list(range(9)))
    bm.allocate(g)
    before = list(g.seqs[0].block_table)
    bm.swap_out(g)
    x = make_group(4, 4, token_ids=[90, 91, 92, 93])
    bm.allocate(x)
    holder = make_group(1, 1)
    bm.allocate(holder)
    x_block = x.seqs[0].block_table[0]
    bm.free(x.seqs[0])
    assert bm.num_free_blocks == bm.num_cached_free_blocks == 3
    assert bm.can_swap_in(g) is AllocStatus.OK
    copies = bm.swap_in(g)
    assert len(copies) == 1 and bm.stats.evictions == 1
    assert g.seqs[0].block_table == before[:2] + [x_block]  # the other's block was the one evicted


def test_reset_prefix_cache_refuses_while_blocks_are_in_use(paged, make_group):
    bm = paged(8, 4)
    prompt = list(range(9))
    g = make_group(9, token_ids=prompt)
    bm.allocate(g)
    with pytest.raises(AllocationError, match="still in use"):
        bm.prefix_cache.reset()
    bm.free(g.seqs[0])
    assert bm.num_cached_free_blocks == 2
    assert bm.prefix_cache.reset() == 2
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 8
    assert bm.allocate(make_group(9, token_ids=prompt)) == 0  # nothing left to hit



def _chain(contents: list[int], extra, parent: tuple | None = None) -> tuple | None:
    """The chained key of `contents` following on from `parent`."""
    key = parent
    for c in contents:
        key = (key, c, extra)
    return key


def _ancestor(key: tuple | None, up: int) -> tuple | None:
    for _ in range(up):
        key = key[0]
    return key


@given(a=st.lists(st.integers(0, 3), max_size=12), b=st.lists(st.integers(0, 3), max_size=12),
       extra=st.sampled_from([None, 1]), other_extra=st.sampled_from([None, 1]), cut=st.integers(0, 12))
def test_same_key_agrees_with_equality_on_keys_built_apart_or_sharing_a_parent(a, b, extra, other_extra, cut):
    first = _chain(a, extra)
    apart = _chain(b, other_extra)
    assert same_key(first, apart) == (first == apart)
    kept = min(cut, len(a))  # `grown` shares the very object of `first`'s first `kept` blocks
    grown = _chain(b, extra, _ancestor(first, len(a) - kept))
    assert same_key(first, grown) == (first == grown)


def test_same_key_walks_chains_deeper_than_the_recursion_limit():
    deep = _chain(list(range(5000)), None)
    again = _chain(list(range(5000)), None)
    with pytest.raises(RecursionError):
        _ = deep == again
    assert same_key(deep, again)
    assert not same_key(deep, (again[0], -1, None))

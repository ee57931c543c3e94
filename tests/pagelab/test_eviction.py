"""Eviction policies: sizes never exceed the capacity, the order each policy promises, removals."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagelab.eviction import LFU, LRU, POLICIES, S3FIFO, make_policy

ops = st.lists(st.tuples(st.sampled_from(["admit", "remove"]), st.integers(0, 30), st.integers(1, 4)),
               max_size=200)


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(POLICIES)), capacity=st.integers(0, 20), steps=ops)
def test_capacity_is_never_exceeded_and_sizes_add_up(name, capacity, steps):
    cache = make_policy(name, capacity)
    held: dict[int, int] = {}
    for op, key, size in steps:
        if op == "admit":
            evicted = cache.admit(key, size)
            held[key] = max(held.get(key, 0), size)
            for k in evicted:
                held.pop(k)
        elif key in cache:
            cache.remove(key)
            held.pop(key)
        assert cache.used == sum(held.values()) <= capacity
        assert set(cache.size) == set(held)
        if name == "s3fifo":  # the small FIFO's share follows its keys as they grow
            assert cache.small_used == sum(cache.size[k] for k in cache.small)


def test_lru_evicts_the_least_recently_used():
    cache = LRU(3)
    for k in (1, 2, 3):
        cache.admit(k)
    cache.admit(1)
    assert cache.admit(4) == [2]


def test_lfu_evicts_the_least_used_then_the_least_recent():
    cache = LFU(3)
    for k in (1, 2, 3, 1, 3):
        cache.admit(k)
    assert cache.admit(4) == [2]
    assert cache.admit(5) == [4]


def test_s3fifo_drops_blocks_read_once_before_reused_ones():
    cache = S3FIFO(10)
    for k in range(5):
        cache.admit(k)
        cache.admit(k)  # reused: promoted when it leaves the small FIFO
    for k in range(100, 130):  # a scan of blocks read once
        cache.admit(k)
    assert all(k in cache for k in range(5))


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="'arc'"):
        make_policy("arc", 4)

"""The tiers' batched paths (`Tiers.flush` storing, discarding and spilling whole batches through C-level
map/zip and set operations; `Tiers.load` counting runs of one tier at once) against the same rules
written as plain per-block loops: a batch stores what one block at a time stores."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.core.paged.tier import Tier, TierSpec
from simulator.core.paged.tiers import Tiers

# A hash may repeat in a batch: eager stores hand a block down each time it is released.
STORE = st.tuples(st.just("store"), st.lists(st.integers(0, 30), max_size=12))
LOAD = st.tuples(st.just("load"), st.lists(st.integers(0, 30), max_size=6))
POLICIES = st.sampled_from(["lru", "lfu", "s3fifo"])


def _key(h: int) -> tuple:
    return (None, h % 7, None)  # (parent key, content, extra key), as the pool publishes them


def _put_many(tier: Tier, pairs: list) -> list:
    """Store each pair in order, one `put` at a time; the pairs evicted (the rule `Tier.put_many` keeps)."""
    return [e for h, key in pairs for e in tier.put(h, key)]


def _store(tier: Tier, pairs: list) -> None:
    """One block at a time: it leaves the lower tiers (a block lives in one tier), the tier takes it, and
    what that evicts goes one tier down before the next block comes."""
    for h, key in pairs:
        for other in tier.below:
            if h in other.keys:
                other.discard(h)
        evicted = tier.put(h, key)
        if evicted:
            tier.stats.evicted_blocks += len(evicted)
            if tier.below:
                _store(tier.below[0], evicted)


@settings(max_examples=400, deadline=None)
@given(ops=st.lists(st.one_of(STORE, LOAD), max_size=40), cpu=st.integers(0, 8), disk=st.integers(0, 8),
       policy=POLICIES)
def test_batched_stores_and_loads_equal_the_per_block_rules(ops, cpu, disk, policy):
    specs = [TierSpec("cpu", cpu, policy=policy), TierSpec("disk", disk, policy=policy)]
    batched, plain = Tiers(specs, "lazy", 4, 8), Tiers(specs, "lazy", 4, 8)
    for op, hashes in ops:
        if op == "store":
            batched.queue.extend((h, _key(h)) for h in hashes)
            batched.flush()
            _store(plain.top, [(h, _key(h)) for h in hashes])
            continue
        for tiers in (batched, plain):
            found = [(t, h, t.keys[h]) for h in hashes for t in tiers.tiers if h in t.keys]
            if tiers is batched:
                tiers.load(found)
            else:
                for tier, h, _ in found:
                    tier.touch(h)
                    tier.pending += 1
                    tier.stats.hit_blocks += 1
                    tier.stats.hit_tokens += tiers.block_size
        for a, b in zip(batched.tiers, plain.tiers, strict=True):
            assert list(a.keys.items()) == list(b.keys.items())
            assert (a.stats, a.pending) == (b.stats, b.pending)
            assert sorted(a.cache.size) == sorted(b.cache.size)


@settings(max_examples=300, deadline=None)
@given(held=st.lists(st.integers(0, 20), max_size=10, unique=True), capacity=st.integers(0, 10),
       batch=st.lists(st.integers(0, 25), max_size=14))
def test_an_lru_batch_evicts_what_one_put_at_a_time_evicts(held, capacity, batch):
    """Held blocks among the oldest, repeated hashes and batches larger than the tier included: a held
    block that one put at a time evicts before its turn comes back as a new store."""
    tiers = [Tier(TierSpec("cpu", capacity)) for _ in range(2)]
    for tier in tiers:
        for h in held:
            tier.put(h, _key(h))
        tier.stats.stored_blocks = 0
    pairs = [(h, _key(h + i)) for i, h in enumerate(batch)]
    assert tiers[0].put_many(pairs) == _put_many(tiers[1], pairs)
    assert list(tiers[0].keys.items()) == list(tiers[1].keys.items())
    assert tiers[0].stats == tiers[1].stats

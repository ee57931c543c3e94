"""The tiers' batched paths (`Tiers.flush` storing, discarding and spilling whole batches through C-level
map/zip and set operations; `Tiers.load` counting runs of one tier at once) against the same rules
written as plain per-block loops."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.core.paged.tiers import Tier, Tiers, TierSpec

# A batch holds distinct hashes: the pool hands a hash down again only once it is published again, which
# between two flushes is rare (and the per-block rule below would discard a repeated hash twice).
STORE = st.tuples(st.just("store"), st.lists(st.integers(0, 30), max_size=12, unique=True))
LOAD = st.tuples(st.just("load"), st.lists(st.integers(0, 30), max_size=6))
POLICIES = st.sampled_from(["lru", "lfu", "s3fifo"])


def _key(h: int) -> tuple:
    return (None, h % 7, None)  # (parent key, content, extra key), as the pool publishes them


def _put_many(tier: Tier, pairs: list) -> list:
    """Store each pair in order; the pairs evicted (the rule `Tier.put_many` follows)."""
    if not tier.lru:
        return [e for h, key in pairs for e in tier.put(h, key)]
    keys, before = tier.keys, len(tier.keys)
    if any(h in keys for h, _ in pairs):
        for h, key in pairs:
            if h in keys:
                keys.move_to_end(h)
            keys[h] = key
    else:
        keys.update(pairs)
    tier.stats.stored_blocks += len(keys) - before
    return [keys.popitem(last=False) for _ in range(len(keys) - tier.cache.capacity)]


def _store(tier: Tier, pairs: list) -> None:
    """A block lives in one tier: the tier takes the batch, its evictions go one tier down."""
    if not tier.lru and len(pairs) > 1:
        for pair in pairs:
            _store(tier, [pair])
        return
    for other in tier.below:
        for h in [h for h, _ in pairs if h in other.keys]:
            other.discard(h)
    evicted = _put_many(tier, pairs)
    if evicted:
        tier.stats.evicted_blocks += len(evicted)
        if tier.below:
            _store(tier.below[0], evicted)


@settings(max_examples=200, deadline=None)
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

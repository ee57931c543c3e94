"""The tiers' batched paths against the same rules written as plain per-block loops: a batch stores what
one block at a time stores. An all-LRU stack is kept as numbered entries (tier_lru.py: spills by ranges,
compaction); other policies go block by block (tier.PolicyTiers). The rules: `Tier` objects, one `put` at
a time, what each evicts going one tier down before the next block comes."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.core.paged.tier import Tier, TierSpec
from simulator.core.paged.tiers import Tiers

# A hash may repeat in a batch: eager stores hand a block down each time it is released.
STORE = st.tuples(st.just("store"), st.lists(st.integers(0, 30), max_size=12))
LOAD = st.tuples(st.just("load"), st.lists(st.integers(0, 30), max_size=6))
SWAP = st.tuples(st.just("swap"), st.integers(0, 8))  # blocks swapped out: the CPU tier's room shrinks
POLICIES = st.sampled_from(["lru", "lfu", "s3fifo"])


# How a block's content key relates to its hash: a trace's block id per prefix ("ids"), an id shared by
# several prefixes ("shared": the numbered stack indexes all but one held block of an id by hash), a tuple
# of tokens as the engine's blocks have ("tokens"), or a mix.
CONTENTS = st.sampled_from(["ids", "shared", "tokens", "mixed"])


def _key(h: int, contents: str = "shared") -> tuple:
    """The pool's key (parent key, content, extra key) of the block with hash `h`."""
    content = {"ids": h, "shared": h % 7, "tokens": (h % 7,), "mixed": h % 7 if h % 2 else (h,)}[contents]
    return (None, content, None)


def _store(tier: Tier, pairs: list) -> None:
    """One block at a time: it leaves the lower tiers (a block lives in one tier), the tier takes it, and
    what that evicts goes one tier down before the next block comes."""
    for h, key in pairs:
        for other in tier.below:
            if h in other.keys:
                other.discard(h)
        _spill(tier, tier.put(h, key))


def _spill(tier: Tier, evicted: list) -> None:
    if evicted:
        tier.stats.evicted_blocks += len(evicted)
        if tier.below:
            _store(tier.below[0], evicted)


def _rules(specs: list[TierSpec]) -> list[Tier]:
    tiers = [Tier(s) for s in specs]
    for i, tier in enumerate(tiers):
        tier.below = tiers[i + 1:]
    return tiers


def _order(tier) -> list:
    """A tier's (hash, key) pairs, in its policy's order where the tier keeps one (LRU: oldest first)."""
    if tier.lru:
        return list(tier.keys.items())
    if tier.spec.policy == "lru":
        return [(h, tier.keys[h]) for h in tier.cache.order]
    return sorted(tier.keys.items())


def _check_numbered(tiers: Tiers) -> None:
    """The numbered stack's own bookkeeping: every content key in the index names a held entry with that
    content, a block indexed by hash is not also indexed by content, every held block is found by lookup,
    and each tier's count is what its bytes say."""
    s = tiers.stack
    assert len(s.hashes) == len(s.keys) == len(s.where)
    for k, g in s.loc.items():
        assert s.where[g - s.base] and s.keys[g - s.base] is not None
        assert s.keys[g - s.base][1] == k
    for h, g in s.clash.items():
        assert s.where[g - s.base] and s.hashes[g - s.base] == h
        other = s.loc.get(s.keys[g - s.base][1])
        assert other is None or s.hashes[other - s.base] != h
    for g, h in enumerate(s.hashes):
        if h is not None:
            assert s.lookup(h, s.keys[g][1]) == (s.tiers[s.where[g] - 1], s.keys[g])
    for g, code in enumerate(s.where):  # an entry that left keeps nothing alive
        assert (s.keys[g] is None) == (code == 0)
    assert s.used == [s.where.count(i + 1) for i in range(len(s.tiers))]
    assert len(s.loc) + len(s.clash) == sum(s.used)


@settings(max_examples=500, deadline=None)
@given(ops=st.lists(st.one_of(STORE, LOAD, SWAP), max_size=40), cpu=st.integers(0, 8),
       disk=st.integers(0, 8), policy=POLICIES, compact=st.booleans(), contents=CONTENTS)
def test_batched_stores_and_loads_equal_the_per_block_rules(ops, cpu, disk, policy, compact, contents):
    specs = [TierSpec("cpu", cpu, policy=policy), TierSpec("disk", disk, policy=policy)]
    swapped = [0]
    batched, plain = Tiers(specs, "lazy", 4, 8, swap_used=lambda: swapped[0]), _rules(specs)

    def fit_plain() -> None:  # the CPU tier keeps the room swapped-out blocks leave it
        room = max(0, cpu - swapped[0])
        if plain[0].capacity != room:
            _spill(plain[0], plain[0].resize(room))

    assert batched.tiers[0].lru == (policy == "lru")
    handed: dict[int, tuple] = {}
    if compact and policy == "lru":
        batched.stack.compact_min = batched.stack.compact_at = 4
    for op, arg in ops:
        if op == "store":
            batched.hand(arg, [_key(h, contents) for h in arg])
            handed.update((h, _key(h, contents)) for h in arg)
            batched.flush()
            if arg and plain[0].capacity != cpu:
                fit_plain()
            _store(plain[0], [(h, _key(h, contents)) for h in arg])
        elif op == "swap":
            swapped[0] = arg
            batched.fit()
            fit_plain()
        else:
            found = [(t, h, t.keys[h]) for h in dict.fromkeys(arg) for t in batched.tiers if h in t.keys]
            batched.load(found)
            for h in dict.fromkeys(arg):
                for tier in plain:
                    if h in tier.keys:
                        tier.touch(h)
                        tier.pending += 1
                        tier.stats.hit_blocks += 1
                        tier.stats.hit_tokens += batched.block_size
        for a, b in zip(batched.tiers, plain, strict=True):
            assert _order(a) == _order(b)
            assert (a.stats, a.pending, a.used, a.capacity) == (b.stats, b.pending, b.used, b.capacity)
            assert {h for h, key in handed.items() if a.holds(h, key)} == set(b.keys)
        if policy == "lru":
            _check_numbered(batched)


@settings(max_examples=300, deadline=None)
@given(held=st.lists(st.integers(0, 20), max_size=10, unique=True), capacity=st.integers(0, 10),
       batch=st.lists(st.integers(0, 25), max_size=14), disk=st.integers(0, 12), contents=CONTENTS)
def test_an_lru_batch_evicts_what_one_put_at_a_time_evicts(held, capacity, batch, disk, contents):
    """Held blocks among the oldest of either tier, repeated hashes and batches larger than the tier: a
    held block that one put at a time evicts before its turn comes back as a new store."""
    specs = [TierSpec("cpu", capacity), TierSpec("disk", disk)]
    numbered, plain = Tiers(specs, "lazy", 4, 8), _rules(specs)
    for h in held:  # one at a time: the tiers fill, the CPU tier spills into the disk tier
        numbered.hand([h], [_key(h, contents)])
        numbered.flush()
        _store(plain[0], [(h, _key(h, contents))])
    pairs = [(h, _key(h, contents)) for h in batch]
    numbered.hand(batch, [key for _, key in pairs])
    numbered.flush()
    _store(plain[0], pairs)
    for a, b in zip(numbered.tiers, plain, strict=True):
        assert _order(a) == _order(b)
        assert a.stats == b.stats
    _check_numbered(numbered)


def test_a_block_stored_again_while_held_counts_one_use():
    """As a load does (and as the tiers of KV cache groups count it): LFU's count and S3-FIFO's frequency
    go up by one, and the store is not counted again."""
    lfu, s3 = Tier(TierSpec("cpu", 4, policy="lfu")), Tier(TierSpec("cpu", 4, policy="s3fifo"))
    for tier in (lfu, s3):
        tier.put(1, _key(1))
        tier.put(1, _key(1))
        assert tier.stats.stored_blocks == 1
    assert lfu.cache.count[1] == 2
    assert s3.cache.freq[1] == 1

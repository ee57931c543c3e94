"""Eviction policies of the grouped KV tiers (kv_group_tiers.py, group_policy.py): pages handed down in
random order keep every tier within its capacity, an entry in one tier and every page accounted for, and
the victims come in the order of pagelab.eviction's policies."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagelab.eviction import POLICIES, make_policy
from simulator.core.kv_layout import LayerKV, kv_cache_groups
from simulator.core.paged.kv_group_tiers import GroupTiers
from simulator.core.paged.kv_groups import GroupedBlockManager
from simulator.core.paged.tier import STORE_MODES, TierSpec

# A page handed down: (range hash, group, content), or a new swap use of the CPU tier's budget (None, n, 0).
STEPS = st.lists(st.one_of(st.tuples(st.integers(0, 23), st.integers(0, 2), st.integers(0, 1)),
                           st.tuples(st.none(), st.integers(0, 12), st.just(0))), min_size=20, max_size=80)
CAPACITY = st.integers(0, 24)  # up to past 10 pages, where S3-FIFO's small FIFO holds more than one


def _tiers(specs: list[TierSpec], store: str = "lazy"):
    """GroupTiers as a pool's tables would hold them (the tiers read a page's group from its mask bit
    only), and the list whose only item is the blocks swap holds (the CPU tier's budget leaves them out)."""
    bm = GroupedBlockManager(8, kv_cache_groups([LayerKV("full", 2, 4)]))
    swap = [0]
    return GroupTiers(specs, store, bm.tables, 64, 8, swap_used=lambda: swap[0]), swap


def _hand_down(tiers: GroupTiers, h: int, g: int, content: int) -> None:
    """Hand group `g`'s page of range `h` down as the pool does, and store it."""
    tiers.ranges[(h, g)] = h
    tiers.queue.append(((h, g), (g, (None, content, None))))
    tiers.flush()


def _held(tiers: GroupTiers) -> dict[int, tuple]:
    """Range hash -> (tier index, content, group mask) of every entry held."""
    return {h: (i, e[0], e[2]) for i, tier in enumerate(tiers.tiers) for h, e in tier.keys.items()}


@settings(max_examples=300, deadline=None)
@given(policy=st.sampled_from(sorted(POLICIES)), groups=st.integers(1, 3), cpu=CAPACITY,
       disk=st.one_of(st.none(), CAPACITY), store=st.sampled_from(STORE_MODES), steps=STEPS)
def test_tiers_fit_hold_an_entry_once_and_count_every_page(policy, groups, cpu, disk, store, steps):
    specs = [TierSpec("cpu", cpu, policy=policy)] + ([] if disk is None else [TierSpec("disk", disk,
                                                                                       policy=policy)])
    tiers, swap = _tiers(specs, store)
    entered = replaced = 0  # pages new to the tiers; pages newer content replaced
    left = [0] * len(specs)  # per tier: pages gone without an eviction (replaced, or up with their entry)
    for h, g, content in steps:
        if h is None:
            swap[0] = g
            tiers.fit()
        else:
            g %= groups
            held = _held(tiers).get(h)
            entered += held is None or held[1] != content or not held[2] >> g & 1
            if held is not None and (held[1] != content or held[0] > 0):
                left[held[0]] += held[2].bit_count()
                replaced += held[2].bit_count() if held[1] != content else 0
            _hand_down(tiers, h, g, content)
        seen: set[int] = set()
        for tier in tiers.tiers:
            weights = {k: e[2].bit_count() for k, e in tier.keys.items()}
            pages = sum(weights.values())
            assert tier.used == pages <= tier.capacity
            assert not seen & set(tier.keys)
            seen |= set(tier.keys)
            if policy != "lru":
                cache = tier.keys.policy
                assert cache.used == pages and cache.size == weights
            if policy == "s3fifo":
                assert set(cache.small) | set(cache.main) == set(tier.keys)
                assert cache.small_used == sum(cache.size[k] for k in cache.small)
        assert tiers.cpu.capacity == max(0, cpu - swap[0])
        # every page stored is held, evicted or gone otherwise, in each tier; a tier's evictions are the
        # next one's stores; every new page is held, dropped by the last tier or replaced
        for i, tier in enumerate(tiers.tiers):
            assert tier.stats.stored_blocks == tier.used + tier.stats.evicted_blocks + left[i]
            if i:
                assert tier.stats.stored_blocks == tiers.tiers[i - 1].stats.evicted_blocks
        assert entered == sum(t.used for t in tiers.tiers) + tiers.tiers[-1].stats.evicted_blocks + replaced


def _evictions(policy: str, groups: int, cpu: int, steps) -> list[int]:
    """The ranges a CPU tier under `policy` evicts, in order, caught by an LRU disk tier that holds all."""
    tiers, swap = _tiers([TierSpec("cpu", cpu, policy=policy), TierSpec("disk", 10 ** 6)])
    disk = tiers.tiers[1].keys
    out: list[int] = []
    for h, g, _ in steps:
        before = set(disk) - {h}  # a page of a range the disk holds brings the entry up first
        if h is None:
            swap[0] = g
            tiers.fit()
        else:
            _hand_down(tiers, h, g % groups, 0)
        out += [k for k in disk if k not in before]  # the disk appends what arrives, in order
    return out


def _admitted(policy: str, groups: int, cpu: int, steps) -> list[int]:
    """The keys pagelab.eviction's `policy` evicts when each range is admitted at its page count."""
    cache = make_policy(policy, cpu)
    pages: dict[int, set] = {}
    out: list[int] = []
    for h, g, _ in steps:
        if h is None:
            out += cache.resize(max(0, cpu - g))
        else:
            pages.setdefault(h, set()).add(g % groups)  # the disk keeps every page: they come back up
            out += cache.admit(h, len(pages[h]))
    return out


@settings(max_examples=300, deadline=None)
@given(policy=st.sampled_from(sorted(POLICIES)), cpu=CAPACITY, steps=STEPS)
def test_one_group_evicts_in_the_order_of_the_single_size_policy(policy, cpu, steps):
    assert _evictions(policy, 1, cpu, steps) == _admitted(policy, 1, cpu, steps)


# Not S3-FIFO: its `admit` keeps a grown key's small-FIFO share at the size it came in with, where `use`
# follows the growth (the first test checks that share).
@settings(max_examples=200, deadline=None)
@given(policy=st.sampled_from(["lru", "lfu"]), groups=st.integers(2, 3), cpu=CAPACITY,
       steps=STEPS)
def test_lru_and_lfu_evict_entries_in_the_order_of_the_policy_admitting_their_page_counts(policy, groups,
                                                                                           cpu, steps):
    assert _evictions(policy, groups, cpu, steps) == _admitted(policy, groups, cpu, steps)


def test_each_policy_evicts_its_own_victim_and_an_entry_goes_down_at_its_pages():
    # range 1 gains its second page (a use), range 2 does not; range 3's second page needs room: LRU
    # evicts the oldest range, 1 with its two pages, LFU and S3-FIFO range 2, never used again
    evicted = {"lru": ([1], 2), "lfu": ([2], 1), "s3fifo": ([2], 1)}  # (ranges, pages)
    for policy, (ranges, pages) in evicted.items():
        tiers, _ = _tiers([TierSpec("cpu", 4, policy=policy), TierSpec("disk", 8, policy=policy)])
        for h, g in [(1, 0), (1, 1), (2, 0), (3, 0), (3, 1)]:
            _hand_down(tiers, h, g, 0)
        cpu, disk = tiers.tiers
        assert list(disk.keys) == ranges, policy
        assert disk.used == disk.stats.stored_blocks == cpu.stats.evicted_blocks == pages, policy
    for policy in ("lfu", "s3fifo"):  # both pages of range 1 go down: the disk's policy weighs them
        tiers, _ = _tiers([TierSpec("cpu", 3, policy=policy), TierSpec("disk", 8, policy=policy)])
        for h, g in [(1, 0), (1, 1), (2, 0), (2, 1)]:
            _hand_down(tiers, h, g, 0)
        cpu, disk = tiers.tiers
        assert disk.keys.policy.size == {1: 2} and disk.used == 2 and cpu.keys.policy.size == {2: 2}, policy

"""KV tiers behind the GroupedBlockManager (kv_group_tiers.py): pool invariants under random use and each
eviction policy, hits that every group can serve, tokens by source, and a zero-size tier changing
nothing."""
from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from pagelab.eviction import POLICIES
from simulator import AllocStatus, Sequence, SequenceGroup
from simulator.core.kv_layout import LayerKV, kv_cache_groups
from simulator.core.paged.kv_group_tiers import GroupTiers, attach_groups
from simulator.core.paged.kv_groups import GroupedBlockManager
from simulator.core.paged.tier import STORE_MODES, TierSpec
from tests.simulator.core.test_kv_groups_props import GroupedMachine

PREFIXES = ([0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1], [1, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 1])
POLICY = st.sampled_from(sorted(POLICIES))
LAYERS = st.lists(st.one_of(st.none(), st.integers(1, 9)), min_size=1, max_size=3)  # None: full, n: window
FULL_AND_SLIDING = kv_cache_groups([LayerKV("full", 2, 4), LayerKV("sliding_window", 2, 4, 64)])


def _request(bm, tokens: list[int], seq_id: int) -> Sequence:
    """A one-sequence request of `tokens`, allocated."""
    s = Sequence(seq_id, len(tokens), len(tokens) + 4, request_id=seq_id, token_ids=list(tokens))
    bm.allocate(SequenceGroup(seq_id, [s], n=1))
    return s


def test_taking_one_groups_blocks_never_evicts_another_groups_hit():
    bm = GroupedBlockManager(12, FULL_AND_SLIDING, debug=True)
    bm.free(_request(bm, [1, 2, 3, 4, 5], 1))  # its cached blocks: group 0's released first (oldest)
    bm.free(_request(bm, [9, 9, 9, 9, 9], 2))
    _request(bm, [7] * (len(bm.pool.free) // 2 * 2), 3)  # holds the free stack: taking must evict
    assert not bm.pool.free
    b = _request(bm, [1, 2, 3, 4, 6, 6, 6], 4)  # debug: the invariants are checked after allocating
    assert b.num_cached_tokens == 4
    groups = bm.tables.group_of
    assert [{groups[bid] for bid in table} for table in bm.tables.tables[b.seq_id]] == [{0}, {1}]


def _allocate_checked(bm, group: SequenceGroup) -> int:
    """Allocate a one-sequence group; check that its hit covers only blocks every group that needs them
    could be served from the GPU or a tier, ends on a tier block when pages were loaded, and counts as the
    GPU's only as far as the GPU alone reaches; the hit in blocks."""
    t, tiers, seq = bm.tables, bm.tiers, group.seqs[0]
    tiers.flush()
    chain = t.extend(seq, [], (seq.length - 1) // t.block_size)
    served = [[t.cached(g, link) is not None or tiers.entry(link[1], link[0][1], seq.extra_key)[2] >> g & 1
               for g in range(t.num_groups)] for link in chain]  # looked up before allocating
    loaded = sum(tier.stats.hit_blocks for tier in tiers.tiers)
    gpu_hit, gpu_hits = t.longest_hit(seq)[0], bm.stats.prefix_hits
    hit = bm.allocate(group) // t.block_size
    # Once a tier loads a page, the GPU's hit rate counts its own hit only: the blocks past it are the
    # tiers', wherever their pages were.
    from_tiers = sum(tier.stats.hit_blocks for tier in tiers.tiers) > loaded
    assert bm.stats.prefix_hits - gpu_hits == (gpu_hit if from_tiers else hit)
    assert hit <= len(chain)
    for g, table in enumerate(t.tables[seq.seq_id]):
        needed = range(t.first_held(g, hit), hit)
        assert [i for i, b in enumerate(table[:hit]) if b is not None] == list(needed)
        assert all(served[i][g] for i in needed)
    if sum(tier.stats.hit_blocks for tier in tiers.tiers) > loaded:
        assert hit % tiers.per_tier == 0
    return hit


def _check_tiers(bm) -> None:
    """Each tier's pages fit its capacity (the CPU tier's less what swap holds), a range lives in one
    tier, and prompt tokens by source add up to the tokens queried."""
    tiers = bm.tiers
    tiers.flush()
    seen: set[int] = set()
    for tier in tiers.tiers:
        assert tier.used == sum(e[2].bit_count() for e in tier.keys.values()) <= tier.capacity
        assert all(e[2] for e in tier.keys.values()) and not seen & set(tier.keys)
        if tier.spec.policy != "lru":  # the policy weighs each entry at its pages
            assert tier.keys.policy.size == {h: e[2].bit_count() for h, e in tier.keys.items()}
        seen |= set(tier.keys)
    if tiers.cpu is not None:
        assert tiers.cpu.used + bm.num_cpu_blocks - bm.num_free_cpu_blocks <= tiers.cpu.spec.num_blocks
    by = tiers.summary(bm.stats.prefix_query_tokens, bm.stats.prefix_hit_tokens)["tokens_by_source"]
    assert min(by.values()) >= 0 and sum(by.values()) == bm.stats.prefix_query_tokens


def test_random_requests_keep_the_invariants_and_load_only_what_every_group_can_serve():
    loaded = 0
    for seed in range(60):
        r = random.Random(seed)
        bs = r.randint(1, 3)
        layers = [LayerKV("full", bs, 4) if r.random() < 0.5
                  else LayerKV("sliding_window", bs, 4, r.randint(1, 9)) for _ in range(r.randint(1, 3))]
        bm = GroupedBlockManager(r.randint(8, 40), kv_cache_groups(layers), num_cpu_blocks=4, debug=True)
        per_tier = r.choice([1, 2])
        specs = [TierSpec("cpu", r.randint(4, 12), per_tier), TierSpec("disk", r.randint(0, 12), per_tier)]
        attach_groups(bm, GroupTiers(specs, r.choice(STORE_MODES), bm.tables, 64, bytes_per_token=8))
        live: list[Sequence] = []
        for step in range(50):
            if live and r.random() < 0.4:
                bm.free(live.pop(r.randrange(len(live))))
                continue
            prompt = r.choice(PREFIXES)[:r.randint(0, 12)] + [r.randint(0, 1) for _ in range(r.randint(1, 3))]
            seq = Sequence(step, len(prompt), len(prompt) + 2, request_id=step, token_ids=prompt)
            group = SequenceGroup(step, [seq], n=1)
            if bm.can_allocate(group) is AllocStatus.OK:  # debug: every mutation checks the invariants
                _allocate_checked(bm, group)
                live.append(seq)
            _check_tiers(bm)
        loaded += sum(tier.stats.hit_blocks for tier in bm.tiers.tiers)
    assert loaded > 0, loaded  # the tiers did serve pages


class TieredMachine(GroupedMachine):
    """GroupedMachine (random allocate / append / fork / free / swap, every group's content read back,
    invariants checked after each mutation) with CPU and disk tiers under an eviction policy behind the
    pool."""

    @initialize(num_blocks=st.integers(8, 40), block_size=st.integers(1, 3), layers=LAYERS,
                num_cpu=st.integers(0, 12), disk=st.integers(0, 12), store=st.sampled_from(STORE_MODES),
                per_tier=st.sampled_from([1, 2]), collide=st.booleans(), policy=POLICY)
    def setup(self, num_blocks, block_size, layers, num_cpu, disk, store, per_tier, collide, policy):
        specs = [LayerKV("full", block_size, 4) if w is None else LayerKV("sliding_window", block_size, 4, w)
                 for w in layers]
        self.bm = GroupedBlockManager(num_blocks, kv_cache_groups(specs), num_cpu_blocks=num_cpu, debug=True,
                                      hash_fn=(lambda x: hash(x) % 3) if collide else hash)
        tiers = [TierSpec("cpu", num_cpu, per_tier, policy)] + ([TierSpec("disk", disk, per_tier, policy)]
                                                                if disk else [])
        attach_groups(self.bm, GroupTiers(tiers, store, self.bm.tables, page_bytes=64, bytes_per_token=8))
        self.bs, self.gpu, self.cpu = block_size, {}, {}
        self.running, self.swapped, self.next_id = [], [], 0

    @rule(base=st.sampled_from(PREFIXES), cut=st.integers(0, 12),
          tail=st.lists(st.integers(0, 1), min_size=1, max_size=3), extra=st.integers(0, 12))
    def new_request(self, base, cut, tail, extra):
        prompt = base[:cut] + tail  # prompts that share prefixes, so the tiers have hits to give
        rid = self._ids()
        seq = Sequence(self._ids(), len(prompt), len(prompt) + extra + 2, request_id=rid,
                       token_ids=list(prompt))
        group = SequenceGroup(rid, [seq], n=1)
        if self.bm.can_allocate(group) is not AllocStatus.OK:
            return
        hit = _allocate_checked(self.bm, group)
        for table in self.bm.tables.tables[seq.seq_id]:  # a loaded page holds the prompt's tokens
            for i in range(hit):
                if table[i] is not None:
                    self.gpu[table[i]] = prompt[i * self.bs:(i + 1) * self.bs]
        self._write(seq, hit * self.bs)
        self.running.append(group)

    @invariant()
    def tiers_hold_their_pages_within_capacity(self):
        if hasattr(self, "bm"):
            _check_tiers(self.bm)


TestTieredMachine = TieredMachine.TestCase
TestTieredMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])

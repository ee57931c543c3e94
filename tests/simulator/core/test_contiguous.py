"""Contiguous allocators: reservation policies, buddy and first-fit placement, taxonomy."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from simulator import AllocationError, AllocStatus, ConfigError, ContiguousAllocator, Sequence, SequenceGroup
from simulator.core.contiguous.placement import BuddyPlacement, FirstFitPlacement, next_pow2


def test_orca_max_holds_seven_requests_and_leaves_8_85_percent(make_group):
    ca = ContiguousAllocator(15728, "max", max_model_len=2048, debug=True)  # OPT-13B, 12 GiB of KV
    groups = [make_group(100, 400) for _ in range(8)]
    for g in groups[:7]:
        assert ca.can_allocate(g) is AllocStatus.OK
        ca.allocate(g)
    assert ca.can_allocate(groups[7]) is AllocStatus.LATER
    b = ca.breakdown()
    assert b.external_fragmentation == 15728 - 7 * 2048
    assert b.external_fragmentation / b.capacity == pytest.approx(0.0885, abs=5e-4)
    assert b.internal_fragmentation == 7 * (2048 - 400)
    assert b.reservation == 7 * 300 and b.token_states == 700 and b.free == 0


@pytest.mark.parametrize("placement", ["buddy", "first-fit"])
def test_reservation_policies(contiguous, make_group, placement):
    for policy, want in (("max", 256), ("pow2", 30 + 128), ("oracle", 100)):
        ca = contiguous(1024, policy, placement, max_model_len=256)
        g = make_group(30, 100)
        ca.allocate(g)
        assert g.seqs[0].region[1] == want
        b = ca.breakdown()
        assert b.token_states == 30 and b.reservation == 70
        assert b.internal_fragmentation == want - 100


def test_pow2_is_capped_at_max_model_len(contiguous, make_group):
    # 1,100 + next_pow2(600) = 2,124 > 2,048: uncapped, buddy would need a 4,096-slot block.
    ca = contiguous(8192, "pow2", "buddy", max_model_len=2048)
    g = make_group(1100, 1700)
    ca.allocate(g)
    assert g.seqs[0].region[1] == 2048
    assert ca.breakdown().allocated == 2048
    assert ca.breakdown().internal_fragmentation == 2048 - 1700
    # The largest admissible request (final length max_model_len) still fits its capped region.
    assert ca.can_allocate(make_group(1, 2048)) is AllocStatus.OK
    assert ca.can_allocate(make_group(1, 2049)) is AllocStatus.NEVER


@settings(max_examples=300, deadline=None)
@given(max_model_len=st.integers(1, 4096), data=st.data())
def test_no_reservation_exceeds_max_model_len(max_model_len, data):
    prompt = data.draw(st.integers(1, max_model_len))
    final = data.draw(st.integers(prompt, max_model_len))
    seq = Sequence(1, prompt, final)
    for policy in ("max", "pow2", "oracle"):
        for placement in ("buddy", "first-fit"):
            ca = ContiguousAllocator(next_pow2(max_model_len), policy, placement, max_model_len=max_model_len)
            r = ca.reservation(seq)
            assert final <= r <= max_model_len  # never outgrown, never past the model's length
            # One buddy block of max_model_len rounded up: any admissible request fits the empty pool.
            assert ca.can_allocate(SequenceGroup(1, [Sequence(2, prompt, final)])) is not AllocStatus.NEVER


def test_buddy_rounding_of_oracle_counts_as_external_not_internal(contiguous, make_group):
    ca = contiguous(1024, "oracle", "buddy")
    ca.allocate(make_group(30, 100))
    b = ca.breakdown()
    assert b.internal_fragmentation == 0
    assert b.external_fragmentation == 28  # the 128-slot buddy block minus the 100 reserved
    assert b.allocated == 128


def test_external_fragmentation_depends_on_head_of_queue(contiguous, make_group):
    ca = contiguous(64, "oracle", "first-fit")
    a, b, c = make_group(10, 20), make_group(10, 20), make_group(10, 20)
    for g in (a, b, c):
        ca.allocate(g)
    ca.free(b.seqs[0])  # a 20-slot hole between a and c, plus 4 free slots at the end
    small, big = make_group(5, 10), make_group(5, 30)
    assert ca.breakdown(head=small).external_fragmentation == 4  # 24 free, 20 usable by 10-slot regions
    assert ca.breakdown(head=big).external_fragmentation == 24  # neither hole holds 30
    assert ca.breakdown(head=None).external_fragmentation == 0  # empty queue: free is free
    assert ca.can_allocate(big) is AllocStatus.LATER


def test_never_when_a_sequence_cannot_fit_an_empty_pool(contiguous, make_group):
    ca = contiguous(100, "oracle", "first-fit")
    assert ca.can_allocate(make_group(50, 101)) is AllocStatus.NEVER
    assert ca.can_allocate(make_group(50, 60, n=2)) is AllocStatus.NEVER
    buddy = contiguous(100, "oracle", "buddy")  # roots 64 + 32 + 4
    assert buddy.can_allocate(make_group(50, 65)) is AllocStatus.NEVER
    assert buddy.can_allocate(make_group(50, 64)) is AllocStatus.OK
    mx = contiguous(4096, "max", max_model_len=2048)
    assert mx.can_allocate(make_group(2000, 3000)) is AllocStatus.NEVER


def test_parallel_samples_each_get_a_region(contiguous, make_group):
    ca = contiguous(1024, "oracle", "first-fit")
    g = make_group(10, 50, n=3)
    ca.allocate(g)
    assert len({s.region[0] for s in g.seqs}) == 3
    assert ca.breakdown().token_states == 30


def test_fork_copies_the_region(contiguous, make_group):
    ca = contiguous(1024, "oracle", "first-fit")
    g = make_group(10, 50)
    ca.allocate(g)
    parent = g.seqs[0]
    child = parent.fork(77)
    assert ca.can_fork(parent)
    copies = ca.fork(parent, child)
    assert copies == [(parent.region[0], child.region[0], 10)]


def test_swap_round_trip(contiguous, make_group):
    ca = contiguous(256, "pow2", "buddy", cpu_capacity_tokens=256)
    g = make_group(40, 60)
    ca.allocate(g)
    ca.append_slot(g.seqs[0], 5)
    assert ca.can_swap_out(g)
    out = ca.swap_out(g)
    assert out[0][2] == 45 and ca.breakdown().allocated == 0
    back = ca.swap_in(g)
    assert back[0][2] == 45 and g.seqs[0].num_tokens == 45
    assert ca.breakdown().allocated == 128  # 40 + 32 -> 128


def test_bad_input(contiguous, make_group):
    ca = contiguous(256, "oracle")
    g = make_group(10, 12)
    ca.allocate(g)
    with pytest.raises(AllocationError, match="outgrow"):
        ca.append_slot(g.seqs[0], 3)
    with pytest.raises(AllocationError, match="negative"):
        ca.append_slot(g.seqs[0], -1)
    ca.free(g.seqs[0])
    with pytest.raises(AllocationError, match="freed twice"):
        ca.free(g.seqs[0])
    with pytest.raises(ConfigError, match="policy"):
        ContiguousAllocator(10, "best")
    with pytest.raises(ConfigError, match="placement"):
        ContiguousAllocator(10, "max", "worst-fit")
    with pytest.raises(ConfigError, match="final length"):
        contiguous(256, "pow2").can_allocate(SequenceGroup(1, [Sequence(1, 5)]))


def test_buddy_merges_back_to_roots():
    p = BuddyPlacement(100)
    starts = [p.alloc(8) for _ in range(12)]  # 96 slots of the 64 + 32 roots
    assert len(set(starts)) == 12 and p.total_free == 4
    for s in starts:
        p.free(s)
    assert sorted(p.free_spans()) == [(0, 64), (64, 32), (96, 4)]
    assert next_pow2(1) == 1 and next_pow2(5) == 8 and next_pow2(64) == 64


def test_first_fit_coalesces():
    p = FirstFitPlacement(30)
    a, b, c = p.alloc(10), p.alloc(10), p.alloc(10)
    p.free(a)
    p.free(c)
    assert p.free_spans() == [(0, 10), (20, 10)]
    p.free(b)
    assert p.free_spans() == [(0, 30)]


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 120), ops=st.lists(st.integers(1, 40), max_size=12),
       frees=st.lists(st.booleans(), max_size=12), sizes=st.lists(st.integers(1, 40), max_size=5))
def test_first_fit_can_fit_all_is_what_allocating_in_order_does(capacity, ops, frees, sizes):
    import copy

    p = FirstFitPlacement(capacity)
    starts = [p.alloc(n) for n in ops if p.can_fit(n)]
    for start, drop in zip(starts, frees, strict=False):
        if drop:
            p.free(start)
    holes = p.free_spans()
    trial = copy.deepcopy(p)
    try:
        for n in sizes:
            trial.alloc(n)
        placed = True
    except AllocationError:
        placed = False
    assert p.can_fit_all(sizes) is placed
    assert p.free_spans() == holes  # a query


def test_swap_out_places_the_sequences_as_can_swap_out_checked(make_group):
    """The CPU pool's holes hold 23 + 22 tokens only with the larger placed first (placing the group's
    first sequence first would leave no hole for the second)."""
    ca = ContiguousAllocator(46, "pow2", "first-fit", max_model_len=64, cpu_capacity_tokens=90, debug=True)
    a = SequenceGroup(1, [Sequence(2, 28, 38, request_id=1)])
    b = SequenceGroup(3, [Sequence(4, 2, 2, request_id=3)])
    ca.allocate(a)
    ca.swap_out(a)  # CPU [0, 28)
    ca.allocate(b)
    ca.swap_out(b)  # CPU [28, 30)
    ca.swap_in(a)
    ca.append_slot(a.seqs[0], 10)
    ca.swap_out(a)  # 38 tokens: CPU [30, 68); holes [0, 28) and [68, 90)
    c = SequenceGroup(5, [Sequence(6, 22, 23, request_id=5), Sequence(7, 22, 23, request_id=5)])
    ca.allocate(c)
    ca.append_slot(c.seqs[1], 1)  # 22 and 23 tokens
    assert ca.can_swap_out(c)
    copies = ca.swap_out(c)
    assert [n for _, _, n in copies] == [22, 23]  # the group's order
    assert sorted(cpu for _, cpu, _ in copies) == [0, 68]


class ContiguousMachine(RuleBasedStateMachine):
    """Random admit / grow / fork / finish / swap on both placements; invariants checked every step."""

    @initialize(capacity=st.integers(1, 300), policy=st.sampled_from(["max", "pow2", "oracle"]),
                placement=st.sampled_from(["buddy", "first-fit"]), cpu=st.integers(0, 300))
    def setup(self, capacity, policy, placement, cpu):
        self.ca = ContiguousAllocator(capacity, policy, placement, max_model_len=64,
                                      cpu_capacity_tokens=cpu, debug=True)
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.ids = iter(range(1, 10**9))

    @rule(prompt=st.integers(1, 40), out=st.integers(0, 30), n=st.integers(1, 2),
          head_prompt=st.integers(1, 60))
    def admit(self, prompt, out, n, head_prompt):
        rid = next(self.ids)
        g = SequenceGroup(rid, [Sequence(next(self.ids), prompt, prompt + out, request_id=rid)
                                for _ in range(n)])
        status = self.ca.can_allocate(g)
        head = SequenceGroup(0, [Sequence(0, head_prompt, head_prompt + 1)])
        b = self.ca.breakdown(head)
        assert sum(b.fractions().values()) == pytest.approx(1.0)
        if status is AllocStatus.OK:
            self.ca.allocate(g)
            self.running.append(g)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), k=st.integers(0, 10))
    def grow(self, data, k):
        s = data.draw(st.sampled_from([s for g in self.running for s in g.seqs]))
        if self.ca.can_append([s], k):
            self.ca.append_slot(s, k)
        else:
            with pytest.raises(AllocationError):
                self.ca.append_slot(s, k)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data):
        g = data.draw(st.sampled_from(self.running))
        parent = g.seqs[0]
        if self.ca.can_fork(parent):
            child = parent.fork(next(self.ids))
            self.ca.fork(parent, child)
            g.seqs.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        g = data.draw(st.sampled_from(self.running))
        for s in g.seqs:
            self.ca.free(s)
        self.running.remove(g)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data):
        g = data.draw(st.sampled_from(self.running))
        if self.ca.can_swap_out(g):
            self.ca.swap_out(g)
            self.running.remove(g)
            self.swapped.append(g)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        g = data.draw(st.sampled_from(self.swapped))
        if self.ca.can_swap_in(g) is AllocStatus.OK:
            self.ca.swap_in(g)
            self.swapped.remove(g)
            self.running.append(g)

    @invariant()
    def regions_within_max_model_len(self):
        for g in getattr(self, "running", []):
            for s in g.seqs:
                assert s.final_len <= s.region[1] <= self.ca.max_model_len

    @invariant()
    def sums(self):
        if hasattr(self, "ca"):
            assert sum(self.ca.breakdown().fractions().values()) == pytest.approx(1.0)

    def teardown(self):
        for g in self.running + self.swapped:
            for s in g.seqs:
                self.ca.free(s)
        assert self.ca.breakdown().allocated == 0
        assert self.ca._placement.total_free == self.ca.capacity_tokens


TestContiguousMachine = ContiguousMachine.TestCase
TestContiguousMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)

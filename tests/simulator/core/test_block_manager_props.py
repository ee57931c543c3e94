"""Property-based tests: random interleavings of allocate / append / fork / free / swap / prefix hits.

A shadow model writes each token id into the slot the allocator handed out (applying the copy-on-write
and swap copies it returns), then reads every live sequence back through its block table. A shared block
written in place, an aliased prefix or a lost copy shows up as a sequence reading the wrong tokens.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from simulator import AllocationError, AllocStatus, BlockManager, Sequence, SequenceGroup


class PagedMachine(RuleBasedStateMachine):
    """Drives a debug BlockManager (invariants re-checked after every mutation) and a content model."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.integers(1, 6),
                num_cpu=st.integers(0, 24), watermark=st.sampled_from([0.0, 0.1]),
                caching=st.booleans(), collide=st.booleans())
    def setup(self, num_blocks, block_size, num_cpu, watermark, caching, collide):
        self.bm = BlockManager(num_blocks, block_size, num_cpu_blocks=num_cpu, watermark=watermark,
                               enable_prefix_caching=caching, debug=True,
                               hash_fn=(lambda x: hash(x) % 3) if collide else hash)
        self.bs = block_size
        self.gpu: dict[int, list] = {}  # block id -> token ids in its slots
        self.cpu: dict[int, list] = {}
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.next_id = 0

    def _ids(self):
        self.next_id += 1
        return self.next_id

    def _write(self, seq: Sequence, start: int) -> None:
        for pos in range(start, seq.num_tokens):
            block = self.gpu.setdefault(seq.block_table[pos // self.bs], [None] * self.bs)
            block[pos % self.bs] = seq.token_ids[pos]

    def _apply(self, copies, src, dst):
        for s, d in copies:
            dst[d] = list(src[s])

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14), n=st.integers(1, 3),
          extra=st.integers(0, 6))
    def new_request(self, prompt, n, extra):
        rid = self._ids()
        seqs = [Sequence(self._ids(), len(prompt), len(prompt) + extra + 20, request_id=rid,
                         token_ids=list(prompt)) for _ in range(n)]
        group = SequenceGroup(rid, seqs, n=n)
        status = self.bm.can_allocate(group)
        # The scheduler asks only this when the batch is full: it must agree with can_allocate.
        assert self.bm.can_ever_allocate(group) is (status is not AllocStatus.NEVER)
        needed = -(-len(prompt) // self.bs)
        if needed > self.bm.num_blocks - self.bm.watermark_blocks:
            assert status is AllocStatus.NEVER
        if status is not AllocStatus.OK:
            return
        hit = self.bm.allocate(group)
        assert hit % self.bs == 0 and hit <= len(prompt) - 1
        table = seqs[0].block_table
        for i in range(hit // self.bs):  # hits must already hold exactly these tokens
            assert self.gpu[table[i]] == prompt[i * self.bs:(i + 1) * self.bs]
        self._write(seqs[0], hit)
        self.running.append(group)

    def _live(self):
        return [(g, s) for g in self.running for s in g.seqs if not s.is_finished]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), k=st.integers(1, 7), token=st.integers(0, 2))
    def append(self, data, k, token):
        group, seq = data.draw(st.sampled_from(self._live()))
        before = self.bm.breakdown()
        if not self.bm.can_append([seq], k):
            assert self.bm.breakdown() == before  # a query changes nothing
            return
        start = seq.num_tokens
        seq.token_ids.extend([token] * k)
        copies = self.bm.append_slot(seq, k) if k > 1 else self.bm.append_slot(seq)
        self._apply(copies, self.gpu, self.gpu)
        self._write(seq, start)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data):
        group, seq = data.draw(st.sampled_from(self._live()))
        child = seq.fork(self._ids())
        assert self.bm.fork(seq, child) == []
        group.seqs.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish_one(self, data):
        group, seq = data.draw(st.sampled_from(self._live()))
        self.bm.free(seq)
        seq.status = seq.status.FINISHED
        if group.is_finished:
            self.running.remove(group)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data):
        group = data.draw(st.sampled_from(self.running))
        if not self.bm.can_swap_out(group):
            return
        self._apply(self.bm.swap_out(group), self.gpu, self.cpu)
        self.running.remove(group)
        self.swapped.append(group)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        group = data.draw(st.sampled_from(self.swapped))
        status = self.bm.can_swap_in(group)
        if status is not AllocStatus.OK:
            return
        copies = self.bm.swap_in(group)
        # Only blocks not still cached on the device are copied; the re-shared ones hold the same tokens.
        self._apply(copies, self.cpu, self.gpu)
        self.swapped.remove(group)
        self.running.append(group)
        # OK promises the slot of each sequence's next token too, as the scheduler takes it at once.
        for s in group.seqs:
            if not s.is_finished and s.num_tokens < s.final_len:
                assert self.bm.can_append([s], 1)
                start = s.num_tokens
                s.token_ids.append(0)
                self._apply(self.bm.append_slot(s), self.gpu, self.gpu)
                self._write(s, start)

    @rule()
    def reset_prefix_cache(self):
        if self.bm.num_used_blocks:
            with pytest.raises(AllocationError, match="still in use"):
                self.bm.prefix_cache.reset()
            return
        cached = self.bm.num_cached_free_blocks
        assert self.bm.prefix_cache.reset() == cached
        assert self.bm.num_cached_free_blocks == 0 and self.bm.num_free_blocks == self.bm.num_blocks

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for group in self.running:
            for s in group.seqs:
                if s.is_finished:
                    continue
                got = [self.gpu[s.block_table[p // self.bs]][p % self.bs] for p in range(s.num_tokens)]
                assert got == s.token_ids, f"sequence {s.seq_id} reads {got}, wrote {s.token_ids}"
        for group in self.swapped:
            for s in group.seqs:
                if not s.is_finished:
                    got = [self.cpu[s.cpu_block_table[p // self.bs]][p % self.bs]
                           for p in range(s.num_tokens)]
                    assert got == s.token_ids

    @invariant()
    def taxonomy_sums_to_one(self):
        b = self.bm.breakdown()
        assert abs(sum(b.fractions().values()) - 1.0) < 1e-12
        assert min(b.token_states, b.reservation, b.internal_fragmentation, b.free) >= 0
        assert self.bm.num_free_blocks + self.bm.num_used_blocks == self.bm.num_blocks

    def teardown(self):
        for group in self.running + self.swapped:
            for s in group.seqs:
                if not s.is_finished:
                    self.bm.free(s)
        assert self.bm.num_used_blocks == 0, "blocks leaked after every sequence was freed"
        assert self.bm.num_free_cpu_blocks == self.bm.num_cpu_blocks
        assert self.bm.breakdown().token_states == 0


TestPagedMachine = PagedMachine.TestCase
TestPagedMachine.settings = settings(max_examples=250, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


class SimulatedMachine(RuleBasedStateMachine):
    """Simulation-style sequences (counts plus prefix keys) through the bulk path."""

    @initialize(num_blocks=st.integers(1, 30), block_size=st.integers(1, 8))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size, debug=True)
        self.seqs: list[Sequence] = []
        self.next_id = 0

    @rule(prompt=st.integers(1, 40), out=st.integers(1, 40), keys=st.lists(st.integers(0, 3), max_size=5))
    def admit(self, prompt, out, keys):
        self.next_id += 1
        seq = Sequence(self.next_id, prompt, prompt + out, prefix_keys=tuple(keys))
        g = SequenceGroup(self.next_id, [seq])
        if self.bm.can_allocate(g) is AllocStatus.OK:
            self.bm.allocate(g)
            self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), k=st.integers(0, 50))
    def advance(self, data, k):
        seq = data.draw(st.sampled_from(self.seqs))
        k = min(k, seq.final_len - seq.num_tokens)
        if self.bm.can_append([seq], k):
            self.bm.append_slot(seq, k)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        self.bm.free(seq)
        self.seqs.remove(seq)

    @invariant()
    def internal_fragmentation_is_exact(self):
        if not hasattr(self, "bm"):
            return
        bs = self.bm.block_size
        want = sum(len(s.block_table) * bs - s.final_len for s in self.seqs
                   if len(s.block_table) * bs >= s.final_len)
        assert self.bm.breakdown().internal_fragmentation == want

    def teardown(self):
        for s in self.seqs:
            self.bm.free(s)
        assert self.bm.num_used_blocks == 0


TestSimulatedMachine = SimulatedMachine.TestCase
TestSimulatedMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)

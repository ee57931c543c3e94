"""Property-based tests of the GroupedBlockManager: random interleavings of allocate / append / fork / free
/ swap over random layouts of full and sliding-window groups sharing one pool.

A shadow model writes each token id into the slot of every group's block the allocator handed out
(applying its copy-on-write and swap copies), then reads every live sequence back through each group's
table: a block written in place while shared, a prefix hit on the wrong content, a lost copy or a window
freeing a block it still needs shows up as a sequence reading the wrong tokens. The manager runs with
debug=True, so its invariants (one pool partitioned, ref counts, per-group counters, the taxonomy) are
recomputed after every mutation.
"""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from simulator import AllocStatus, Sequence, SequenceGroup
from simulator.core.kv_layout import LayerKV, kv_cache_groups
from simulator.core.paged.kv_groups import GroupedBlockManager

KINDS = st.lists(st.one_of(st.none(), st.integers(1, 9)), min_size=1, max_size=5)  # None: full, n: window


class GroupedMachine(RuleBasedStateMachine):
    """Drives a debug GroupedBlockManager and a content model of every group's blocks."""

    manager = GroupedBlockManager  # the class under test

    @initialize(num_blocks=st.integers(1, 40), block_size=st.integers(1, 4), layers=KINDS,
                num_cpu=st.integers(0, 40), caching=st.booleans(), collide=st.booleans())
    def setup(self, num_blocks, block_size, layers, num_cpu, caching, collide):
        specs = [LayerKV("full", block_size, 4) if w is None else LayerKV("sliding_window", block_size, 4, w)
                 for w in layers]
        self.bm = self.manager(num_blocks, kv_cache_groups(specs), num_cpu_blocks=num_cpu,
                               enable_prefix_caching=caching, debug=True,
                               hash_fn=(lambda x: hash(x) % 3) if collide else hash)
        self.bs = block_size
        self.gpu: dict[int, list] = {}
        self.cpu: dict[int, list] = {}
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.next_id = 0

    def _ids(self):
        self.next_id += 1
        return self.next_id

    def _write(self, seq: Sequence, start: int) -> None:
        for table in self.bm.tables.tables[seq.seq_id]:
            for pos in range(start, seq.num_tokens):
                bid = table[pos // self.bs]
                if bid is not None:
                    self.gpu.setdefault(bid, [None] * self.bs)[pos % self.bs] = seq.token_ids[pos]

    @staticmethod
    def _apply(copies, src, dst):
        for s, d in copies:
            dst[d] = list(src[s])

    def _live(self):
        return [(g, s) for g in self.running for s in g.seqs if not s.is_finished]

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=16), n=st.integers(1, 2),
          extra=st.integers(0, 12))
    def new_request(self, prompt, n, extra):
        rid = self._ids()
        seqs = [Sequence(self._ids(), len(prompt), len(prompt) + extra + 20, request_id=rid,
                         token_ids=list(prompt)) for _ in range(n)]
        group = SequenceGroup(rid, seqs, n=n)
        status = self.bm.can_allocate(group)
        assert self.bm.can_ever_allocate(group) is (status is not AllocStatus.NEVER)
        if status is not AllocStatus.OK:
            return
        free0 = self.bm.num_free_blocks
        hit = self.bm.allocate(group)
        assert hit % self.bs == 0 and hit <= len(prompt) - 1
        # Hits hold exactly the prompt's tokens in every group that keeps them.
        for table in self.bm.tables.tables[seqs[0].seq_id]:
            for i in range(hit // self.bs):
                if table[i] is not None:
                    assert self.gpu[table[i]] == prompt[i * self.bs:(i + 1) * self.bs]
        assert self.bm.num_free_blocks <= free0
        self._write(seqs[0], hit)
        self.running.append(group)

    @precondition(lambda self: self._live())
    @rule(data=st.data(), k=st.integers(1, 5), token=st.integers(0, 1))
    def append(self, data, k, token):
        group, seq = data.draw(st.sampled_from(self._live()))
        k = min(k, seq.final_len - seq.num_tokens)
        before = self.bm.breakdown()
        if k == 0 or not self.bm.can_append([seq], k):
            assert self.bm.breakdown() == before  # a query changes nothing
            return
        start = seq.num_tokens
        seq.token_ids.extend([token] * k)
        self._apply(self.bm.append_slot(seq, k), self.gpu, self.gpu)
        self._write(seq, start)
        # Windows keep every block a token still attends to, and nothing wholly behind them.
        t = self.bm.tables
        for g, table in enumerate(t.tables[seq.seq_id]):
            kept = [i for i, b in enumerate(table) if b is not None]
            assert kept == list(range(t.skipped(g, start), len(table)))

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def fork(self, data):
        group, seq = data.draw(st.sampled_from(self._live()))
        child = seq.fork(self._ids())
        assert self.bm.fork(seq, child) == []
        group.seqs.append(child)

    @precondition(lambda self: self._live())
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
        if self.bm.can_swap_in(group) is not AllocStatus.OK:
            return
        self._apply(self.bm.swap_in(group), self.cpu, self.gpu)
        self.swapped.remove(group)
        self.running.append(group)
        for s in group.seqs:  # OK promises every sequence its next slot, all of them together
            if not s.is_finished and s.num_tokens < s.final_len:
                assert self.bm.can_append([s], 1)
                s.token_ids.append(0)
                self._apply(self.bm.append_slot(s, 1), self.gpu, self.gpu)
                self._write(s, s.num_tokens - 1)

    @invariant()
    def every_group_reads_its_own_tokens(self):
        if not hasattr(self, "bm"):
            return
        for group in self.running:
            for s in group.seqs:
                if s.is_finished:
                    continue
                for table in self.bm.tables.tables[s.seq_id]:
                    for p in range(s.num_tokens):
                        bid = table[p // self.bs]
                        if bid is not None:
                            assert self.gpu[bid][p % self.bs] == s.token_ids[p], (s.seq_id, p)
        for group in self.swapped:
            for s in group.seqs:
                if s.is_finished:
                    continue
                for row in self.bm.swap.cpu_tables[s.seq_id]:
                    for p in range(s.num_tokens):
                        cid = row[p // self.bs]
                        if cid is not None:
                            assert self.cpu[cid][p % self.bs] == s.token_ids[p]

    @invariant()
    def the_pool_is_conserved(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        assert sum(bm.tables.held_in) == bm.num_used_blocks
        b = bm.breakdown()
        assert abs(sum(b.fractions().values()) - 1.0) < 1e-12

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for group in self.running + self.swapped:
            for s in group.seqs:
                if not s.is_finished:
                    self.bm.free(s)
        assert self.bm.num_used_blocks == 0, "blocks leaked after every sequence was freed"
        assert self.bm.num_free_cpu_blocks == self.bm.num_cpu_blocks
        assert self.bm.breakdown().token_states == 0 and not self.bm.tables.chains


TestGroupedMachine = GroupedMachine.TestCase
TestGroupedMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])

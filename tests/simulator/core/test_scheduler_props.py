"""Property test: the Scheduler over a small debug BlockManager with chunked prefill, preemption (recompute
or swap) and prefix hits. Rule: no sequence's cached prefix covers slots whose K/V is not computed; every
block published to the prefix cache (keyed) lies inside the computed part of each sequence holding it."""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from simulator import BlockManager, Sequence, SequenceGroup
from simulator.core.scheduler import Scheduler, SchedulerConfig
from simulator.core.sequence import SequenceStatus


class ChunkedPrefillMachine(RuleBasedStateMachine):
    """Requests with few distinct token values (so prefixes repeat) through schedule/commit steps."""

    @initialize(num_blocks=st.integers(4, 16), block_size=st.integers(1, 4), budget=st.integers(2, 8),
                mode=st.sampled_from(["recompute", "swap"]))
    def setup(self, num_blocks, block_size, budget, mode):
        self.bm = BlockManager(num_blocks, block_size, num_cpu_blocks=16, debug=True)
        self.sch = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=budget, max_model_len=32,
                                             enable_chunked_prefill=True, preemption_mode=mode), self.bm)
        self.bs = block_size
        self.max_new: dict[int, int] = {}
        self.next_id = 0

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=14), max_new=st.integers(1, 5))
    def add_request(self, prompt, max_new):
        self.next_id += 1
        seq = Sequence(self.next_id, len(prompt), len(prompt) + max_new - 1, token_ids=list(prompt))
        self.max_new[self.next_id] = max_new
        self.sch.add_request(SequenceGroup(self.next_id, [seq]))

    @rule(token=st.integers(0, 1))
    def step(self, token):
        out = self.sch.schedule()
        for g in out.admitted:  # a hit is a computed block, so never the prompt's last token
            assert g.seqs[0].num_cached_tokens <= g.seqs[0].length - 1
        self.sch.commit(out)
        for sg in out.scheduled:
            if sg.is_prefill and not sg.completes_prefill:
                continue
            for s in sg.group.live_seqs():
                s.append_token(token)
                if s.num_generated >= self.max_new[s.request_id]:
                    self.sch.finish_seq(s)
        self.sch.remove_finished()

    @invariant()
    def cached_blocks_are_computed(self):
        if not hasattr(self, "sch"):
            return
        for g in self.sch.running:
            left = self.sch.prefill_left.get(g.request_id, 0)
            for s in g.seqs:
                if s.status is not SequenceStatus.RUNNING:
                    continue
                computed = s.length - left if left else s.num_tokens
                for i, bid in enumerate(s.block_table):
                    if self.bm.pool.key[bid] is not None:
                        assert (i + 1) * self.bs <= computed, (
                            f"sequence {s.seq_id}: block {i} is cached but only {computed} tokens computed")

    def teardown(self):
        if not hasattr(self, "sch"):
            return
        for g in list(self.sch.running) + list(self.sch.swapped):
            for s in g.live_seqs():
                self.sch.finish_seq(s)
        assert self.bm.num_used_blocks == 0 and self.bm.num_free_cpu_blocks == 16


TestChunkedPrefillMachine = ChunkedPrefillMachine.TestCase
TestChunkedPrefillMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])

"""Chunked prefill on the grouped pool: a one-sequence prompt gets each chunk's blocks as the chunk is
scheduled, and its windows hand back what they passed in between, so a sliding group holds at most its
window and one chunk (vLLM v1's `allocate_slots`)."""
from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from simulator import AllocStatus, Sequence, SequenceGroup
from simulator.config import SimConfig
from simulator.core.kv_layout import LayerKV, kv_cache_groups
from simulator.core.paged.kv_groups import GroupedBlockManager
from simulator.core.scheduler import Scheduler, SchedulerConfig
from simulator.core.sequence import SequenceStatus
from simulator.loop import simulate
from tests.simulator.core.test_scheduler_props import ChunkedPrefillMachine
from traces import SyntheticConfig, generate_trace

# One sliding-window layer (window 4) and one full layer, blocks of 2 tokens.
LAYOUT = kv_cache_groups([LayerKV("sliding_window", 2, 8, 4), LayerKV("full", 2, 8)])


def _held(bm: GroupedBlockManager, sid: int) -> list[int]:
    return [sum(b is not None for b in table) for table in bm.tables.tables[sid]]


def test_each_chunk_takes_its_own_blocks_after_the_window_frees_what_it_passed():
    bm = GroupedBlockManager(40, LAYOUT, debug=True, prefill_chunk=4)
    seq = Sequence(1, 14, 16, token_ids=list(range(14)))
    group = SequenceGroup(1, [seq])
    assert bm.allocate(group, 4) == 0
    # The first chunk's 4 tokens: 2 blocks in each group, not the prompt's 7.
    assert seq.num_tokens == 4 and _held(bm, 1) == [2, 2] and bm.num_used_blocks == 4
    bm.append_slot(seq, 4)  # 4 computed: the window (tokens 1..4) still needs block 0
    assert _held(bm, 1) == [4, 4]
    bm.append_slot(seq, 4)  # 8 computed: tokens 0..4 skipped, blocks 0-1 of the window go back first
    assert bm.tables.tables[1][0][:2] == [None, None] and _held(bm, 1) == [4, 6]
    bm.append_slot(seq, 2)  # 12 computed: tokens 0..8 skipped; the last chunk's one block
    assert bm.tables.tables[1][0][:4] == [None] * 4 and _held(bm, 1) == [3, 7]
    assert seq.num_tokens == 14 and bm.num_used_blocks == 10


def test_a_prompt_too_long_to_hold_at_once_fits_when_allocated_by_chunk():
    seq = Sequence(1, 14, 16, token_ids=list(range(14)))
    group = SequenceGroup(1, [seq])
    # Whole, the prompt takes 7 blocks in each group: 14 > 12, never.
    assert GroupedBlockManager(12, LAYOUT).can_allocate(group) is AllocStatus.NEVER
    # By chunks of 4 the sliding group holds at most 2 (window) + 2 (chunk) + 1 blocks: 7 + 5 = 12.
    bm = GroupedBlockManager(12, LAYOUT, prefill_chunk=4)
    assert bm.can_allocate(group, 4) is AllocStatus.OK and bm.can_ever_allocate(group)
    assert GroupedBlockManager(11, LAYOUT, prefill_chunk=4).can_allocate(group, 4) is AllocStatus.NEVER


def test_a_chunked_prompt_waits_until_all_of_it_fits_not_only_its_first_chunk():
    # vLLM's admission gate (`can_fit_full_sequence`): every block of the prompt must be free, a sliding
    # group's capped at what it holds prefilling by chunks of 4 tokens: ceil((4 - 1 + 4) / 2) + 1 = 5.
    bm = GroupedBlockManager(30, LAYOUT, prefill_chunk=4)
    bm.allocate(SequenceGroup(0, [Sequence(0, 10, 12, token_ids=list(range(100, 110)))]))
    assert bm.num_free_blocks == 20
    fits = SequenceGroup(1, [Sequence(1, 30, 32, token_ids=list(range(30)))])  # 15 + 5 blocks
    waits = SequenceGroup(2, [Sequence(2, 32, 34, token_ids=list(range(200, 232)))])  # 16 + 5
    assert bm.can_allocate(fits, 4) is AllocStatus.OK
    assert bm.can_allocate(waits, 4) is AllocStatus.LATER  # though its first chunk takes 4 blocks of 20
    assert bm.can_ever_allocate(waits)
    bm.free(bm.seqs[0])
    assert bm.can_allocate(waits, 4) is AllocStatus.OK


def test_a_hybrid_model_serves_a_long_prompt_chunk_by_chunk_that_it_rejects_whole():
    trace = generate_trace(SyntheticConfig(num_requests=3, rate=0.5, lengths="fixed", prompt_len=6000,
                                           output_len=16, max_model_len=8192, seed=0))
    # 1,228 blocks of 16 tokens over Gemma 3's 7 groups: a 6,000-token prompt takes 375 blocks in each
    # group whole (2,625), but by chunks of 512 only 375 + 6 x (64 + 32 + 1) = 957 at most.
    base = SimConfig(model="gemma-3-27b", gpu="h100-80gb", kv_memory_gb=1.5, max_model_len=8192,
                     record_events=False, debug=True)
    whole = simulate(trace, base).summary
    assert whole["num_blocks"] == 1228 and whole["num_rejected"] == 3 and whole["num_finished"] == 0
    runs = [simulate(trace, dataclasses.replace(base, enable_chunked_prefill=True, max_num_batched_tokens=512,
                                                mode=mode)).summary for mode in ("fast", "step")]
    assert runs[0]["num_rejected"] == 0 and runs[0]["num_finished"] == 3
    for r in runs:
        r.pop("wall_s", None)
    assert runs[0] == runs[1]


class GroupedChunkMachine(ChunkedPrefillMachine):
    """The chunked-prefill scheduler machine (its requests, steps and final check) over a small debug
    grouped pool instead, its invariants checked on every change."""

    @initialize(num_blocks=st.integers(8, 24), window=st.integers(2, 6), budget=st.integers(2, 8),
                mode=st.sampled_from(["recompute", "swap"]))
    def setup(self, num_blocks, window, budget, mode):
        layout = kv_cache_groups([LayerKV("sliding_window", 2, 8, window), LayerKV("full", 2, 8)])
        self.bm = GroupedBlockManager(num_blocks, layout, num_cpu_blocks=16, debug=True, prefill_chunk=budget)
        self.sch = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=budget, max_model_len=24,
                                             enable_chunked_prefill=True, preemption_mode=mode), self.bm)
        self.bs = 2
        self.bound = self.bm.tables.specs[0].need + -(-budget // 2) + 1
        self.max_new: dict[int, int] = {}
        self.next_id = 0

    @invariant()
    def a_prompt_holds_slots_for_computed_chunks_only_a_window_its_span_and_caches_computed_blocks(self):
        if not hasattr(self, "sch"):
            return
        for g in self.sch.running:
            left = self.sch.prefill_left.get(g.request_id, 0)
            for s in g.live_seqs():
                if s.status is not SequenceStatus.RUNNING:
                    continue
                if left:
                    assert s.num_tokens == s.length - left, (s.seq_id, s.num_tokens, s.length, left)
                    assert _held(self.bm, s.seq_id)[0] <= self.bound
                computed = s.length - left if left else s.num_tokens
                for k, table in enumerate(self.bm.tables.tables[s.seq_id]):
                    for i, bid in enumerate(table):
                        if bid is not None and self.bm.pool.key[bid] is not None:
                            assert (i + 1) * self.bs <= computed, (k, i, computed)


TestGroupedChunkMachine = GroupedChunkMachine.TestCase
TestGroupedChunkMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])

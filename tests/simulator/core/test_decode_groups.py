"""The decode batch over KV cache groups: its steps leave the grouped pool exactly where the exact appends
(`append_slot`, sequence by sequence in running order) leave it, and it refuses exactly the step in which
a sequence would find no free block."""
from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from simulator import AllocStatus, Sequence, SequenceGroup
from simulator.core.decode_groups import GroupedDecodeBatch
from simulator.core.kv_layout import LayerKV, kv_cache_groups
from simulator.core.paged.kv_groups import GroupedBlockManager
from simulator.core.sequence import SequenceStatus

WINDOWS = st.lists(st.one_of(st.none(), st.integers(2, 12)), min_size=1, max_size=4)  # None: full attention


def _setup(windows, block_size, num_blocks, prompts, keyed, extra, debug=True):
    """A debug pool with every prompt allocated and one exact decode append each (the step after prefill)."""
    specs = [LayerKV("full", block_size, 4) if w is None else LayerKV("sliding_window", block_size, 4, w)
             for w in windows]
    bm = GroupedBlockManager(num_blocks, kv_cache_groups(specs), debug=debug)
    groups, output_len = [], {}
    for rid, prompt in enumerate(prompts):
        final = len(prompt) + extra + 2
        tokens = prompt + [1000 + rid * 100 + i for i in range(extra + 2)]  # every token known up front
        blocks = range(0, len(prompt), block_size)
        keys = () if keyed else tuple(tuple(prompt[i:i + block_size]) for i in blocks)
        seq = Sequence(rid, len(prompt), final, token_ids=tokens if keyed else None, prefix_keys=keys)
        group = SequenceGroup(rid, [seq])
        if bm.can_allocate(group) is not AllocStatus.OK:
            break
        bm.allocate(group)
        seq.status = SequenceStatus.RUNNING
        seq.num_generated = 1
        groups.append(group)
        output_len[rid] = extra + 2
    for g in groups:
        if not bm.can_append(g.seqs):
            return None
        bm.append_slot(g.seqs[0])
        g.seqs[0].num_generated += 1
    return bm, groups, output_len


def _state(bm):
    """Everything the pool and its tables hold, pending decode tokens settled first."""
    t, pool = bm.tables, bm.pool
    for sid in t.pending:
        t.settle(sid)
    return (list(pool.ref), list(pool.filled), list(pool.key), list(pool.free), list(pool.free_cached),
            dict(pool.cached), {s: [list(x) for x in v] for s, v in t.tables.items()}, dict(t.starts),
            dict(t.remove_at), list(t.held_in), list(t.filled_in), t.num_internal_slots, bm.stats.as_dict(),
            {s: seq.num_tokens for s, seq in bm.seqs.items()}, set(t.window_released))


@given(windows=WINDOWS, block_size=st.integers(1, 5), num_blocks=st.integers(8, 120),
       prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=30), min_size=1, max_size=6),
       keyed=st.booleans(), steps=st.integers(1, 40))
@settings(max_examples=120, deadline=None)
def test_batch_steps_reach_the_pool_exact_appends_reach(windows, block_size, num_blocks, prompts, keyed,
                                                         steps):
    made = [_setup(windows, block_size, num_blocks, prompts, keyed, steps) for _ in range(2)]
    assume(made[0] is not None)
    (fast_bm, fast_groups, output_len), (exact_bm, exact_groups, _) = made
    batch = GroupedDecodeBatch(fast_bm, {}, output_len)
    assume(batch.activate(fast_groups, 0))
    done = 0
    while done < steps and batch.advance_one():  # debug=True: the invariants are checked every step
        done += 1
    batch.deactivate()
    for _ in range(done):
        for g in exact_groups:
            s = g.seqs[0]
            assert exact_bm.can_append([s])
            exact_bm.append_slot(s)
            s.num_generated += 1
    assert _state(fast_bm) == _state(exact_bm)
    assert [g.seqs[0].num_generated for g in fast_groups] == [g.seqs[0].num_generated for g in exact_groups]
    if done < steps:  # the batch refused this step: an exact step finds some sequence without its blocks
        fits = True
        for g in exact_groups:
            if not exact_bm.can_append(g.seqs):
                fits = False
                break
            exact_bm.append_slot(g.seqs[0])
        assert not fits


def test_a_batch_step_visits_only_sequences_at_a_boundary_or_window_edge():
    """Blocks of 4, window 6: a sequence is visited when its token count is 0 or 1 (6 - 1) mod 4."""
    bm, groups, output_len = _setup([None, 6], 4, 60, [list(range(9))], False, 30, debug=False)
    batch = GroupedDecodeBatch(bm, {}, output_len)
    assert batch.activate(groups, 0)
    s = groups[0].seqs[0]
    visited = []
    for _ in range(12):
        n = batch.phase + batch.offsets[s][0]
        assert batch.advance_one()
        if batch.phase + batch.pend[s] == 0:  # its pending tokens were settled: the exact append ran
            visited.append(n)
    assert visited == [n for n in range(10, 22) if n % 4 in (0, 1)]
    assert bm.tables.starts[s.seq_id][1] == (21 - 5) // 4  # the window moved on at 13, 17 and 21

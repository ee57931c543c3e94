"""The scheduler's decode batch: the decode steps `schedule()` takes, taken in O(what changes)."""
from __future__ import annotations

from simulator import BlockManager, Sequence, SequenceGroup, check_invariants
from simulator.core.decode import append_blocks
from simulator.core.scheduler import Scheduler, SchedulerConfig


def test_decode_blocks_in_bulk_equal_append_slot_one_by_one():
    """The decode batch's block helpers leave the manager exactly as per-token `append_slot` does."""
    def setup():
        bm = BlockManager(64, 4, record_events=True, debug=False)
        seqs = []
        for i, p in enumerate((3, 4, 9, 1)):
            s = Sequence(i, p, p + 20, request_id=i)
            bm.allocate(SequenceGroup(i, [s]))
            seqs.append(s)
        return bm, seqs

    ref_bm, ref_seqs = setup()
    for _ in range(11):
        for s in ref_seqs:
            ref_bm.append_slot(s)
    bm, seqs = setup()
    for step in range(11):  # lazily: blocks at boundaries only, counts settled at the end
        due = [s for s in seqs if (s.num_tokens + step) % 4 == 0]
        append_blocks(bm, due)
    bm.pool.total_filled += 11 * len(seqs)  # what the batch counts lazily
    for s in seqs:  # and settles
        s.num_tokens += 11
        bm.pool.filled[s.block_table[-1]] = s.num_tokens - (len(s.block_table) - 1) * 4
    check_invariants(bm)
    assert [s.block_table for s in seqs] == [s.block_table for s in ref_seqs]
    assert bm.breakdown() == ref_bm.breakdown()
    assert bm.pool.filled == ref_bm.pool.filled and bm.pool.ref == ref_bm.pool.ref


def test_a_decode_step_equals_schedule_when_nobody_is_preempted():
    def setup():
        bm = BlockManager(200, 4)
        output_len = {i: 11 for i in range(7)}
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), bm,
                          output_len)
        for i, p in enumerate((5, 9, 30, 20, 40, 70, 6)):
            sched.add_request(SequenceGroup(i, [Sequence(i, p, p + 10, request_id=i)]))
        out = sched.schedule()  # admits the first ones
        sched.commit(out)
        for sg in out.scheduled:
            sg.group.seqs[0].append_token()
        return bm, sched

    bm_a, a = setup()
    bm_b, b = setup()
    out_a = a.schedule()
    assert b.decode_ready()  # every running group is a plain decode
    out_b = b.decode_step()
    b.decode.settle_all()
    assert [g.request_id for g in out_b.admitted] == [g.request_id for g in out_a.admitted] != []
    assert [g.request_id for g in out_b.rejected] == [g.request_id for g in out_a.rejected] == [5]
    assert out_b.num_batched_tokens == out_a.num_batched_tokens
    assert [(sg.group.request_id, sg.num_new_tokens) for sg in out_b.scheduled] == \
        [(sg.group.request_id, sg.num_new_tokens) for sg in out_a.scheduled if sg.is_prefill]
    assert [g.request_id for g in b.running] == [g.request_id for g in a.running]
    assert bm_b.breakdown() == bm_a.breakdown()


def _token(rid: int, index: int) -> int:
    """A deterministic 'sampled' token: requests 0 and 1 share their prompts and outputs (same blocks)."""
    return (min(rid, 1) * 7 + index * 3) % 5


def _decoding(block_size: int = 4, keyed: bool = False, prefix: bool = True):
    """A scheduler with six plain decodes admitted and prefilled (their first token sampled)."""
    bm = BlockManager(300, block_size, enable_prefix_caching=prefix)
    lens = (5, 5, 9, 30, 12, 3)
    output_len = {i: n for i, n in enumerate((20, 20, 7, 25, 14, 30))}
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=64), bm,
                      output_len)
    for i, p in enumerate(lens):
        tokens = [(min(i, 1) + j) % 5 for j in range(p)] if keyed else None
        s = Sequence(i, p, p + output_len[i] - 1, request_id=i, token_ids=tokens)
        sched.add_request(SequenceGroup(i, [s]))
    out = sched.schedule()
    sched.commit(out)
    for sg in out.scheduled:
        sg.group.seqs[0].append_token(_token(sg.group.request_id, 0) if keyed else None)
    return bm, sched, output_len


def _state(bm, sched):
    seqs = sorted((s for g in sched.running for s in g.seqs), key=lambda s: s.seq_id)
    return ([(s.seq_id, s.num_tokens, s.num_generated, list(s.block_table)) for s in seqs], bm.breakdown(),
            list(bm.pool.key), dict(bm.pool.cached), [g.request_id for g in sched.running])


def _run(fast: bool, keyed: bool, stop_at: dict[int, int], block_size: int = 4):
    """Decode every request to its end, step by step; `stop_at` (request id -> step) finishes some
    early, as the engine does at EOS. Yields the state after every step."""
    bm, sched, output_len = _decoding(block_size, keyed)
    step = 0
    while sched.running:
        step += 1
        if fast:
            assert sched.decode_ready()
            out = sched.decode_step()
            assert out is not None and not out.scheduled
            batch = sched.decode
            if keyed:
                for s in batch.offsets:
                    s.token_ids.append(_token(s.request_id, len(s.token_ids) - s.prompt_len))
            done = batch.pop_finished()
            early = [g for g in sched.running if stop_at.get(g.request_id) == step and g not in done]
            batch.remove(early)
            sched.finish_groups(done + early)
        else:
            out = sched.schedule()
            for g in list(sched.running):
                s = g.seqs[0]
                s.append_token(_token(g.request_id, s.num_generated) if keyed else None)
                if s.num_generated >= output_len[g.request_id] or stop_at.get(g.request_id) == step:
                    sched.finish_seq(s)
            sched.remove_finished()
        if fast and sched.decode.active:
            sched.decode.settle_all()  # the objects exact, for the comparison only
        check_invariants(bm)
        yield _state(bm, sched)


def test_members_finished_early_leave_the_batch_as_the_exact_step_finishes_them():
    stop_at = {2: 3, 3: 9, 5: 1}
    assert list(_run(True, False, stop_at)) == list(_run(False, False, stop_at))


def test_members_with_tokens_publish_the_blocks_their_decodes_fill():
    for block_size in (1, 4):
        fast = list(_run(True, True, {4: 6}, block_size))
        exact = list(_run(False, True, {4: 6}, block_size))
        assert fast == exact
        keys = fast[-1][2]
        assert sum(k is not None for k in keys) > 20  # decode blocks were published, prompts' and outputs'


def test_removing_a_member_drops_its_pending_completion_and_waste():
    bm, sched, output_len = _decoding()
    assert sched.decode_ready()
    batch = sched.decode
    for _ in range(2):
        sched.decode_step()
    gone = [g for g in sched.running if g.request_id in (3, 5)]
    batch.remove(gone)
    sched.finish_groups(gone)
    # A batch built afresh over the groups left has the same completions and final-block waste ahead.
    fresh_sched = Scheduler(sched.config, bm, output_len)
    fresh_sched.running = sched.running
    batch.settle_all()
    fresh = fresh_sched.decode
    assert fresh.activate(sched.running, 0)
    ahead = {k - batch.phase: v for k, v in batch.waste_at.items() if v}
    assert ahead == {k: v for k, v in fresh.waste_at.items() if v}
    assert sorted(f - batch.phase for f in batch.finish_heap) == sorted(fresh.finish_heap)
    assert batch.size == fresh.size == 4 and batch.tokens == fresh.tokens

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

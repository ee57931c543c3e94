"""Fast mode's single step: every running request decodes, nobody is preempted, some may be admitted.

This is the step `Scheduler.schedule()` takes when every running group is a plain decode and the free
blocks cover all of this step's appends (so its per-group loop preempts nobody): each sequence gets one
slot, then waiting requests are admitted. Here the appends come from the decode batch in O(blocks taken)
(decode_batch.py), the admissions from the scheduler itself (`admit_after_decode`), and the step time
and memory row from running totals, so the step costs O(what changes), not O(running requests).
"""
from __future__ import annotations

from math import isnan

from simulator.core.sequence import SequenceGroup, SequenceStatus
from simulator.sim_state import SimState
from simulator.stepping import finish_done, prefill_context


def fast_step(run: SimState) -> bool:
    """Take the next step the fast way; False (with the batch settled) when it needs the exact step."""
    batch, sched = run.batch, run.sched
    b = batch.size
    if not b or not batch.advance_one():
        batch.deactivate()  # nothing to decode, or someone would be preempted: the exact loop decides
        return False
    tokens = batch.tokens
    num_tokens, pairs, kv = b, tokens, tokens  # one query token per decode, its context = its tokens
    scheduled = ()
    if sched.waiting or sched.swapped:
        out = sched.admit_after_decode(b)
        if out.admitted or out.rejected:
            run.record_schedule(out, run.now)
        scheduled = out.scheduled
        for sg in scheduled:
            chunk = sg.num_new_tokens
            ctx = prefill_context(sched, sg)
            num_tokens += chunk
            pairs += chunk * ctx
            kv += ctx
    dt = run.latency.step_time(num_tokens, pairs, kv, b)
    run.mem.add_slots(run.step, 1, run.now, dt, run.alloc.breakdown_slots(run.head()), run.counts(),
                      num_tokens, run.block_size)
    run.add_busy(dt, len(sched.running), 1)
    run.set_clock(run.now + dt)
    done = finish_batch(run) if batch.finish_heap[0] == batch.phase else []
    if scheduled:
        sched.commit(out)
        touched = []
        for sg in scheduled:
            if sg.completes_prefill:
                g = sg.group
                for s in g.seqs:
                    if s.status is not SequenceStatus.FINISHED:
                        s.append_token()
                if isnan(run.first_token[g.request_id]):  # the first time
                    run.first_token[g.request_id] = run.now
                touched.append(g)
        finished = finish_done(run, touched, remove=False)
        done += finished
        joining = [sg.group for sg in scheduled if sg.group not in finished]
        if joining:
            batch.join(joining)
    if done:
        sched.remove_groups(done)
    run.blocked_head = sched.waiting[0] if sched.waiting else None
    return True


def finish_batch(run: SimState) -> list[SequenceGroup]:
    """Finish the batch's requests whose last token came out in the step just run; return their groups."""
    done = run.batch.pop_finished()
    for g in done:
        run.sched.finish_seq(g.seqs[0])
        run.finish[g.request_id] = run.now
        run.retire(g.request_id)
    run.num_done += len(done)
    return done

"""One exact simulation step, the reference both modes share: schedule, time, record, sample, finish.

Step mode runs only this; fast mode runs it whenever its shortcuts (simulator/fast.py, simulator/span.py)
do not apply. It works on the objects alone (the decode batch must be settled first).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from simulator.beam_model import beam_step
from simulator.core.scheduler import SchedulerOutput
from simulator.core.sequence import SequenceGroup, SequenceStatus
from simulator.step_latency import step_features

if TYPE_CHECKING:
    from simulator.simulate import _Run


def exact_step(run: _Run) -> None:
    """Schedule and run one step with the shared Scheduler, exactly as step mode does."""
    out = run.sched.schedule()
    bookkeep(run, out)
    if out.is_empty:
        if out.rejected:
            return
        if run.next < run.num_requests:
            run.idle_until(run.arrival_s[run.next])
            return
        raise RuntimeError("scheduler stalled with work left and no future arrival (a bug)")
    dt = step_time(run, out)
    run.mem.add_breakdown(run.step, run.now, dt, run.alloc.breakdown(run.head()), run.counts(),
                          out.num_batched_tokens, run.block_size)
    run.busy_s += dt
    run.batch_s += dt * len(run.sched.running)
    run.set_clock(run.now + dt)
    run.step += 1
    run.sched.commit(out)
    sample(run, out)


def bookkeep(run: _Run, out: SchedulerOutput) -> None:
    """Record rejections, first admissions and preemptions of the step's output."""
    for g in out.rejected:
        run.rejected[g.request_id] = True
        run.num_done += 1
    for g in out.admitted:
        i = g.request_id
        if math.isnan(run.admitted[i]):
            run.admitted[i] = run.now
            run.hit_tokens[i] = run.sched.hit_tokens.get(i, 0)
    for g in out.preempted:
        run.preemptions[g.request_id] += 1


def step_time(run: _Run, out: SchedulerOutput) -> float:
    """Roofline (or fitted) time of the step plus any swap traffic over PCIe."""
    q_lens, ctx_lens = [], []
    for sg in out.scheduled:
        seqs = [s for s in sg.group.seqs if s.status is not SequenceStatus.FINISHED]
        if sg.is_prefill:
            left = run.sched.prefill_left[sg.group.request_id]
            n = seqs[0].length
            base = n if all(s.length == n for s in seqs) else sum(s.length for s in seqs)
            q_lens.append(sg.num_new_tokens)
            ctx_lens.append(base - left + sg.num_new_tokens)
        else:
            for s in seqs:
                q_lens.append(1)
                ctx_lens.append(s.num_tokens)
    dt = run.latency.step_time(*step_features(np.asarray(q_lens), np.asarray(ctx_lens)))
    swapped = out.blocks_to_swap_in + out.blocks_to_swap_out
    if swapped:
        slots = sum(c[2] if len(c) == 3 else run.block_size for c in swapped)
        dt += run.latency.swap_time(slots, 1)
    return dt


def sample(run: _Run, out: SchedulerOutput) -> list[SequenceGroup]:
    """Every group that computed logits this step samples one token per live sequence; finish the done."""
    touched = []
    for sg in out.scheduled:
        if sg.is_prefill and not sg.completes_prefill:
            continue
        g = sg.group
        for s in g.seqs:
            if s.status is not SequenceStatus.FINISHED:
                s.append_token()
        if math.isnan(run.first_token[g.request_id]):
            run.first_token[g.request_id] = run.now
        touched.append(g)
    finish_done(run, touched)
    return touched


def finish_done(run: _Run, groups: list[SequenceGroup], remove: bool = True) -> list[SequenceGroup]:
    """Free requests that reached their output length; fork/prune the beams that go on. Return the
    finished groups (removed from the running list unless `remove` is false)."""
    done = []
    for g in groups:
        i = g.request_id
        live = [s for s in g.seqs if s.status is not SequenceStatus.FINISHED]
        if not live:
            continue
        if live[0].num_generated >= run.output_len[i]:
            for s in live:
                run.sched.finish_seq(s)
            run.finish[i] = run.now
            run.num_done += 1
            done.append(g)
        elif g.beam_width > 1:
            beam_step(g, run.alloc, run.rng, run.new_seq_id, run.cfg.beam_alpha)
    if remove:
        run.sched.remove_finished()
    return done

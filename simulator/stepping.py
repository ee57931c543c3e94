"""One exact simulation step, the reference both modes share: schedule, time, record, sample, finish.

Step mode runs only this; fast mode runs it whenever its shortcuts (simulator/fast.py, simulator/span.py)
do not apply. It works on the objects alone (the decode batch must be settled first).
"""
from __future__ import annotations

import math

import numpy as np

from simulator.core.beam import prune_and_fork
from simulator.core.scheduler import ScheduledGroup, Scheduler, SchedulerOutput
from simulator.core.sequence import SequenceGroup, SequenceStatus
from simulator.sim_state import SimState
from simulator.step_latency import step_features


def exact_step(run: SimState) -> None:
    """Schedule and run one step with the shared Scheduler, exactly as step mode does."""
    out = run.sched.schedule()
    measured = run.measured
    if measured is not None and not out.is_empty:
        start, dt = measured.step(run.step)
        run.set_clock(max(start, run.now))  # the replay's loop overhead (or sleep overshoot) before the step
    run.record_schedule(out, run.now)
    if out.is_empty:
        if out.rejected:
            return
        if run.next < run.num_requests:
            run.idle_until(run.next_arrival)
            return
        raise RuntimeError("scheduler stalled with work left and no future arrival (a bug)")
    if measured is None:
        dt = step_time(run, out)
    run.record_step(run.now, dt, run.alloc.breakdown(run.head()), run.counts(), out.num_batched_tokens)
    run.set_clock(run.now + dt)
    run.sched.commit(out)
    sample(run, out)


def prefill_context(sched: Scheduler, sg: ScheduledGroup) -> int:
    """Context length a prefill chunk attends to: the tokens computed before it plus the chunk itself."""
    seqs = [s for s in sg.group.seqs if s.status is not SequenceStatus.FINISHED]
    n = seqs[0].length
    base = n if all(s.length == n for s in seqs) else sum(s.length for s in seqs)
    return base - sched.prefill_left[sg.group.request_id] + sg.num_new_tokens


def step_time(run: SimState, out: SchedulerOutput) -> float:
    """Roofline (or fitted) time of the step plus any swap traffic over PCIe."""
    q_lens, ctx_lens = [], []
    for sg in out.scheduled:
        if sg.is_prefill:
            q_lens.append(sg.num_new_tokens)
            ctx_lens.append(prefill_context(run.sched, sg))
        else:
            for s in sg.group.seqs:
                if s.status is not SequenceStatus.FINISHED:
                    q_lens.append(1)
                    ctx_lens.append(s.num_tokens)
    num_decode = sum(1 for sg in out.scheduled if not sg.is_prefill
                     for s in sg.group.seqs if s.status is not SequenceStatus.FINISHED)
    dt = run.latency.step_time(*step_features(np.asarray(q_lens), np.asarray(ctx_lens)), num_decode)
    swapped = out.blocks_to_swap_in + out.blocks_to_swap_out
    if swapped:
        slots = sum(c[2] if len(c) == 3 else run.block_size for c in swapped)
        dt += run.latency.swap_time(slots, 1)
    return dt


def sample(run: SimState, out: SchedulerOutput) -> list[SequenceGroup]:
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


def beam_children(rng: np.random.Generator, k: int, alpha: float) -> list[int]:
    """How many of the next step's k beams each of the k live beams parents: a seeded stand-in for
    beam search's scores, so its block sharing can be measured without a model.

    Each beam's share of the continuations is a Dirichlet(alpha) draw and the k children go to parents
    by a multinomial draw. Small alpha: few beams survive a step, so the beams share long prefixes (high
    sharing); large alpha: most beams survive (little sharing).
    """
    return rng.multinomial(k, rng.dirichlet(np.full(k, alpha))).tolist()


def finish_done(run: SimState, groups: list[SequenceGroup], remove: bool = True) -> list[SequenceGroup]:
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
            run.retire(i)
            run.num_done += 1
            done.append(g)
        elif g.beam_width > 1 and len(live) > 1:
            prune_and_fork(g, live, beam_children(run.rng, len(live), run.cfg.beam_alpha),
                           allocator=run.alloc, finish=run.sched.finish_seq, new_seq_id=run.new_seq_id)
    if remove:
        run.sched.remove_finished()
    return done

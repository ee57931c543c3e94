"""One simulation step: the exact step (the reference both modes share) and fast mode's decode step.

The exact step runs the shared Scheduler's `schedule()`, times the step, records it, samples a token for
every group that computed logits and finishes the requests that are done; step mode runs only this. Fast
mode takes a step with the scheduler's `decode_step` whenever every running request is a plain decode
(simulator/core/decode.py): the appends come in O(blocks taken), admissions from the scheduler itself, and
the step time and memory row from running totals, so the step costs O(what changes).
"""
from __future__ import annotations

import math

import numpy as np

from simulator.core.beam import prune_and_fork
from simulator.core.scheduler import ScheduledGroup, Scheduler, SchedulerOutput
from simulator.core.sequence import SequenceGroup, SequenceStatus
from simulator.loop.state import SimState
from simulator.timing.step_latency import step_features


def exact_step(run: SimState) -> SchedulerOutput:
    """Schedule and run one step with the shared Scheduler (an empty one runs nothing: the driver waits
    for the next arrival)."""
    out = run.sched.schedule()
    measured = run.measured
    if measured is not None and not out.is_empty:
        start, dt = measured.step(run.step)
        run.set_clock(max(start, run.now))  # the replay's loop overhead (or sleep overshoot) before the step
    run.record_schedule(out, run.now)
    if out.is_empty:
        return out
    if measured is None:
        dt = step_time(run, out)
    run.record_step(run.now, dt, run.alloc.breakdown(run.head()), run.counts(), out.num_batched_tokens)
    run.set_clock(run.now + dt)
    run.sched.commit(out)
    sample(run, out)
    return out


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
            prune_and_fork(g, live, beam_children(run.rng, len(live), run.beam_alpha),
                           allocator=run.alloc, finish=run.sched.finish_seq, new_seq_id=run.new_seq_id)
    if remove:
        run.sched.remove_finished()
    return done


def fast_step(run: SimState) -> bool:
    """Take the next step with the decode batch; False (the batch settled) when the exact step must."""
    sched = run.sched
    out = sched.decode_step()
    if out is None:
        return False
    batch = sched.decode
    b = batch.size
    tokens = batch.tokens
    num_tokens, pairs, kv = b, tokens, tokens  # one query token per decode, its context = its tokens
    scheduled = out.scheduled
    if out.admitted or out.rejected:
        run.record_schedule(out, run.now)
    for sg in scheduled:
        chunk = sg.num_new_tokens
        ctx = prefill_context(sched, sg)
        num_tokens += chunk
        pairs += chunk * ctx
        kv += ctx
    dt = run.latency.step_time(num_tokens, pairs, kv, b)
    run.mem.add_breakdown(run.step, 1, run.now, dt, run.alloc.breakdown(run.head()), run.counts(), num_tokens,
                          run.block_size)
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
                if math.isnan(run.first_token[g.request_id]):  # the first time
                    run.first_token[g.request_id] = run.now
                touched.append(g)
        finished = finish_done(run, touched, remove=False)
        done += finished
        joining = [sg.group for sg in scheduled if sg.group not in finished]
        if joining:
            batch.join(joining)
    if done:
        sched.finish_groups(done)
    run.blocked_head = sched.waiting[0] if sched.waiting else None
    return True


def finish_batch(run: SimState) -> list[SequenceGroup]:
    """Finish the batch's requests whose last token came out in the step just run; return their groups."""
    done = run.sched.decode.pop_finished()
    for g in done:
        run.sched.finish_seq(g.seqs[0])
        run.finish[g.request_id] = run.now
        run.retire(g.request_id)
    run.num_done += len(done)
    return done

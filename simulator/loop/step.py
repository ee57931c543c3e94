"""How the loop advances: an exact step (the reference both modes share), a fast decode step, or a span.

The exact step runs the shared Scheduler's `schedule()`, times the step, records it, samples a token for
every group that computed logits and finishes the requests that are done; step mode runs only this. Fast
mode takes a step with the scheduler's `decode_step` whenever every running request is a plain decode
(simulator/core/decode.py): the appends come in O(blocks taken), admissions from the scheduler itself, and
the step time and memory row from running totals, so the step costs O(what changes).

A span is a run of K decode steps in which, were they executed one by one, every step would do the same
thing: each running sequence gets one slot and samples one token, nobody is admitted, swapped,
preempted, rejected or finished before the last step, and no arrival could change a decision. The K
steps then collapse into the decode batch's bulk advance (the blocks the K steps take, in the order step
mode takes them), K step times summed in the same order as step mode's clock, and one memory row holding
the span's exact time-weighted means.
"""
from __future__ import annotations

import math

import numpy as np

from simulator.core.beam import prune_and_fork
from simulator.core.scheduler import Admission, ScheduledGroup, Scheduler, SchedulerOutput
from simulator.core.sequence import SequenceGroup, SequenceStatus
from simulator.loop.state import SimState
from simulator.timing.step_latency import step_features


def exact_step(run: SimState) -> SchedulerOutput:
    """Schedule and run one step with the shared Scheduler (an empty one runs nothing: the driver waits
    for the next arrival)."""
    out = run.sched.schedule()
    measured = run.measured
    last = run.now  # the end of the step before: the running groups' last token
    if measured is not None and not out.is_empty:
        start, dt = measured.step(run.step)
        run.set_clock(max(start, run.now))  # the replay's loop overhead (or sleep overshoot) before the step
    run.record_schedule(out, run.now, last)
    if out.is_empty:
        if out.blocks_to_swap_out:  # the only running groups swapped out: copy time, logged as a replay's
            end = run.now + swap_seconds(run, out.blocks_to_swap_out)
            if measured is None:
                run.record_idle(run.now, end)
                run.set_clock(end)
            elif run.step < len(measured):  # the replay's clock: logged up to its next step, `now` stays
                run.record_idle(run.now, max(run.now, min(end, measured.start_s[run.step])))
        return out
    if measured is None:
        dt = step_time(run, out)
    run.record_step(run.now, dt, run.alloc.breakdown(run.head()), run.counts(), out.num_batched_tokens)
    run.set_clock(run.now + dt)
    run.sched.commit(out)
    # A token's gap is the step's time: with measured steps, the loop overhead before it too.
    sample(run, out.scheduled, gap=dt if measured is None else run.now - last)
    return out


def prefill_context(sched: Scheduler, sg: ScheduledGroup) -> int:
    """Context length a prefill chunk attends to: the tokens computed before it plus the chunk itself."""
    # Diverged sequences are prefilled one after another: their tokens count as one long prompt.
    seqs = [s for s in sg.group.seqs if s.status is not SequenceStatus.FINISHED]
    return sched.prefill_tokens(seqs) - sched.prefill_left[sg.group.request_id] + sg.num_new_tokens


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
        dt += swap_seconds(run, swapped)
    tiers = getattr(run.alloc, "tiers", None)
    if tiers is not None:  # prefix blocks loaded from the CPU or disk tier
        dt += tiers.take_load_seconds(run.latency.load_time)
    return dt


def swap_seconds(run: SimState, copies: list[tuple[int, ...]]) -> float:
    """PCIe time of block copies (a contiguous copy carries its length in slots)."""
    return run.latency.swap_time(sum(c[2] if len(c) == 3 else run.block_size for c in copies), 1)


def sample(run: SimState, scheduled: list[ScheduledGroup], remove: bool = True,
           gap: float = 0.0) -> list[SequenceGroup]:
    """Every group that computed logits in this step of `gap` seconds samples one token per live
    sequence (its inter-token gap counted); finish the done (see `finish_done`) and return them."""
    touched, later = [], []
    first_token = run.first_token
    for sg in scheduled:
        if sg.is_prefill and not sg.completes_prefill:
            continue
        g = sg.group
        for s in g.seqs:
            if s.status is not SequenceStatus.FINISHED:
                s.append_token()
        i = g.request_id
        if math.isnan(first_token[i]):
            first_token[i] = run.now
        else:
            later.append(i)
        touched.append(g)
    if later:
        run.add_gaps(later, gap)
    return finish_done(run, touched, remove)


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
    tiers = getattr(run.alloc, "tiers", None)
    if tiers is not None:
        dt += tiers.take_load_seconds(run.latency.load_time)
    run.mem.add_breakdown(run.step, 1, run.now, dt, run.alloc.breakdown(run.head()), run.counts(), num_tokens,
                          run.block_slots)
    run.add_busy(dt, len(sched.running), 1)
    run.set_clock(run.now + dt)
    done = finish_batch(run) if batch.finish_heap[0] == batch.phase else []
    if scheduled:  # prefills only: nothing is swapped while the decode batch holds the running groups
        sched.commit(out)
        finished = sample(run, scheduled, remove=False, gap=dt)
        done += finished
        joining = [sg.group for sg in scheduled if sg.group not in finished]
        if joining:
            batch.join(joining)
    run.itl.add(dt, b)  # after the prefills' gaps, in the order an exact step adds them
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


# ----------------------------------------------------------------- spans
_NO_SPAN = (0, None)


def span_length(run: SimState) -> tuple[int, tuple | None]:
    """How many steps can be advanced at once from here (0: take a single step), with their durations
    and the clock at the start of each (and after the last)."""
    sched = run.sched
    batch = sched.decode
    b = batch.size
    # A grouped pool takes no spans: its windows hand blocks back mid-span, which may admit the head.
    if not b or batch.grouped or (sched.waiting and sched.head_admission(sched.token_budget - b)
                                  is not Admission.WAIT):
        return _NO_SPAN
    k = batch.next_finish  # the first completion ends the span (its step included)
    if batch.paged:  # stop before the step in which some sequence would find no block
        free = run.alloc.num_free_blocks
        if free < b * (k // batch.block_size + 1):  # else even k steps cannot run out
            k = min(k, batch.steps_within(free))
    if k < 2:
        return _NO_SPAN
    tokens = batch.tokens
    now = run.now
    arrival = None
    if not sched.waiting and run.next < run.num_requests:
        # A step that starts at or after the next arrival would enqueue (and maybe admit) it. Steps only
        # get longer as contexts grow, so the first one bounds how many can start before the arrival.
        arrival = run.next_arrival
        first = run.latency.step_time(b, tokens + b, tokens + b, b)
        if now + first >= arrival:
            return _NO_SPAN
        k = min(k, int(min((arrival - now) / first, k)) + 2)
    dts = run.latency.decode_times(b, tokens, k)
    clock = [now]
    t = now
    for j, dt in enumerate(dts):
        if arrival is not None and t >= arrival:
            k = j
            del dts[j:]
            break
        t += dt  # the same sequence of additions as step mode's clock
        clock.append(t)
    return (k, (dts, clock)) if k >= 2 else _NO_SPAN


def run_span(run: SimState, k: int, timing: tuple) -> None:
    """Execute `k` decode steps at once and log one memory row with the span's time-weighted means."""
    dts, clock = timing
    batch = run.sched.decode
    total = sum(dts)
    _log_span(run, k, dts, total)
    batch.advance(k, clock[:k] if run.events is not None and batch.paged else None)
    run.itl.add_each(dts, batch.size)
    run.add_busy(total, len(run.sched.running), k)
    run.set_clock(float(clock[k]))


def _log_span(run: SimState, k: int, dts: list[float], total: float) -> None:
    """The exact time-weighted mean of each memory state over the span's steps (the states after each
    step's appends, as step mode logs them), one step at a time."""
    alloc, batch = run.alloc, run.sched.decode
    b = batch.size
    cap, tok0, resv0, internal0, external, free0, cached0, allocated0 = alloc.breakdown(run.head())
    acc_tokens = sum(dt * (j + 1) for j, dt in enumerate(dts)) * b + tok0 * total
    if batch.paged:
        bs, d = batch.block_size, batch.phase
        buckets, waste_at = batch.buckets, batch.waste_at
        used0 = allocated0 // bs
        internal_slots = alloc.num_internal_slots
        uncached = alloc.num_free_blocks - alloc.num_cached_free_blocks
        free_blocks0 = alloc.num_blocks - used0
        new = waste = 0
        acc_internal = acc_allocated = acc_free = acc_cached = 0.0
        held = tok0
        for j, dt in enumerate(dts):
            new += len(buckets[(d + j) % bs])
            if waste_at:
                waste += waste_at.get(d + j, 0)
            held += b
            allocated = (used0 + new) * bs
            internal = min(internal_slots + waste, allocated - held)
            acc_internal += dt * internal
            acc_allocated += dt * allocated
            acc_free += dt * (free_blocks0 - new)
            if new > uncached:
                acc_cached += dt * (new - uncached)
        reservation = acc_allocated - acc_tokens - acc_internal
        acc_free *= bs
        acc_cached = cached0 * total - acc_cached * bs
        blocks_used = used0 + new
    else:
        reservation = resv0 * total - (acc_tokens - tok0 * total)
        acc_internal, acc_free = internal0 * total, free0 * total
        acc_cached, acc_allocated = cached0 * total, allocated0 * total
        blocks_used = allocated0 // alloc.block_size
    scale = 1.0 / (total * cap)
    run.mem.add_row(run.step, k, run.now, total, acc_tokens * scale, reservation * scale,
                    acc_internal * scale, external / cap, acc_free * scale, acc_cached * scale,
                    acc_allocated * scale, run.counts(), b, blocks_used)

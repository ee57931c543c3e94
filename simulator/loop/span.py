"""Fast mode's spans: advance a run of plain decode steps in one go.

A span is a run of K steps in which, were they executed one by one, every step would do the same
thing: each running sequence gets one slot and samples one token, nobody is admitted, swapped,
preempted, rejected or finished before the last step, and no arrival could change a decision. Then the
K steps collapse into the decode batch's bulk advance (simulator/core/decode.py: the blocks the K steps take,
in the order step mode takes them), K step times computed at once (vectorized latency model, summed in
the same order as step mode's clock) and one memory row holding the span's exact time-weighted means.
"""
from __future__ import annotations

from simulator.core.scheduler import Admission
from simulator.loop.state import SimState

_NO_SPAN = (0, None)


def span_length(run: SimState) -> tuple[int, tuple | None]:
    """How many steps can be advanced at once from here (0: take a single step), with their durations
    and the clock at the start of each (and after the last)."""
    sched = run.sched
    batch = sched.decode
    b = batch.size
    if not b or (sched.waiting and sched.head_admission(sched.token_budget - b) is not Admission.WAIT):
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
        k = min(k, int((arrival - now) / first) + 2)
    step_time = run.latency.step_time
    dts, clock = [], [now]
    t, ctx = now, tokens
    for j in range(k):
        if arrival is not None and t >= arrival:
            k = j
            break
        ctx += b
        dt = step_time(b, ctx, ctx, b)
        dts.append(dt)
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

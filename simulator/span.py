"""Fast mode: advance a run of plain decode steps in one go.

A span is a run of K steps in which, were they executed one by one, every step would do the same
thing: each running sequence gets one slot and samples one token, nobody is admitted, swapped,
preempted, rejected or finished before the last step, and no arrival could change a decision. Then the
K steps collapse into one bulk `append_slots(seq, K)` per sequence, K step times computed at once
(vectorized latency model), and one memory row holding the span's exact time-weighted means.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from simulator.allocator import AllocStatus
from simulator.block_manager import BlockManager
from simulator.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from simulator.simulate import _Run

_NO_SPAN = (0, None)


def _live(run: _Run) -> list[Sequence] | None:
    seqs = []
    for g in run.sched.running:
        if g.beam_width > 1:
            return None  # beams fork and prune every step
        seqs.extend(s for s in g.seqs if s.status is not SequenceStatus.FINISHED)
    return seqs


def _admission_blocked(run: _Run, num_decode_tokens: int) -> bool:
    """Whether `Scheduler._admit` would leave the head waiting, and keep doing so while memory shrinks."""
    sched = run.sched
    head = sched.waiting[0]
    seqs = [s for s in head.seqs if s.status is not SequenceStatus.FINISHED]
    limit = sched.config.max_model_len
    if seqs[0].length > limit or (seqs[0].final_len or 0) > limit:
        return False  # it would be rejected now
    status = run.alloc.can_allocate(head)
    if status is AllocStatus.NEVER:
        return False
    room = sched.config.token_budget - num_decode_tokens
    if status is AllocStatus.LATER or len(sched.running) >= sched.config.max_num_seqs or room <= 0:
        return True
    return not sched.config.enable_chunked_prefill and sched._prefill_tokens(seqs) > room


def span_length(run: _Run) -> tuple[int, np.ndarray | None]:
    """How many steps can be advanced at once from here (0: take a normal step), and their durations."""
    sched = run.sched
    if sched.swapped or sched.prefill_left or not sched.running:
        return _NO_SPAN
    seqs = _live(run)
    if not seqs:
        return _NO_SPAN
    b = len(seqs)
    if sched.waiting and not _admission_blocked(run, b):
        return _NO_SPAN
    n = np.fromiter((s.num_tokens for s in seqs), np.int64, b)
    gen = np.fromiter((s.num_generated for s in seqs), np.int64, b)
    rid = np.fromiter((s.request_id for s in seqs), np.int64, b)
    k = int((run.output[rid] - gen).min())  # the first completion ends the span
    alloc = run.alloc
    if isinstance(alloc, BlockManager):
        bs = alloc.block_size
        for s in seqs:  # a shared partial block is copied on the next append: take that step normally
            if s.num_tokens % bs and alloc.ref_count(s.block_table[-1]) > 1:
                return _NO_SPAN
        base = -(-n // bs)
        free = alloc.num_free_blocks

        def need(steps: int) -> int:
            return int((-(-(n + steps) // bs) - base).sum())

        if need(k) > free:  # stop before the step in which some sequence would find no block
            lo, hi = 0, k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if need(mid) <= free else (lo, mid - 1)
            k = lo
    if k < 2:
        return _NO_SPAN
    ctx = n.sum() + b * np.arange(1, k + 1, dtype=np.int64)
    dts = run.latency.step_times(np.full(k, b, dtype=np.int64), ctx, ctx)
    if not sched.waiting and run.next < len(run.arrival):
        # A step that starts at or after the next arrival would enqueue (and maybe admit) it.
        starts = run.now + np.concatenate(([0.0], np.cumsum(dts[:-1])))
        k = min(k, int(np.searchsorted(starts, run.arrival[run.next], side="left")))
        dts = dts[:k]
    return (k, dts) if k >= 2 else _NO_SPAN


def run_span(run: _Run, k: int, dts: np.ndarray) -> None:
    """Execute `k` decode steps at once and log one memory row with the span's time-weighted means."""
    seqs = _live(run)
    b = len(seqs)
    alloc = run.alloc
    head = run.head()
    b0 = alloc.breakdown(head)
    n0 = np.fromiter((s.num_tokens for s in seqs), np.int64, b)
    cum = np.cumsum(dts)
    starts = run.now + np.concatenate(([0.0], cum[:-1]))
    _log_span(run, seqs, n0, b0, k, dts)
    rec = run.recorder
    bs = alloc.block_size
    for j, s in enumerate(seqs):
        c0 = len(rec.start) if rec is not None else 0
        old = len(s.block_table)
        alloc.append_slots(s, k)
        s.num_generated += k
        if rec is not None and len(rec.start) > c0:
            # Each new block was taken at the step that wrote its first token.
            first_tok = (old + np.arange(len(rec.start) - c0)) * bs
            rec.t_start[c0:] = starts[first_tok - n0[j]].tolist()
    run.busy_s += float(cum[-1])
    run.batch_s += float(cum[-1]) * len(run.sched.running)
    run.set_clock(run.now + float(cum[-1]))
    run.step += k


def _log_span(run: _Run, seqs: list[Sequence], n0: np.ndarray, b0, k: int, dts: np.ndarray) -> None:
    """The exact time-weighted mean of each memory state over the span's steps."""
    alloc = run.alloc
    cap = b0.capacity
    steps = np.arange(1, k + 1, dtype=np.int64)
    b = len(seqs)
    tokens = b0.token_states + b * steps
    if isinstance(alloc, BlockManager):
        bs = alloc.block_size
        r = (-n0) % bs  # empty slots left in each sequence's last block
        first = r + 1  # step at which each sequence takes its first new block
        counts = np.where(first <= k, (k - first) // bs + 1, 0)
        delta = np.zeros(k + 2, np.int64)
        if counts.sum():
            starts_ = np.repeat(first, counts)
            offs = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
            np.add.at(delta, starts_ + offs * bs, 1)
        new = np.cumsum(delta)[steps]
        used = b0.allocated // bs + new
        final = np.fromiter((s.final_len for s in seqs), np.int64, b)
        fb, cb = -(-final // bs), -(-n0 // bs)
        gets_final = (fb > cb) & (first + bs * (fb - cb - 1) <= k)
        wdelta = np.zeros(k + 2, np.int64)
        np.add.at(wdelta, (first + bs * (fb - cb - 1))[gets_final], (fb * bs - final)[gets_final])
        allocated = used * bs
        internal = np.minimum(b0.internal_fragmentation + np.cumsum(wdelta)[steps], allocated - tokens)
        reservation = allocated - tokens - internal
        free = (alloc.num_blocks - used) * bs
        uncached = alloc.num_free_blocks - alloc.num_cached_free_blocks
        cached = b0.cached_free - np.maximum(0, new - uncached) * bs
        external = np.full(k, b0.external_fragmentation)
    else:
        allocated = np.full(k, b0.allocated)
        reservation = b0.reservation - b * steps
        internal = np.full(k, b0.internal_fragmentation)
        external = np.full(k, b0.external_fragmentation)
        free = np.full(k, b0.free)
        cached = np.zeros(k)
        used = allocated // alloc.block_size
    w = dts / dts.sum()
    fractions = {"token_states": float(tokens @ w) / cap, "reservation": float(reservation @ w) / cap,
                 "internal_fragmentation": float(internal @ w) / cap,
                 "external_fragmentation": float(external @ w) / cap, "free": float(free @ w) / cap}
    run.mem.add(run.step, k, run.now, float(dts.sum()), fractions, float(cached @ w) / cap,
                float(allocated @ w) / cap, run.counts(), b, int(used[-1]))

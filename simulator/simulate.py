"""The trace-driven simulation loop: `simulate(trace, config) -> SimResult`, pure (no files, no printing).

Step mode runs the shared Scheduler one step at a time. Fast mode (the default) does exactly the same,
except that where the next steps are certain to be plain decode steps of an unchanged batch (no arrival
that could be admitted, no completion, no block shortage, no prefill, no beam) it advances all of them
at once (`simulator/span.py`): same scheduling decisions, same per-request times.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from simulator.beam import beam_step
from simulator.config import SimConfig, make_allocator
from simulator.latency import make_latency_model, step_features
from simulator.recorder import EventRecorder, MemoryLog
from simulator.results import request_table, summarize
from simulator.scheduler import Scheduler, SchedulerOutput
from simulator.sequence import Sequence, SequenceGroup, SequenceStatus
from simulator.span import run_span, span_length
from traces.prefix import block_keys
from traces.schema import validate_trace


@dataclass
class SimResult:
    """Everything a run produced: per-request, per-step and per-tenure tables, and the summary."""

    config: dict
    summary: dict
    requests: pd.DataFrame
    memory: pd.DataFrame
    events: pd.DataFrame


class _Run:
    """Mutable state of one simulation (kept in one place so the loop below stays short)."""

    def __init__(self, trace: pd.DataFrame, config: SimConfig):
        self.cfg = config
        self.recorder = EventRecorder() if config.record_events else None
        self.alloc = make_allocator(config, self.recorder)
        self.block_size = self.alloc.block_size
        self.sched = Scheduler(config.scheduler_config(), self.alloc)
        self.latency = make_latency_model(
            "roofline" if config.latency == "roofline" else "fitted", config.model, config.gpu,
            path=None if config.latency == "roofline" else config.latency)
        self.rng = np.random.default_rng(config.seed)
        self.trace = trace
        self.arrival = trace["arrival_s"].to_numpy(np.float64)
        self.prompt = trace["prompt_len"].to_numpy(np.int64)
        self.output = trace["output_len"].to_numpy(np.int64)
        self.n = trace["n"].to_numpy(np.int64)
        self.beam = trace["beam_width"].to_numpy(np.int64)
        has_prefix = "prefix_blocks" in trace.columns and config.allocator == "paged"
        self.prefix = trace["prefix_blocks"].to_numpy() if has_prefix else None
        self.prefix_bs = trace["prefix_block_size"].to_numpy() if has_prefix else None
        num = len(trace)
        self.admitted = np.full(num, np.nan)
        self.first_token = np.full(num, np.nan)
        self.finish = np.full(num, np.nan)
        self.preemptions = np.zeros(num, np.int64)
        self.rejected = np.zeros(num, bool)
        self.hit_tokens = np.zeros(num, np.int64)
        self.mem = MemoryLog()
        self.now = 0.0
        self.step = 0
        self.next = 0
        self.next_seq_id = 0
        self.busy_s = 0.0
        self.batch_s = 0.0  # integral of the number of running requests over busy time

    def new_seq_id(self) -> int:
        """A fresh sequence id."""
        self.next_seq_id += 1
        return self.next_seq_id

    def make_group(self, i: int) -> SequenceGroup:
        """The sequence group of request row `i` (n samples or a beam share the prompt)."""
        p, o = int(self.prompt[i]), int(self.output[i])
        keys = ()
        if self.prefix is not None and isinstance(self.prefix[i], (list, tuple, np.ndarray)):
            keys = block_keys(self.prefix[i], int(self.prefix_bs[i]), self.block_size, p)
        width = int(self.beam[i]) if self.beam[i] > 1 else int(self.n[i])
        seqs = [Sequence(self.new_seq_id(), p, p + o - 1, request_id=i, prefix_keys=keys)
                for _ in range(width)]
        return SequenceGroup(i, seqs, float(self.arrival[i]), n=int(self.n[i]), beam_width=int(self.beam[i]))

    def head(self) -> SequenceGroup | None:
        """The request at the head of the waiting queue."""
        return self.sched.waiting[0] if self.sched.waiting else None

    def counts(self) -> tuple[int, int, int]:
        """Running, waiting and swapped requests."""
        s = self.sched
        return len(s.running), len(s.waiting), len(s.swapped)

    def set_clock(self, t: float) -> None:
        """Advance simulated time (and the event recorder's clock)."""
        self.now = t
        if self.recorder is not None:
            self.recorder.now = t


def simulate(trace: pd.DataFrame, config: SimConfig,
             progress: Callable[[int, int], None] | None = None) -> SimResult:
    """Replay `trace` against the configured allocator and scheduler."""
    wall0 = time.perf_counter()
    trace = validate_trace(trace, source="trace")
    run = _Run(trace, config)
    num = len(trace)
    fast = config.mode == "fast"
    last_report = 0
    while run.next < num or run.sched.has_unfinished():
        while run.next < num and run.arrival[run.next] <= run.now:
            run.sched.add_request(run.make_group(run.next))
            run.next += 1
        if not run.sched.has_unfinished():
            _idle_until(run, float(run.arrival[run.next]))
            continue
        if fast:
            k, dts = span_length(run)
            if k:
                run_span(run, k, dts)
                _finish_done(run, [g for g in run.sched.running])
                continue
        out = run.sched.schedule()
        _bookkeep(run, out)
        if out.is_empty:
            if out.rejected:
                continue
            if run.next < num:
                _idle_until(run, float(run.arrival[run.next]))
                continue
            raise RuntimeError("scheduler stalled with work left and no future arrival (a bug)")
        dt = _step_time(run, out)
        run.mem.add_breakdown(run.step, run.now, dt, run.alloc.breakdown(run.head()), run.counts(),
                              out.num_batched_tokens, run.block_size)
        run.busy_s += dt
        run.batch_s += dt * len(run.sched.running)
        run.set_clock(run.now + dt)
        run.step += 1
        run.sched.commit(out)
        _sample(run, out)
        if progress is not None and run.step - last_report >= 2000:
            last_report = run.step
            progress(int(np.count_nonzero(~np.isnan(run.finish) | run.rejected)), num)
    if progress is not None:
        progress(num, num)
    return _result(run, time.perf_counter() - wall0)


def _idle_until(run: _Run, t: float) -> None:
    """Nothing to run until the next arrival: record the idle gap (it counts in time-weighted means)."""
    if t > run.now:
        run.mem.add_breakdown(run.step, run.now, t - run.now, run.alloc.breakdown(run.head()), run.counts(),
                              0, run.block_size, num_steps=0)
    run.set_clock(max(t, run.now))


def _bookkeep(run: _Run, out: SchedulerOutput) -> None:
    for g in out.rejected:
        run.rejected[g.request_id] = True
    for g in out.admitted:
        i = g.request_id
        if math.isnan(run.admitted[i]):
            run.admitted[i] = run.now
            run.hit_tokens[i] = run.sched.hit_tokens.get(i, 0)
    for g in out.preempted:
        run.preemptions[g.request_id] += 1


def _step_time(run: _Run, out: SchedulerOutput) -> float:
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


def _sample(run: _Run, out: SchedulerOutput) -> None:
    """Every group that computed logits this step samples one token per live sequence."""
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
    _finish_done(run, touched)


def _finish_done(run: _Run, groups: list[SequenceGroup]) -> None:
    """Free requests that reached their output length; fork/prune the beams that go on."""
    for g in groups:
        i = g.request_id
        live = [s for s in g.seqs if s.status is not SequenceStatus.FINISHED]
        if not live:
            continue
        if live[0].num_generated >= run.output[i]:
            for s in live:
                run.sched.finish_seq(s)
            run.finish[i] = run.now
        elif g.beam_width > 1:
            beam_step(g, run.alloc, run.rng, run.new_seq_id, run.cfg.beam_alpha)
    run.sched.remove_finished()


def _result(run: _Run, wall_s: float) -> SimResult:
    config = run.cfg.to_dict()
    requests = request_table(run)
    memory = run.mem.to_frame()
    events = run.recorder.to_frame(run.now) if run.recorder is not None else pd.DataFrame(
        {c: pd.Series(dtype=t) for c, t in (("request_id", "int64"), ("start", "int64"), ("size", "int64"),
                                             ("t_start_s", "float64"), ("t_end_s", "float64"),
                                             ("max_ref_count", "int64"), ("filled", "int64"))})
    summary = summarize(run, requests, memory, wall_s)
    return SimResult(config=config, summary=summary, requests=requests, memory=memory, events=events)

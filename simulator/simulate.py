"""The trace-driven simulation loop: `simulate(trace, config) -> SimResult`, pure (no files, no printing).

Step mode runs the shared Scheduler one step at a time (simulator/stepping.py): the reference. Fast mode
(the default) makes exactly the same decisions, with the same per-request times and block tenures, in
O(what changes) per step instead of O(running requests): while every running request is a plain decode
(simulator/decode_batch.py keeps their counts lazily), a step that preempts nobody is taken by
simulator/fast.py (appends in bulk, admissions by the Scheduler itself), and a run of steps that cannot
change any decision (no admission possible, no completion, no block shortage, no arrival) collapses into
one span (simulator/span.py). Anything else - preemption, swapping, beams, parallel samples, chunked
prefills in flight - is an exact step, after the batch has written its counts back to the objects.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from simulator.core.scheduler import Scheduler
from simulator.core.sequence import Sequence, SequenceGroup
from simulator.decode_batch import DecodeBatch
from simulator.fast import fast_step, finish_batch
from simulator.recorder import EventRecorder, MemoryLog
from simulator.results import request_table, summarize
from simulator.sim_config import SimConfig, make_allocator
from simulator.span import run_span, span_length
from simulator.step_latency import make_latency_model
from simulator.stepping import exact_step
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
    """Mutable state of one simulation (kept in one place so the loops stay short)."""

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
        # Plain-list copies: the loops index them one request at a time, which numpy does slowly.
        self.arrival_s: list[float] = self.arrival.tolist()
        self.output_len: list[int] = self.output.tolist()
        self._prompt_len: list[int] = self.prompt.tolist()
        self._width: list[int] = np.where(self.beam > 1, self.beam, self.n).tolist()
        has_prefix = "prefix_blocks" in trace.columns and config.allocator == "paged"
        self.prefix = trace["prefix_blocks"].to_numpy() if has_prefix else None
        self.prefix_bs = trace["prefix_block_size"].to_numpy() if has_prefix else None
        self.num_requests = num = len(trace)
        self.admitted = np.full(num, np.nan)
        self.first_token = np.full(num, np.nan)
        self.finish = np.full(num, np.nan)
        self.preemptions = np.zeros(num, np.int64)
        self.rejected = np.zeros(num, bool)
        self.hit_tokens = np.zeros(num, np.int64)
        self.num_done = 0  # finished or rejected requests
        self.mem = MemoryLog()
        self.now = 0.0
        self.step = 0
        self.next = 0
        self.next_seq_id = 0
        self.busy_s = 0.0
        self.batch_s = 0.0  # integral of the number of running requests over busy time
        self.batch = DecodeBatch(self)
        self.blocked_head: SequenceGroup | None = None  # head of the queue after the last fast step

    def new_seq_id(self) -> int:
        """A fresh sequence id."""
        self.next_seq_id += 1
        return self.next_seq_id

    def make_group(self, i: int) -> SequenceGroup:
        """The sequence group of request row `i` (n samples or a beam share the prompt)."""
        p = self._prompt_len[i]
        final = p + self.output_len[i] - 1
        keys = ()
        if self.prefix is not None and isinstance(self.prefix[i], (list, tuple, np.ndarray)):
            keys = block_keys(self.prefix[i], int(self.prefix_bs[i]), self.block_size, p)
        seqs = [Sequence(self.new_seq_id(), p, final, request_id=i, prefix_keys=keys)
                for _ in range(self._width[i])]
        return SequenceGroup(i, seqs, self.arrival_s[i], n=int(self.n[i]), beam_width=int(self.beam[i]))

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

    def idle_until(self, t: float) -> None:
        """Nothing to run until the next arrival: record the idle gap (it counts in time-weighted means)."""
        if t > self.now:
            self.mem.add_breakdown(self.step, self.now, t - self.now, self.alloc.breakdown(self.head()),
                                   self.counts(), 0, self.block_size, num_steps=0)
        self.set_clock(max(t, self.now))


def simulate(trace: pd.DataFrame, config: SimConfig,
             progress: Callable[[int, int], None] | None = None,
             observer: Callable[[_Run], None] | None = None) -> SimResult:
    """Replay `trace` against the configured allocator and scheduler.

    `observer`, if given, is called with the run state after every loop iteration (a step, or a span in
    fast mode); it must not change anything.
    """
    wall0 = time.perf_counter()
    trace = validate_trace(trace, source="trace")
    run = _Run(trace, config)
    num = run.num_requests
    sched, batch, arrival = run.sched, run.batch, run.arrival_s
    fast = config.mode == "fast"
    next_report = 2000
    while run.next < num or sched.has_unfinished():
        while run.next < num and arrival[run.next] <= run.now:
            sched.add_request(run.make_group(run.next))
            run.next += 1
        if not sched.has_unfinished():
            run.idle_until(arrival[run.next])
            continue
        if fast and (batch.active or batch.activate()):
            # A request that just joined the queue is usually admitted at once: try that step first.
            k = 0
            if not sched.waiting or sched.waiting[0] is run.blocked_head:
                k, timing = span_length(run)
            if k:
                run_span(run, k, timing)
                done = finish_batch(run)
                if done:
                    sched.remove_groups(done)
            elif not fast_step(run):
                exact_step(run)
        else:
            exact_step(run)
        if observer is not None:
            observer(run)
        if progress is not None and run.step >= next_report:
            next_report = run.step + 2000
            progress(run.num_done, num)
    if progress is not None:
        progress(num, num)
    batch.deactivate()
    return _result(run, time.perf_counter() - wall0)


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

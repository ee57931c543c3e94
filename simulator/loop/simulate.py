"""The trace-driven simulation: `simulate(trace, config, output) -> RunResult`, and the driver loop it
shares with the engine's replay (`drive`).

Step mode runs the shared Scheduler one step at a time (`exact_step`): the reference. Fast mode (the
default) makes exactly the same decisions, with the same per-request times and block tenures, in O(what
changes) per step: while every running request is a plain decode, a step that preempts nobody is the
scheduler's `decode_step`, and a run of steps that cannot change any decision (no admission possible, no
completion, no block shortage, no arrival) collapses into one span (both in loop/step.py). Anything
else (preemption, swapping, beams, parallel samples, chunked prefills in flight) is an exact step.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from pagelab.column_stats import GapHistogram
from pagelab.malloc import release_free_memory
from simulator.config import SimConfig
from simulator.core.scheduler import Scheduler, SchedulerOutput
from simulator.loop.state import RunState, SimState
from simulator.loop.step import exact_step, fast_step, finish_batch, run_span, span_length
from simulator.metrics import add_latencies, run_summary
from simulator.output import InMemory, RunOutput
from simulator.output.request_rows import RequestColumns
from simulator.timing.step_latency import make_latency_model
from traces.batches import FrameBatches, TraceBatches
from traces.prefix import check_block_size
from traces.schema import canonical_trace

PROGRESS_STEPS = 2000  # loop iterations between progress reports


@dataclass
class RunResult:
    """What a run produced: its config and summary, and its tables (DataFrames when kept in memory, None
    when written to a run folder; `request_columns` reads the request table a column at a time either
    way). A replay adds `steps`, one row per engine step."""

    config: dict
    summary: dict
    requests: pd.DataFrame | None
    memory: pd.DataFrame | None
    events: pd.DataFrame | None
    num_events: int = 0
    request_columns: RequestColumns | None = None
    steps: pd.DataFrame | None = None
    transitions: pd.DataFrame | None = None  # None: written to the run folder (or not recorded)
    refcounts: pd.DataFrame | None = None  # likewise
    itl: GapHistogram | None = None  # every inter-token gap (None: a table made elsewhere)

    def request_data(self) -> pd.DataFrame | RequestColumns:
        """The request table: in memory, or read from its file a column at a time."""
        return self.requests if self.requests is not None else self.request_columns


def drive(run: RunState, advance: Callable[[RunState], SchedulerOutput | None],
          progress: Callable[[int, int], None] | None = None,
          observer: Callable[[RunState], None] | None = None, report_every: int = PROGRESS_STEPS) -> None:
    """Run every request to the end: arrivals join the queue, idle gaps jump to the next arrival, and
    `advance` takes the next step (or span), returning its schedule when the step may have been empty.
    `progress(done, total)` is called every `report_every` steps and at the end."""
    num = run.num_requests
    next_report = report_every
    sched = run.sched
    while run.next < num or sched.has_unfinished():
        if run.next_arrival <= run.now:
            run.arrive_until(run.now)
        if not sched.has_unfinished():
            run.idle_until(run.next_arrival)
            continue
        out = advance(run)
        # A group that preempted itself in an empty step comes back next step: no idling until an arrival.
        if out is not None and out.is_empty and not out.rejected and not out.preempted:
            if run.next >= num:
                raise RuntimeError("scheduler stalled with work left and no future arrival (a bug)")
            run.idle_until(run.next_arrival)
        if run.events is not None:
            run.drain_events()
        if observer is not None:
            observer(run)
        if progress is not None and run.step >= next_report:
            next_report = run.step + report_every
            progress(run.num_done, num)
    if progress is not None:
        progress(num, num)


def _fast_advance(run: SimState) -> SchedulerOutput | None:
    """Fast mode's next move: a span of decode steps, a decode step, or an exact step."""
    sched = run.sched
    if sched.decode_ready():
        k = 0
        # A request that just joined the queue is usually admitted at once: try that step first.
        if not sched.waiting or sched.waiting[0] is run.blocked_head:
            k, timing = span_length(run)
        if k:
            run_span(run, k, timing)
            done = finish_batch(run)
            if done:
                sched.finish_groups(done)
            return None
        if fast_step(run):
            return None
    return exact_step(run)


def start(trace: TraceBatches, config: SimConfig, output: RunOutput, fast: bool) -> SimState:
    """The state at time 0 of simulating the (validated) `trace` under `config` into `output` (`fast`:
    the scheduler keeps a decode batch)."""
    alloc = config.build_allocator()
    fitted = config.latency != "roofline"
    latency = make_latency_model("fitted" if fitted else "roofline", config.model, config.gpu,
                                 path=config.latency if fitted else None, block_size=config.block_size,
                                 kv_bytes_per_token=config.bytes_per_token)
    output_len: dict[int, int] = {}  # the decode batch's, filled as requests are built
    sched = Scheduler(config.scheduler_config(), alloc, output_len if fast else None)
    return SimState(allocator=config.allocator, enable_prefix_caching=config.enable_prefix_caching,
                    alloc=alloc, sched=sched, output=output, source=trace, latency=latency,
                    rng=np.random.default_rng(config.seed), beam_alpha=config.beam_alpha,
                    output_len=output_len)


def simulate(trace: pd.DataFrame | TraceBatches, config: SimConfig, output: RunOutput | None = None, *,
             progress: Callable[[int, int], None] | None = None,
             observer: Callable[[RunState], None] | None = None, step_times=None) -> RunResult:
    """Replay `trace` against the configured allocator and scheduler; the tables go to `output` (default:
    kept in memory and returned as DataFrames; a `RunFolder` writes them as the run goes).

    `observer`, if given, is called with the run state after every loop iteration (a step, or a span in
    fast mode); it must not change anything. `step_times` (MeasuredSteps), if given, replaces the latency
    model with a replay's measured step times and forces step mode. `trace` is a DataFrame (validated
    here) or a TraceBatches already validated (a file read a batch of rows at a time).
    """
    wall0 = time.perf_counter()
    if not isinstance(config, SimConfig):
        raise TypeError(f"config must be a SimConfig, got {type(config).__name__}")
    if output is not None and not isinstance(output, RunOutput):
        raise TypeError(f"output must be a RunOutput (InMemory or RunFolder), got {type(output).__name__}")
    if not isinstance(trace, TraceBatches):
        trace = FrameBatches(canonical_trace(trace, source="trace"))
    output = InMemory() if output is None else output
    fast = config.mode == "fast" and step_times is None
    run = start(trace, config, output, fast)
    fast = fast and run.sched.decode is not None
    run.measured = step_times
    # The loop allocates millions of small objects and makes no reference cycles, so the cyclic collector
    # would only re-scan the ever larger heap of live requests: refcounting frees everything. It stays off
    # until the run state is gone, so that no collection walks the millions of keys a KV tier holds.
    gc_enabled = gc.isenabled()
    gc.disable()
    try:
        try:
            keyed = isinstance(trace, FrameBatches) and "prefix_block_size" in trace.columns
            if keyed and run.uses_prefix_keys:
                check_block_size(trace.frame, run.block_size)  # not when its first request arrives
            drive(run, _fast_advance if fast else exact_step, progress, observer)
            if run.sched.decode is not None:
                run.sched.decode.deactivate()
            run.drain_events(final=True)
            kept = output.close()
        except BaseException:
            output.abort()
            raise
        summary = run_summary(run, kept, time.perf_counter() - wall0)
        itl = run.itl
        itl.flush()
        # The run's one reference cycle (its queue builds groups through it), broken: the state is freed as
        # soon as it is dropped, before the statistics read the request table again.
        run.queue.close()
        del run
    finally:
        if gc_enabled:
            gc.enable()
    release_free_memory()
    add_latencies(summary, kept.requests)
    return RunResult(config=config.to_dict(), summary=summary, requests=kept.requests.frame,
                     memory=kept.memory, events=kept.events, num_events=kept.num_events,
                     request_columns=kept.requests, transitions=kept.transitions, refcounts=kept.refcounts,
                     itl=itl)

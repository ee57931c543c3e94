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

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from pagelab.memory import map_large_blocks, release_free_memory
from simulator.fast import fast_step, finish_batch
from simulator.measured_steps import MeasuredSteps
from simulator.request_log import RequestColumns
from simulator.results import add_latencies, run_summary
from simulator.sim_config import SimConfig
from simulator.sim_state import SimState
from simulator.sinks import EventSink, FrameSink, TableSink, empty_events
from simulator.span import run_span, span_length
from simulator.stepping import exact_step
from traces.chunks import FrameChunks, TraceChunks
from traces.schema import canonical_trace


@dataclass
class SimResult:
    """Everything a run produced: per-request, per-step and per-tenure tables, and the summary.

    `events` (`memory`, `requests`) is None when the tenures (memory rows, request rows) were streamed to
    a file sink (`simulate(..., events=sink, memory=sink, requests=sink)`); `num_events` counts the
    tenures either way, and `request_columns` reads the request table a column at a time either way.
    """

    config: dict
    summary: dict
    requests: pd.DataFrame | None
    memory: pd.DataFrame | None
    events: pd.DataFrame | None
    num_events: int = 0
    request_columns: RequestColumns | None = None

    def request_data(self) -> pd.DataFrame | RequestColumns:
        """The request table: in memory, or (streamed) read from its file a column at a time."""
        return self.requests if self.requests is not None else self.request_columns


def simulate(trace: pd.DataFrame | TraceChunks, config: SimConfig,
             progress: Callable[[int, int], None] | None = None,
             observer: Callable[[SimState], None] | None = None,
             step_times: MeasuredSteps | None = None,
             events: EventSink | None = None, memory: TableSink | None = None,
             requests: TableSink | None = None) -> SimResult:
    """Replay `trace` against the configured allocator and scheduler.

    `observer`, if given, is called with the run state after every loop iteration (a step, or a span in
    fast mode); it must not change anything. `step_times`, if given, replaces the latency model with a
    replay's measured step times (simulator/measured_steps.py) and forces step mode. `events`, if given
    (and config.record_events), receives the tenures as the run goes (e.g. a ParquetEventSink writing the
    run folder's events table, or a ProcessEventSink pairing and writing them in a child process:
    simulator/event_process.py) and is closed at the end; without it they come back as a DataFrame.
    `memory`, likewise, receives the per-step memory rows (`simulator.sinks.open_table_sink`);
    SimResult.memory is then None; `requests` receives the request rows in trace order
    (`simulator.sinks.open_table_sink`), SimResult.requests is then None. `trace` is a DataFrame
    (validated here) or a TraceChunks already validated (traces.chunks: a file read a block at a time).
    """
    wall0 = time.perf_counter()
    if not isinstance(trace, TraceChunks):
        trace = FrameChunks(canonical_trace(trace, source="trace"))
    map_large_blocks()  # see pagelab/memory.py: without it RSS grows with the run's length
    release_free_memory()  # what reading and checking the trace freed (~45 MB kept after a 10M-row check)
    run = SimState.start(trace, config, events, memory, requests)
    run.measured = step_times
    # The loop allocates millions of small objects (requests, sequences, block tables) and makes no
    # reference cycles, so the cyclic collector would only re-scan the ever larger heap of live requests
    # (~15% of a 400k-request run's time): refcounting frees everything; the collector resumes after.
    gc_enabled = gc.isenabled()
    gc.disable()
    try:
        _loop(run, config, step_times, observer, progress)
    except BaseException:
        if run.recorder is not None:
            run.recorder.abort()
        elif hasattr(events, "abort"):
            events.abort()  # an events process that hosts the tables (simulator/event_process.py)
        run.log.sink.close()
        raise
    finally:
        if gc_enabled:
            gc.enable()
    result = _result(run, events, time.perf_counter() - wall0)
    # Free the run's state (scheduler, block tables, trace cursors) before the statistics read the request
    # table again, so they reuse its memory instead of adding to it (`_result` broke its one cycle).
    del run
    release_free_memory()
    add_latencies(result.summary, result.request_columns)
    return result


def _loop(run: SimState, config: SimConfig, step_times: MeasuredSteps | None,
          observer: Callable[[SimState], None] | None, progress: Callable[[int, int], None] | None) -> None:
    """Run every request to the end (the batch settled)."""
    num = run.num_requests
    sched, batch = run.sched, run.batch
    fast = config.mode == "fast" and step_times is None
    next_report = 2000
    while run.next < num or sched.has_unfinished():
        if run.next_arrival <= run.now:
            run.arrive_until(run.now)
        if not sched.has_unfinished():
            run.idle_until(run.next_arrival)
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


def _result(run: SimState, events_sink: EventSink | None, wall_s: float) -> SimResult:
    config = run.cfg.to_dict()
    # The tables first, the events last: the events process may be writing the other two (HostedTable).
    request_sink = run.log.finish_run()
    frame = request_sink.frame() if isinstance(request_sink, FrameSink) else None
    columns = RequestColumns(run.log.totals, frame=frame, path=getattr(request_sink, "path", None))
    run.mem.finish()
    memory = run.mem.to_frame()
    events, num_events = empty_events(), 0
    if run.recorder is not None:
        sink = run.recorder.finish(run.now)
        events = sink.frame() if isinstance(sink, FrameSink) else None
        num_events = sink.num_rows
    elif events_sink is not None:
        events_sink.close()  # nothing recorded: the file still gets its (empty) table
    summary = run_summary(run, columns.totals, memory, wall_s)  # its latencies come once the run is freed
    # The run's one reference cycle (its queue builds groups through it), broken: the state is freed as
    # soon as simulate() drops it. Left to the cyclic collector, it outlived the CLI's serving metrics.
    run.queue.close()
    return SimResult(config=config, summary=summary, requests=frame, memory=memory, events=events,
                     num_events=num_events, request_columns=columns)

"""A run in progress: what the simulation and the engine replay record alike (`RunState`), the simulation's
own state (`SimState`), and its waiting queue of trace rows built on demand (`WaitingQueue`)."""
from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from pagelab.column_stats import GapHistogram
from simulator.core.allocator import KVAllocator, MemoryBreakdown
from simulator.core.scheduler import Scheduler, SchedulerOutput
from simulator.core.sequence import Sequence, SequenceGroup, SequenceStatus
from simulator.output import RunOutput
from simulator.output.memory_rows import MemoryRows
from simulator.output.request_rows import PREEMPTED, SWAPPED_IN, SWAPPED_OUT, RequestRows
from traces.batches import TraceBatches
from traces.prefix import block_keys
from traces.schema import PREFIX_COLUMNS

_ROWS_AT_ONCE = 4096  # trace rows copied to Python at a time (building requests; the arrival times)
_BUILD_COLUMNS = ("request_id", "arrival_s", "prompt_len", "output_len", "n", "beam_width")


@dataclass(eq=False)
class RunState:
    """One run's allocator and scheduler, what happened to each request in flight, and its clocks.

    Per-request results (admission, first token, finish, preemptions, rejection, prefix hit) are written
    by trace row into `log` (the output's RequestRows) and leave it when the request is retired.
    """

    allocator: str  # the allocator's registry name (config)
    enable_prefix_caching: bool
    alloc: KVAllocator
    sched: Scheduler
    output: RunOutput
    now: float = 0.0  # the run's clock (simulated or measured)
    step: int = 0  # steps run so far
    busy_s: float = 0.0  # time spent in steps
    batch_s: float = 0.0  # integral of the number of running requests over busy time
    num_done: int = 0  # finished or rejected requests
    next: int = 0  # the next trace row to arrive
    next_arrival: float = math.inf  # its arrival time
    num_requests: int = 0  # rows of the trace

    def __post_init__(self) -> None:
        # A pool split into KV cache groups (the grouped allocator has a layout) logs what they waste too.
        self.mem: MemoryRows = self.output.memory_rows(getattr(self.alloc, "layout", None) is not None)
        log: RequestRows = self.output.request_rows()
        self.log = log
        # The tables' buffers keep one phase: the memory rows go on halfway through each request row group.
        log.midway = self.mem.flush
        self.admitted, self.first_token, self.finish = log.admitted, log.first_token, log.finish
        self.preemptions, self.rejected, self.hit_tokens = log.preemptions, log.rejected, log.hit_tokens
        self.transitions = self.output.transition_rows()
        self.refcounts = self.output.ref_count_rows()
        self.itl = GapHistogram()  # every inter-token gap (vLLM's ITL), pooled
        self.paused: dict[int, float] = {}  # a preempted request's last token time, until its next token
        self.events = self.alloc.events
        self._event_batch = self.output.sizes.tenure_batch
        # Read every step: plain attributes. The allocator's block size (1 for contiguous regions), and
        # the slots one block counts for in its breakdown: the block size, times the layers per group
        # where a grouped pool counts layer slots (simulator/core/paged/kv_groups.py).
        self.block_size: int = self.alloc.block_size
        self.block_slots: int = getattr(self.alloc, "block_slots", self.alloc.block_size)

    def head(self) -> SequenceGroup | None:
        """The request at the head of the waiting queue."""
        return self.sched.waiting[0] if self.sched.waiting else None

    def counts(self) -> tuple[int, int, int]:
        """Running, waiting and swapped requests."""
        s = self.sched
        return len(s.running), len(s.waiting), len(s.swapped)

    def set_clock(self, t: float) -> None:
        """Advance the run's clock (and the allocation log's)."""
        self.now = t
        if self.events is not None:
            self.events.now = t

    def drain_events(self, final: bool = False) -> None:
        """Hand the output the allocation events logged so far once there are enough of them (all of them,
        those still held ending now, when `final`)."""
        events = self.events
        if events is None:
            return
        if events.rc_t:
            self.refcounts.extend(*events.take_ref_changes())
        if final or events.num_acquired - events.first_unread >= self._event_batch:
            raw, first = events.take()
            self.output.tenures(raw, first, None if final else self.now, self.now)

    def retire(self, i: int) -> None:
        """Request row `i` finished or was rejected: its result row is complete."""
        self.log.close(i)

    def record_schedule(self, out: SchedulerOutput, now: float, last_token_s: float | None = None) -> None:
        """What a schedule decision means per request: rejections, first admissions, preemptions (a
        preempted request's last token came at `last_token_s`, the end of the step before; default `now`)."""
        for g in out.rejected:
            self.rejected[g.request_id] = True
            self.paused.pop(g.request_id, None)  # the gaps it had (a refused re-admission) stay pooled
            self.num_done += 1
        for g in out.admitted:
            i = g.request_id
            if math.isnan(self.admitted[i]):
                self.admitted[i] = now
                self.hit_tokens[i] = g.prefix_hit_tokens or 0
        for g in out.preempted:
            i = g.request_id
            self.preemptions[i] += 1
            if not math.isnan(self.first_token[i]):  # its next gap runs from its last token
                self.paused.setdefault(i, now if last_token_s is None else last_token_s)
            swapped = any(s.status is SequenceStatus.SWAPPED for s in g.seqs)
            self.transitions.add(g.request_id, now, SWAPPED_OUT if swapped else PREEMPTED)
        for g in out.swapped_in:
            self.transitions.add(g.request_id, now, SWAPPED_IN)
        for g in out.rejected:
            self.retire(g.request_id)

    def add_gaps(self, sampled: list[int], gap: float) -> None:
        """Requests `sampled` each sampled a token, not their first, at `now`: a gap of `gap` (the step's)
        for those that ran in the step before, of now - their last token for those back from a preemption."""
        paused, continuing = self.paused, len(sampled)
        if paused:
            for i in sampled:
                if i in paused:
                    self.itl.add(self.now - paused.pop(i))
                    continuing -= 1
        if continuing:
            self.itl.add(gap, continuing)

    def record_idle(self, start: float, end: float) -> None:
        """Nothing runs from `start` to `end`: log the gap (it counts in time-weighted means)."""
        if end > start:
            self.mem.add_breakdown(self.step, 0, start, end - start, self.alloc.breakdown(self.head()),
                                   self.counts(), 0, self.block_slots)

    def record_step(self, start: float, dt: float, breakdown: MemoryBreakdown, counts: tuple[int, int, int],
                    num_batched_tokens: int) -> None:
        """Log one step of `dt` seconds from `start` (memory as scheduled) and count it."""
        self.mem.add_breakdown(self.step, 1, start, dt, breakdown, counts, num_batched_tokens,
                               self.block_slots)
        self.add_busy(dt, counts[0], 1)

    def add_busy(self, dt: float, num_running: int, num_steps: int) -> None:
        """Count `num_steps` steps taking `dt` seconds in all with `num_running` requests running."""
        self.busy_s += dt
        self.batch_s += dt * num_running
        self.step += num_steps


class WaitingQueue(deque):
    """The scheduler's waiting queue: groups already built, then arrived trace rows [next_row, end_row)
    built only when they reach the head.

    An overloaded trace keeps millions of requests waiting, yet the scheduler only ever looks at the head
    (FCFS; preempted groups go back to the front): same order, same decisions, and the queue's objects
    stay bounded by the requests that were preempted back into it. Whenever a row is pending the head is
    built, so the deque's own truth test and `[0]` (C calls, asked several times a step) answer for the
    whole queue; `len()` counts the built groups only, `num_waiting` every arrived one.
    """

    __slots__ = ("_make", "next_row", "end_row")

    def __init__(self, make_group: Callable[[int], SequenceGroup], start_row: int = 0):
        super().__init__()
        self._make = make_group
        self.next_row = start_row  # the first trace row not yet built
        self.end_row = start_row  # rows before this one have arrived

    @property
    def num_waiting(self) -> int:
        """Groups waiting, the pending rows included."""
        return len(self) + self.end_row - self.next_row

    def arrive(self, end_row: int) -> None:
        """Rows up to `end_row` (exclusive) have arrived: they queue behind everything else."""
        self.end_row = end_row
        if not self and self.next_row < end_row:
            self._build()

    def _build(self) -> None:
        deque.append(self, self._make(self.next_row))
        self.next_row += 1

    def close(self) -> None:
        """No row will be built any more: drop the builder, which refers back to the run (the run's one
        reference cycle), so that a finished run is freed as soon as it is dropped."""
        self._make = None

    def popleft(self) -> SequenceGroup:
        """Take the head (the next pending row becomes the head)."""
        group = deque.popleft(self)
        if not self and self.next_row < self.end_row:
            self._build()
        return group

    def append(self, group: SequenceGroup) -> None:
        """Queue a group at the tail (only while no row is pending)."""
        if self.next_row < self.end_row:
            raise RuntimeError("cannot queue a group behind trace rows that are still pending")
        deque.append(self, group)

    def __iter__(self) -> Iterator[SequenceGroup]:
        """Every waiting group, in order (this builds the pending rows)."""
        while self.next_row < self.end_row:
            self._build()
        return deque.__iter__(self)


@dataclass(eq=False)
class SimState(RunState):
    """A simulation in progress (`simulator.loop.simulate` builds it).

    The trace is read a batch of rows at a time by two cursors: one over the arrival times (which rows
    have arrived), one building requests in row order as they reach the head of the queue. So the state
    holds no per-row array as long as the trace.
    """

    source: TraceBatches | None = None
    latency: object = None  # the step-latency model (simulator/timing/step_latency.py)
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    beam_alpha: float = 0.5
    next_seq_id: int = 0
    blocked_head: SequenceGroup | None = None  # head of the queue after the last fast step
    measured: object = None  # replay step times that replace the latency model (MeasuredSteps)
    output_len: dict[int, int] = field(default_factory=dict)  # of the requests built and not retired

    def __post_init__(self) -> None:
        super().__post_init__()
        self.num_requests = self.source.num_rows
        has_prefix = "prefix_blocks" in self.source.columns and self.uses_prefix_keys
        self._build_columns = _BUILD_COLUMNS + (PREFIX_COLUMNS if has_prefix else ())
        self._build_batches = self.source.iter_batches(self._build_columns, _ROWS_AT_ONCE)
        self._rows: tuple[list, ...] = ()
        self._rows_start = self._rows_end = 0
        # Small batches: the arrival cursor lives until the last arrival, half a long overloaded run.
        self._arrival_batches = self.source.iter_batches(("arrival_s",), _ROWS_AT_ONCE)
        self._arrival: list[float] = []  # the arrival cursor's batch (a list: bisect beats numpy calls)
        self._arrival_start = 0
        self._next_arrival_batch()
        self.queue = WaitingQueue(self.make_group)
        self.sched.waiting = self.queue

    @property
    def uses_prefix_keys(self) -> bool:
        """Whether the trace's prefix keys reach the allocator: only a paged one that caches prefixes
        reads them (without caching, keys a block size cannot reuse are no reason to refuse a run)."""
        return self.allocator == "paged" and self.enable_prefix_caching

    def new_seq_id(self) -> int:
        """A fresh sequence id."""
        self.next_seq_id += 1
        return self.next_seq_id

    def _next_arrival_batch(self) -> bool:
        """Move the arrival cursor to the next batch of rows; False at the end of the trace."""
        self._arrival_start += len(self._arrival)
        self._arrival = []  # the old batch goes before the next is read: one batch alive, not two
        batch = next(self._arrival_batches, None)
        self._arrival = batch["arrival_s"].tolist() if batch is not None else []
        self.next_arrival = self._arrival[0] if self._arrival else math.inf
        return batch is not None

    def arrive_until(self, t: float) -> None:
        """Every row arriving at or before `t` joins the waiting queue (as a row, built when reached)."""
        while True:
            # Arrivals are sorted (validated); rows before the cursor have arrived already.
            j = bisect_right(self._arrival, t, self.next - self._arrival_start)
            if j < len(self._arrival):
                self.next = self._arrival_start + j
                self.next_arrival = self._arrival[j]
                break
            self.next = self._arrival_start + j
            if not self._next_arrival_batch():
                break
        self.queue.arrive(self.next)

    def make_group(self, i: int) -> SequenceGroup:
        """The sequence group of request row `i` (n samples or a beam share the prompt); rows are built
        in order, each once."""
        if i >= self._rows_end:
            self._load_rows(i)
        j = i - self._rows_start
        rows = self._rows
        rid, arrival, p, out, n, beam = rows[0][j], rows[1][j], rows[2][j], rows[3][j], rows[4][j], rows[5][j]
        self.log.open(i, (rid, arrival, p, out, n, beam))
        self.output_len[i] = out
        final = p + out - 1
        keys = ()
        if len(rows) > 6 and isinstance(rows[6][j], (list, tuple, np.ndarray)):
            keys = block_keys(rows[6][j], int(rows[7][j]), self.block_size, p)
        width = beam if beam > 1 else n
        seqs = [Sequence(self.new_seq_id(), p, final, request_id=i, prefix_keys=keys) for _ in range(width)]
        return SequenceGroup(i, seqs, arrival, n=n, beam_width=beam)

    def _load_rows(self, i: int) -> None:
        """Python copies of the next batch of rows (the one holding row `i`)."""
        self._rows = ()  # as in _next_arrival_batch
        batch = next(self._build_batches)
        self._rows_start = self._rows_end
        self._rows = tuple(batch[c].tolist() for c in self._build_columns)
        self._rows_end = self._rows_start + len(self._rows[0])
        if not self._rows_start <= i < self._rows_end:
            raise RuntimeError(f"request row {i} built out of order (next batch: rows {self._rows_start}.."
                               f"{self._rows_end - 1})")

    def counts(self) -> tuple[int, int, int]:
        """Running, waiting (pending rows included) and swapped requests."""
        s = self.sched
        return len(s.running), self.queue.num_waiting, len(s.swapped)

    def retire(self, i: int) -> None:
        """Request row `i` finished or was rejected: its result row is complete."""
        self.output_len.pop(i, None)
        self.log.close(i)

    def idle_until(self, t: float) -> None:
        """Nothing to run until the next arrival: log the gap and jump the clock there."""
        self.record_idle(self.now, t)
        self.set_clock(max(t, self.now))

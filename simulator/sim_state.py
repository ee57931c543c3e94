"""The simulation loop's state: the shared RunState plus the latency model, RNG and fast-mode batch."""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from simulator.core.scheduler import Scheduler, SchedulerOutput
from simulator.core.sequence import Sequence, SequenceGroup
from simulator.decode_batch import DecodeBatch
from simulator.measured_steps import MeasuredSteps
from simulator.memory_log import MemoryLog
from simulator.pending import PendingQueue
from simulator.recorder import EventRecorder
from simulator.request_log import RequestLog
from simulator.run_state import RunState
from simulator.sim_config import SimConfig, make_allocator
from simulator.sinks import EventSink, TableSink
from simulator.step_latency import LatencyModel, make_latency_model
from traces.chunks import TraceChunks
from traces.prefix import block_keys
from traces.schema import PREFIX_COLUMNS

_ROW_BLOCK = 4096  # rows copied to Python at a time (building requests; the arrival times)
_BUILD_COLUMNS = ("request_id", "arrival_s", "prompt_len", "output_len", "n", "beam_width")


@dataclass(eq=False)
class SimState(RunState):
    """A simulation in progress (build it with `SimState.start(trace, config)`).

    The trace is read a block of rows at a time by two cursors: one over the arrival times (which rows
    have arrived), one building requests in row order as they reach the head of the queue
    (simulator/pending.py). Per-request results live in a RequestLog while a request is in flight.
    So the state holds no per-row array as long as the trace.
    """

    source: TraceChunks | None = None
    log: RequestLog | None = None
    cfg: SimConfig = field(default_factory=SimConfig)
    latency: LatencyModel | None = None
    recorder: EventRecorder | None = None
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    next: int = 0  # the next trace row to arrive
    next_seq_id: int = 0
    blocked_head: SequenceGroup | None = None  # head of the queue after the last fast step
    measured: MeasuredSteps | None = None  # replay step times that replace the latency model (step mode)

    @classmethod
    def start(cls, trace: TraceChunks, config: SimConfig, events: EventSink | None = None,
              memory: TableSink | None = None, requests: TableSink | None = None) -> SimState:
        """The state at time 0 of simulating the (validated) `trace` under `config` (tenures go to
        `events`, memory rows to `memory`, request rows to `requests`; default: kept in memory)."""
        recorder = EventRecorder(events, background=True) if config.record_events else None
        alloc = make_allocator(config, recorder)
        fitted = config.latency != "roofline"
        latency = make_latency_model("fitted" if fitted else "roofline", config.model, config.gpu,
                                     path=config.latency if fitted else None, block_size=config.block_size)
        log, mem = RequestLog(requests), MemoryLog(memory)
        # The two logs' buffers in a fixed phase, half a batch apart (simulator/sinks.py, MEMORY_BATCH_ROWS).
        log.midway = mem.flush
        return cls(allocator=config.allocator, enable_prefix_caching=config.enable_prefix_caching,
                   alloc=alloc, sched=Scheduler(config.scheduler_config(), alloc), source=trace,
                   log=log, cfg=config, latency=latency, recorder=recorder,
                   rng=np.random.default_rng(config.seed), mem=mem)

    def __post_init__(self) -> None:
        log = self.log
        # The loops write results by trace row, as into arrays; the log keeps only rows in flight.
        self.admitted, self.first_token, self.finish = log.admitted, log.first_token, log.finish
        self.preemptions, self.rejected, self.hit_tokens = log.preemptions, log.rejected, log.hit_tokens
        self.output_len: dict[int, int] = {}  # of the requests built and not finished (the decode batch's)
        has_prefix = "prefix_blocks" in self.source.columns and self.cfg.allocator == "paged"
        self._build_columns = _BUILD_COLUMNS + (PREFIX_COLUMNS if has_prefix else ())
        self._build_chunks = self.source.iter_chunks(self._build_columns, _ROW_BLOCK)
        self._rows: tuple[list, ...] = ()
        self._rows_start = self._rows_end = 0
        # Small blocks: the arrival cursor lives until the last arrival, half a long overloaded run.
        self._arrival_chunks = self.source.iter_chunks(("arrival_s",), _ROW_BLOCK)
        self._arrival: list[float] = []  # the arrival cursor's block (a list: bisect beats numpy calls)
        self._arrival_start = 0
        self.next_arrival = math.inf
        self._next_arrival_chunk()
        self.batch = DecodeBatch(self.alloc, self.sched, self.output_len)
        self.queue = PendingQueue(self.make_group)
        self.sched.waiting = self.queue

    @property
    def num_requests(self) -> int:
        """Rows of the trace."""
        return self.source.num_rows

    def new_seq_id(self) -> int:
        """A fresh sequence id."""
        self.next_seq_id += 1
        return self.next_seq_id

    def _next_arrival_chunk(self) -> bool:
        """Move the arrival cursor to the next block of rows; False at the end of the trace."""
        self._arrival_start += len(self._arrival)
        self._arrival = []  # the old block goes before the next is read: one block alive, not two
        chunk = next(self._arrival_chunks, None)
        self._arrival = chunk["arrival_s"].tolist() if chunk is not None else []
        self.next_arrival = self._arrival[0] if self._arrival else math.inf
        return chunk is not None

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
            if not self._next_arrival_chunk():
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
        """Python copies of the next block of rows (the one holding row `i`)."""
        self._rows = ()  # as in _next_arrival_chunk
        chunk = next(self._build_chunks)
        self._rows_start = self._rows_end
        self._rows = tuple(chunk[c].tolist() for c in self._build_columns)
        self._rows_end = self._rows_start + len(self._rows[0])
        if not self._rows_start <= i < self._rows_end:
            raise RuntimeError(f"request row {i} built out of order (next block: rows {self._rows_start}.."
                               f"{self._rows_end - 1})")

    def retire(self, i: int) -> None:
        """Request row `i` finished or was rejected: its result row is complete."""
        self.output_len.pop(i, None)
        self.log.close(i)

    def record_schedule(self, out: SchedulerOutput, now: float) -> None:
        """RunState.record_schedule, retiring rejected requests."""
        super().record_schedule(out, now)
        for g in out.rejected:
            self.retire(g.request_id)

    def set_clock(self, t: float) -> None:
        """Advance simulated time (and the event recorder's clock)."""
        self.now = t
        if self.recorder is not None:
            self.recorder.now = t

    def idle_until(self, t: float) -> None:
        """Nothing to run until the next arrival: log the gap and jump the clock there."""
        self.record_idle(self.now, t)
        self.set_clock(max(t, self.now))

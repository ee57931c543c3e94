"""The state every run records, simulated or measured: per-request times and counters, the memory log, clocks.

`RunState` is what `simulator.results` turns into the run's tables and summary. The simulation loop
extends it (simulator/sim_state.py) and the engine replay (gpu_backend/replay.py) fills it directly; the
bookkeeping both need - what a schedule decision means for each request, an idle gap, a step's memory
row - is written once here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from simulator.core.allocator import KVAllocator, MemoryBreakdown
from simulator.core.scheduler import Scheduler, SchedulerOutput
from simulator.core.sequence import SequenceGroup
from simulator.memory_log import MemoryLog


@dataclass(eq=False)
class RunState:
    """One run's allocator and scheduler, its trace columns, what happened to each request, and its clocks."""

    allocator: str  # the allocator's registry name (config)
    enable_prefix_caching: bool
    alloc: KVAllocator
    sched: Scheduler
    # Per-request arrays, for a run that keeps them whole (a replay; the simulator streams its requests:
    # simulator/sim_state.py leaves these None and keeps only the requests in flight).
    trace: pd.DataFrame | None = None
    arrival: np.ndarray | None = None  # float64 seconds, as the run saw them (a replay may scale them)
    prompt: np.ndarray | None = None  # int64 prompt lengths, as run (a replay may clip them)
    mem: MemoryLog = field(default_factory=MemoryLog)
    now: float = 0.0  # the run's clock (simulated or wall)
    step: int = 0  # steps run so far
    busy_s: float = 0.0  # time spent in steps
    batch_s: float = 0.0  # integral of the number of running requests over busy time
    num_done: int = 0  # finished or rejected requests

    def __post_init__(self) -> None:
        if self.trace is None:
            return
        num = len(self.trace)
        self.output = self.trace["output_len"].to_numpy(np.int64)
        self.n = self.trace["n"].to_numpy(np.int64)
        self.beam = self.trace["beam_width"].to_numpy(np.int64)
        self.admitted = np.full(num, np.nan)
        self.first_token = np.full(num, np.nan)
        self.finish = np.full(num, np.nan)
        self.preemptions = np.zeros(num, np.int64)
        self.rejected = np.zeros(num, bool)
        self.hit_tokens = np.zeros(num, np.int64)

    @property
    def num_requests(self) -> int:
        """Rows of the trace."""
        return len(self.trace)

    @property
    def block_size(self) -> int:
        """The allocator's block size (1 for contiguous regions)."""
        return self.alloc.block_size

    def head(self) -> SequenceGroup | None:
        """The request at the head of the waiting queue."""
        return self.sched.waiting[0] if self.sched.waiting else None

    def counts(self) -> tuple[int, int, int]:
        """Running, waiting and swapped requests."""
        s = self.sched
        return len(s.running), len(s.waiting), len(s.swapped)

    def record_schedule(self, out: SchedulerOutput, now: float) -> None:
        """What a schedule decision means per request: rejections, first admissions, preemptions."""
        for g in out.rejected:
            self.rejected[g.request_id] = True
            self.num_done += 1
        for g in out.admitted:
            i = g.request_id
            if math.isnan(self.admitted[i]):
                self.admitted[i] = now
                self.hit_tokens[i] = g.prefix_hit_tokens or 0
        for g in out.preempted:
            self.preemptions[g.request_id] += 1

    def record_idle(self, start: float, end: float) -> None:
        """Nothing runs from `start` to `end`: log the gap (it counts in time-weighted means)."""
        if end > start:
            self.mem.add_breakdown(self.step, start, end - start, self.alloc.breakdown(self.head()),
                                   self.counts(), 0, self.block_size, num_steps=0)

    def record_step(self, start: float, dt: float, breakdown: MemoryBreakdown, counts: tuple[int, int, int],
                    num_batched_tokens: int) -> None:
        """Log one step of `dt` seconds from `start` (memory as scheduled) and count it."""
        self.mem.add_breakdown(self.step, start, dt, breakdown, counts, num_batched_tokens, self.block_size)
        self.add_busy(dt, counts[0], 1)

    def add_busy(self, dt: float, num_running: int, num_steps: int) -> None:
        """Count `num_steps` steps taking `dt` seconds in all with `num_running` requests running."""
        self.busy_s += dt
        self.batch_s += dt * num_running
        self.step += num_steps

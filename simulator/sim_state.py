"""The simulation loop's state: the shared RunState plus the latency model, RNG and fast-mode batch."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from simulator.core.scheduler import Scheduler
from simulator.core.sequence import Sequence, SequenceGroup
from simulator.decode_batch import DecodeBatch
from simulator.measured_steps import MeasuredSteps
from simulator.recorder import EventRecorder, MemoryLog
from simulator.run_state import RunState
from simulator.sim_config import SimConfig, make_allocator
from simulator.sinks import EventSink, TableSink
from simulator.step_latency import LatencyModel, make_latency_model
from traces.prefix import block_keys


@dataclass(eq=False)
class SimState(RunState):
    """A simulation in progress (build it with `SimState.start(trace, config)`)."""

    cfg: SimConfig = field(default_factory=SimConfig)
    latency: LatencyModel | None = None
    recorder: EventRecorder | None = None
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    next: int = 0  # the next trace row to arrive
    next_seq_id: int = 0
    blocked_head: SequenceGroup | None = None  # head of the queue after the last fast step
    measured: MeasuredSteps | None = None  # replay step times that replace the latency model (step mode)

    @classmethod
    def start(cls, trace: pd.DataFrame, config: SimConfig, events: EventSink | None = None,
              memory: TableSink | None = None) -> SimState:
        """The state at time 0 of simulating the (validated) `trace` under `config` (tenures go to
        `events`, memory rows to `memory`; default: kept in memory)."""
        recorder = EventRecorder(events, background=True) if config.record_events else None
        alloc = make_allocator(config, recorder)
        fitted = config.latency != "roofline"
        latency = make_latency_model("fitted" if fitted else "roofline", config.model, config.gpu,
                                     path=config.latency if fitted else None, block_size=config.block_size)
        return cls(allocator=config.allocator, enable_prefix_caching=config.enable_prefix_caching,
                   alloc=alloc, sched=Scheduler(config.scheduler_config(), alloc), trace=trace,
                   arrival=trace["arrival_s"].to_numpy(np.float64),
                   prompt=trace["prompt_len"].to_numpy(np.int64), cfg=config, latency=latency,
                   recorder=recorder, rng=np.random.default_rng(config.seed), mem=MemoryLog(memory))

    def __post_init__(self) -> None:
        super().__post_init__()
        # Plain-list copies: the loops index them one request at a time, which numpy does slowly.
        self.arrival_s: list[float] = self.arrival.tolist()
        self.output_len: list[int] = self.output.tolist()
        self._prompt_len: list[int] = self.prompt.tolist()
        self._width: list[int] = np.where(self.beam > 1, self.beam, self.n).tolist()
        has_prefix = "prefix_blocks" in self.trace.columns and self.cfg.allocator == "paged"
        self._prefix = self.trace["prefix_blocks"].to_numpy() if has_prefix else None
        self._prefix_bs = self.trace["prefix_block_size"].to_numpy() if has_prefix else None
        self.batch = DecodeBatch(self.alloc, self.sched, self.output_len)

    def new_seq_id(self) -> int:
        """A fresh sequence id."""
        self.next_seq_id += 1
        return self.next_seq_id

    def make_group(self, i: int) -> SequenceGroup:
        """The sequence group of request row `i` (n samples or a beam share the prompt)."""
        p = self._prompt_len[i]
        final = p + self.output_len[i] - 1
        keys = ()
        if self._prefix is not None and isinstance(self._prefix[i], (list, tuple, np.ndarray)):
            keys = block_keys(self._prefix[i], int(self._prefix_bs[i]), self.block_size, p)
        seqs = [Sequence(self.new_seq_id(), p, final, request_id=i, prefix_keys=keys)
                for _ in range(self._width[i])]
        return SequenceGroup(i, seqs, self.arrival_s[i], n=int(self.n[i]), beam_width=int(self.beam[i]))

    def set_clock(self, t: float) -> None:
        """Advance simulated time (and the event recorder's clock)."""
        self.now = t
        if self.recorder is not None:
            self.recorder.now = t

    def idle_until(self, t: float) -> None:
        """Nothing to run until the next arrival: log the gap and jump the clock there."""
        self.record_idle(self.now, t)
        self.set_clock(max(t, self.now))

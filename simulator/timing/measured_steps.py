"""Measured step times that drive a simulation instead of a latency model (`simulate --step-times-from`).

A replay records when each engine step started and how long it took. Given those, the simulator's clock
reads exactly the replay's clock at every step: the step starts at the recorded start (the gap before it
is the replay's loop overhead, or its sleep past an arrival) and ends at the recorded end. Arrivals are
then admitted at the same recorded times as in the replay (gpu_backend/replay.py checks arrivals against
recorded times only), so the shared scheduler makes the same decisions and the memory of the two runs is
equal step for step. Only step mode supports this: a fast-mode span would need the steps' times
before it has decided them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.core.errors import ConfigError


@dataclass(frozen=True)
class MeasuredSteps:
    """Start time and duration of each step of a measured run, in step order."""

    start_s: tuple[float, ...]
    dt_s: tuple[float, ...]
    source: str = "measured run"

    def __post_init__(self) -> None:
        if len(self.start_s) != len(self.dt_s):
            raise ConfigError(f"{self.source}: {len(self.start_s)} step starts, {len(self.dt_s)} durations")

    @classmethod
    def from_memory(cls, memory, source: str = "measured run") -> MeasuredSteps:
        """The steps of a run's memory table (rows with num_steps == 1; idle rows have 0)."""
        steps = memory[memory["num_steps"] > 0]
        if (steps["num_steps"] != 1).any():
            raise ConfigError(f"{source}: memory table has multi-step rows (a fast-mode simulation?); "
                              "step times must come from a replay or a step-mode run")
        if not np.array_equal(steps["step"].to_numpy(), np.arange(len(steps))):
            raise ConfigError(f"{source}: memory table steps are not numbered 0..{len(steps) - 1}")
        return cls(tuple(steps["t_s"].astype(float)), tuple(steps["dt_s"].astype(float)), source)

    def __len__(self) -> int:
        return len(self.dt_s)

    def step(self, k: int) -> tuple[float, float]:
        """(start, duration) of step k; a run that takes more steps than were measured is an error."""
        if k >= len(self.dt_s):
            raise ConfigError(f"{self.source}: the simulation needs step {k} but only {len(self.dt_s)} were "
                              "measured; the runs diverged (same trace, pool and scheduler options?)")
        return self.start_s[k], self.dt_s[k]

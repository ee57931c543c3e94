"""What a run records as it goes: pool-region tenures (for block maps) and per-step memory rows."""
from __future__ import annotations

import numpy as np
import pandas as pd

from simulator.allocator import MemoryBreakdown, RegionRecorder

MEMORY_COLUMNS = ("step", "num_steps", "t_s", "dt_s", "token_states", "reservation",
                  "internal_fragmentation", "external_fragmentation", "free", "cached_free",
                  "token_occupancy", "block_occupancy", "num_running", "num_waiting", "num_swapped",
                  "num_batched_tokens", "blocks_used")


class EventRecorder(RegionRecorder):
    """Collects one row per tenure: who held which region of the pool, from when to when."""

    def __init__(self) -> None:
        self.now = 0.0
        self.start: list[int] = []
        self.size: list[int] = []
        self.request_id: list[int] = []
        self.t_start: list[float] = []
        self.t_end: list[float] = []
        self.max_ref: list[int] = []
        self.filled: list[int] = []
        self._open: dict[int, int] = {}  # region start -> row index

    def acquire(self, start: int, size: int, request_id: int) -> None:
        """A region was taken."""
        self._open[start] = len(self.start)
        self.start.append(start)
        self.size.append(size)
        self.request_id.append(request_id)
        self.t_start.append(self.now)
        self.t_end.append(np.nan)
        self.max_ref.append(1)
        self.filled.append(0)

    def share(self, start: int, ref_count: int) -> None:
        """A region gained another owner."""
        row = self._open[start]
        if ref_count > self.max_ref[row]:
            self.max_ref[row] = ref_count

    def release(self, start: int, filled: int) -> None:
        """A region was given back."""
        row = self._open.pop(start)
        self.t_end[row] = self.now
        self.filled[row] = filled

    def to_frame(self, end_s: float) -> pd.DataFrame:
        """The tenures as a table (regions still held end at `end_s`)."""
        t_end = np.asarray(self.t_end, dtype=np.float64)
        t_end[np.isnan(t_end)] = end_s
        return pd.DataFrame({
            "request_id": np.asarray(self.request_id, dtype=np.int64),
            "start": np.asarray(self.start, dtype=np.int64),
            "size": np.asarray(self.size, dtype=np.int64),
            "t_start_s": np.asarray(self.t_start, dtype=np.float64),
            "t_end_s": t_end,
            "max_ref_count": np.asarray(self.max_ref, dtype=np.int64),
            "filled": np.asarray(self.filled, dtype=np.int64),
        })


class MemoryLog:
    """Per-step (or per-span) memory rows, kept as column lists."""

    def __init__(self) -> None:
        self.cols: dict[str, list] = {c: [] for c in MEMORY_COLUMNS}

    def add(self, step: int, num_steps: int, t_s: float, dt_s: float, fractions: dict[str, float],
            cached_free: float, block_occupancy: float, counts: tuple[int, int, int],
            num_batched_tokens: int, blocks_used: int) -> None:
        """Append one row; `fractions` holds the five taxonomy states."""
        c = self.cols
        c["step"].append(step)
        c["num_steps"].append(num_steps)
        c["t_s"].append(t_s)
        c["dt_s"].append(dt_s)
        for name, value in fractions.items():
            c[name].append(value)
        c["cached_free"].append(cached_free)
        c["token_occupancy"].append(fractions["token_states"])
        c["block_occupancy"].append(block_occupancy)
        c["num_running"].append(counts[0])
        c["num_waiting"].append(counts[1])
        c["num_swapped"].append(counts[2])
        c["num_batched_tokens"].append(num_batched_tokens)
        c["blocks_used"].append(blocks_used)

    def add_breakdown(self, step: int, t_s: float, dt_s: float, b: MemoryBreakdown,
                      counts: tuple[int, int, int], num_batched_tokens: int, block_size: int,
                      num_steps: int = 1) -> None:
        """Append a row from an instantaneous breakdown."""
        self.add(step, num_steps, t_s, dt_s, b.fractions(), b.cached_free / b.capacity, b.block_occupancy,
                 counts, num_batched_tokens, b.allocated // block_size)

    def to_frame(self) -> pd.DataFrame:
        """The rows as a table with the documented dtypes."""
        df = pd.DataFrame(self.cols)
        for name in ("step", "num_steps", "num_running", "num_waiting", "num_swapped",
                     "num_batched_tokens", "blocks_used"):
            df[name] = df[name].astype(np.int64)
        return df

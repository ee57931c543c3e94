"""The unit a latency is shown in, the same for the CLI's tables and the figures: milliseconds, as vLLM
reports them, until the values shown together reach 100 s, then seconds (a 376,783 ms TTFT reads better,
and fits a table cell, as 376.8 s)."""
from __future__ import annotations

from collections.abc import Iterable

SECONDS_FROM_S = 100.0  # shown together with a value this long or longer, latencies are in seconds


def latency_unit(seconds: Iterable[float | None]) -> tuple[str, float]:
    """("ms", 1000.0) or ("s", 1.0): the unit for latencies shown together, and the factor from seconds."""
    largest = max((abs(v) for v in seconds if v is not None and v == v), default=0.0)
    return ("s", 1.0) if largest >= SECONDS_FROM_S else ("ms", 1e3)

"""Service-level objectives: which summary metric a point must keep under which bound.

A point *meets* the SLO when its metric is at most the bound and every request finished (a run that
rejected or never finished requests has not served the rate). Missing metrics count as a miss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from simulator.sweep.axes import SweepError

# metric name -> (how to read it from a run summary, unit, what it means)
METRICS = {
    "norm_latency": (lambda s: s.get("normalized_latency_s_per_token"), "s/token",
                     "mean normalized latency (end-to-end latency / output tokens; the paper's Fig. 12)"),
    "ttft_p99": (lambda s: (s.get("ttft_s") or {}).get("p99"), "s", "99th-percentile time to first token"),
    "tpot_p99": (lambda s: (s.get("tpot_s") or {}).get("p99"), "s", "99th-percentile time per output token"),
}
# Default: 0.2 s/token, several times the unloaded normalized latency of the presets (~0.015-0.05) and
# far below the values past the knee, where the queue grows for the whole trace (seconds per token).
DEFAULT_SLO = "norm_latency=0.2"


@dataclass(frozen=True)
class SLO:
    """`metric` must stay <= `bound` (in the metric's unit)."""

    metric: str
    bound: float

    def value(self, summary: dict) -> float:
        """The metric of one run summary (NaN when the run has none)."""
        v = METRICS[self.metric][0](summary)
        return float(v) if isinstance(v, (int, float)) and v is not None else math.nan

    def met(self, summary: dict) -> bool:
        """Whether a run meets the objective."""
        value = self.value(summary)
        finished_all = summary.get("num_finished") == summary.get("num_requests")
        return finished_all and math.isfinite(value) and value <= self.bound

    def describe(self) -> str:
        """'norm_latency <= 0.2 s/token'."""
        return f"{self.metric} <= {self.bound:g} {METRICS[self.metric][1]}"


def parse_slo(spec: str) -> SLO:
    """Parse `--slo METRIC=BOUND` (metrics: norm_latency, ttft_p99, tpot_p99)."""
    name, sep, bound = spec.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or name not in METRICS:
        raise SweepError(f"--slo {spec!r}: use METRIC=BOUND with METRIC one of {', '.join(METRICS)}")
    try:
        value = float(bound)
    except ValueError:
        raise SweepError(f"--slo {spec!r}: {bound!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise SweepError(f"--slo {spec!r}: the bound must be a positive number")
    return SLO(name, value)

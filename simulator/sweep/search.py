"""The maximum sustainable rate of one configuration: bracket it from the points run so far, then bisect.

Assumption (documented in docs/sweeps.md): the SLO metric does not decrease as the rate grows, so the
rates that meet the SLO form an interval starting at the lowest rate. Each point replays the *same*
trace rescaled to its rate (common random numbers), which keeps the measured curve close to monotone.
Where the data disagree (a rate meets the SLO above one that misses), the search stays conservative: the
bracket ends at the lowest missing rate, and the result says `monotone: false`.

Bisection is geometric (the midpoint of log-rates) because the tolerance is relative: the search stops
once high / low <= 1 + tolerance, so the reported rate (the highest one *seen* to meet the SLO) is within
that fraction of the true threshold.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from simulator.sweep.axes import RATE_DIGITS

DEFAULT_TOLERANCE = 0.05
DEFAULT_SEARCH_RUNS = 10


@dataclass(frozen=True)
class SearchState:
    """What the points run so far say about one configuration's maximum rate (a pure query result)."""

    low: float | None  # highest rate seen to meet the SLO below `high`
    high: float | None  # lowest rate seen to miss it
    monotone: bool
    status: str  # "found", "above_range", "below_range", "searching", "budget" ("grid": search off)
    next_rate: float | None  # the rate to run next while searching

    @property
    def done(self) -> bool:
        """Whether the search has stopped for this configuration."""
        return self.next_rate is None


def search_state(met: dict[float, bool], bounds: tuple[float, float], search_runs: int,
                 tolerance: float = DEFAULT_TOLERANCE, max_search_runs: int = DEFAULT_SEARCH_RUNS
                 ) -> SearchState:
    """Where the search stands given `met` (rate -> met the SLO) and the number of runs it added so far."""
    missing = sorted(r for r, ok in met.items() if not ok)
    high = missing[0] if missing else None
    below = [r for r, ok in met.items() if ok and (high is None or r < high)]
    low = max(below) if below else None
    monotone = not any(ok and high is not None and r > high for r, ok in met.items())
    if low is None:
        # Nothing below the first miss meets the SLO; the search can only confirm the lower bound.
        if high is not None and high <= bounds[0] * (1 + 1e-12):
            return SearchState(None, high, monotone, "below_range", None)
        return _step(None, high, monotone, bounds[0], search_runs, max_search_runs)
    if high is None:
        if low >= bounds[1] * (1 - 1e-12):
            return SearchState(low, None, monotone, "above_range", None)
        return _step(low, None, monotone, bounds[1], search_runs, max_search_runs)
    if high / low <= 1 + tolerance:
        return SearchState(low, high, monotone, "found", None)
    return _step(low, high, monotone, round(math.sqrt(low * high), RATE_DIGITS), search_runs,
                 max_search_runs)


def _step(low, high, monotone, rate, search_runs, max_search_runs) -> SearchState:
    """Ask for `rate` next, unless the run budget is spent."""
    if search_runs >= max_search_runs:
        return SearchState(low, high, monotone, "budget", None)
    return SearchState(low, high, monotone, "searching", rate)

"""The max-rate search on known thresholds: precision, run budget, range edges, non-monotone data."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.sweep.search import search_state


def search(threshold: float, bounds=(0.5, 4.0), grid=(), tolerance=0.05, max_runs=10, met_fn=None):
    """Drive the search against `rate <= threshold` (or met_fn); returns the final state and runs made."""
    met_fn = met_fn or (lambda r: r <= threshold)
    met = {r: met_fn(r) for r in {*grid, *bounds}}
    runs = 0
    while True:
        state = search_state(met, bounds, runs, tolerance, max_runs)
        if state.done:
            return state, len(met)
        assert state.next_rate not in met  # never asks for a rate twice
        met[state.next_rate] = met_fn(state.next_rate)
        runs += 1


@settings(max_examples=200, deadline=None)
@given(st.floats(0.51, 3.99))
def test_finds_the_threshold_within_5_percent_in_at_most_12_runs(threshold):
    state, runs = search(threshold)
    assert state.status == "found"
    assert state.low <= threshold < state.high
    assert (threshold - state.low) / threshold <= 0.05
    assert runs <= 12


@settings(max_examples=100, deadline=None)
@given(st.floats(0.1, 30.0), st.floats(0.01, 0.2))
def test_any_tolerance_is_honoured_from_a_grid(threshold, tolerance):
    grid = tuple(0.1 + 0.25 * i for i in range(121))
    state, _ = search(threshold, bounds=(0.1, 30.1), grid=grid, tolerance=tolerance, max_runs=40)
    assert state.status == "found"
    assert state.low <= threshold < state.high <= state.low * (1 + tolerance)


def test_range_edges_are_reported_not_guessed():
    above, _ = search(10.0)
    assert above.status == "above_range" and above.low == 4.0 and above.high is None
    below, runs = search(0.1)
    assert below.status == "below_range" and below.low is None and runs == 2


def test_budget_stops_the_search():
    state, runs = search(1.234, tolerance=0.001, max_runs=3)
    assert state.status == "budget" and runs == 5
    assert state.low <= 1.234 < state.high


def test_non_monotone_data_keep_the_conservative_bracket():
    # Meets below 1.0, misses in [1.0, 1.2), meets again above: the answer stays below 1.0.
    state, _ = search(0.0, grid=(1.1, 2.0), met_fn=lambda r: r < 1.0 or r >= 1.2)
    assert state.monotone is False
    assert state.status == "found" and state.low < 1.0 <= state.high

"""Sweeps: run the simulator over the cross product of configuration axes and find capacity.

`axes` parses the user's ranges and lists into a grid of points, `points` names, hashes, runs and reuses
one point, `search` finds each configuration's maximum sustainable rate under an SLO, `executors` run
points in local processes or on a Ray cluster, and `runner` ties them together into a sweep folder with
a table and a summary (docs/sweeps.md).
"""
from simulator.sweep.axes import SweepAxes, SweepError, parse_axis_values, parse_rates

__all__ = ["SweepAxes", "SweepError", "parse_axis_values", "parse_rates"]

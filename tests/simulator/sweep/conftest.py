"""Sweep test fixtures: a small synthetic trace and a sweep plan whose knees fall inside 0.1-3 req/s."""
from __future__ import annotations

import pytest

from simulator.slo import DEFAULT_SLO, parse_slo
from simulator.sweep.axes import SweepAxes, parse_rates
from simulator.sweep.runner import SweepPlan
from traces import SyntheticConfig, generate_trace

SMALL_BASE = {"model": "opt-13b", "gpu": "a100-40gb", "capacity_tokens": 8192, "max_model_len": 2048}


@pytest.fixture(scope="session")
def small_trace():
    """200 ShareGPT-like requests with Poisson arrivals (rescaled to each point's rate)."""
    return generate_trace(SyntheticConfig(num_requests=200, lengths="sharegpt", rate=1.0, seed=0))


@pytest.fixture
def small_plan():
    """paged vs contiguous-max over 0.1-3 req/s, plus a block-size axis, searched to 5%."""
    def make(rate: str = "0.1:3:0.7", allocators=("paged", "contiguous-max"), axes=None, **plan_kw):
        rates, bounds = parse_rates(rate)
        sweep_axes = SweepAxes(rates, bounds, tuple(allocators), axes or {}, dict(SMALL_BASE))
        return SweepPlan(sweep_axes, parse_slo(plan_kw.pop("slo", DEFAULT_SLO)), **plan_kw)
    return make

"""The Ray executor on a real local Ray instance gives the local executor's tables."""
from __future__ import annotations

import pandas as pd
import pytest

from simulator.sweep.executors import RayExecutor, SerialExecutor
from simulator.sweep.runner import run_sweep

ray = pytest.importorskip("ray")


@pytest.fixture
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_tables_equal_the_local_ones(tmp_path, small_trace, small_plan, local_ray):
    plan = small_plan(rate="0.1:3:1.4")
    serial = run_sweep(small_trace, "small", plan, tmp_path / "serial", SerialExecutor(small_trace))
    executor = RayExecutor(small_trace)  # joins the instance started by the fixture
    try:
        on_ray = run_sweep(small_trace, "small", plan, tmp_path / "ray", executor)
    finally:
        executor.close()
    assert ray.is_initialized()  # the executor leaves a cluster it did not start alone
    pd.testing.assert_frame_equal(serial.points, on_ray.points)
    pd.testing.assert_frame_equal(serial.max_rates, on_ray.max_rates)
    assert sorted(p.name for p in (tmp_path / "ray" / "points").iterdir()) == \
        sorted(p.name for p in (tmp_path / "serial" / "points").iterdir())

"""The Ray executor on a real local Ray instance gives the local executor's tables, and a lost worker costs a
point one retry, then the point."""
from __future__ import annotations

import pandas as pd
import pytest

from simulator.sweep.executors import KILL_POINT_ENV, RayExecutor, SerialExecutor
from simulator.sweep.runner import run_sweep

ray = pytest.importorskip("ray")


KILLED = "-r1.7-"  # the workers kill themselves on the points at rate 1.7 (a rate only one test sweeps)


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module; its workers get the kill hook from the environment."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KILL_POINT_ENV, KILLED)
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


def test_a_lost_ray_worker_costs_one_retry_then_the_point(tmp_path, small_trace, small_plan, local_ray):
    plan = small_plan(rate="1,1.7,3", allocators=("paged",), search=False)
    executor = RayExecutor(small_trace)
    try:
        result = run_sweep(small_trace, "small", plan, tmp_path, executor)
    finally:
        executor.close()
    assert (result.num_run, result.num_failed) == (2, 1)
    error = result.points.set_index("rate").loc[1.7, "error"]
    assert error.startswith("its Ray worker was lost twice (the point was retried once): ")
    assert len(list((tmp_path / "points").iterdir())) == 2

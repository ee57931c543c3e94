"""Simulator speed (opt-in: `make bench`). Targets: the Azure conversation trace in <= 2 s per
allocator with events recorded, a 1,000,000-request synthetic trace (paged) in <= 60 s and <= 4 GB.
See docs/performance.md for the figures and `pagelab bench simulate` for the scaling curve."""
import pytest

from simulator.config import SimConfig
from simulator.loop import simulate
from traces import SyntheticConfig, generate_trace, load_trace

ALLOCATORS = ["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"]


@pytest.fixture(scope="module")
def azure():
    return load_trace("azure-conv")


@pytest.mark.parametrize("events", [True, False], ids=["events", "no-events"])
@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_simulate_azure_conv(benchmark, azure, allocator, events):
    cfg = SimConfig(allocator=allocator, record_events=events)
    benchmark.extra_info.update(num_requests=len(azure), allocator=allocator, record_events=events)
    result = benchmark.pedantic(simulate, args=(azure, cfg), rounds=3, iterations=1)
    assert result.summary["num_finished"] + result.summary["num_rejected"] == len(azure)


def test_simulate_synthetic_100k_paged(benchmark):
    trace = generate_trace(SyntheticConfig(num_requests=100_000, rate=15.0, lengths="sharegpt", seed=0))
    benchmark.extra_info.update(num_requests=len(trace), allocator="paged", record_events=False)
    result = benchmark.pedantic(simulate, args=(trace, SimConfig(record_events=False)), rounds=1,
                                iterations=1)
    assert result.summary["num_finished"] == len(trace)

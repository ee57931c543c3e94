"""The opt-in benchmarks (`make bench`): collected only with --benchmark-enable, and their shared fixtures.

`make test` (`pytest` over tests/, where pyproject's addopts disable benchmark timing) leaves these files
out: they are timing suites over workloads sized for timing, not correctness tests.
"""
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_backend.ops import TorchBackend, TorchBackendConfig
from gpu_backend.ops.cases import make_paged_case


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave every benchmark file out unless --benchmark-enable was given (`make bench` gives it)."""
    if not config.getoption("benchmark_enable", default=False):
        return True
    return None


@pytest.fixture
def prefill_attention(benchmark):
    """Benchmark one layer's torch-backend prefill attention over sequences of the tiny preset's shapes (4
    query heads, 2 KV heads, head_dim 64, block size 16, fp32) on one thread; checks the output."""
    def run(context_lens: list[int], q_lens: list[int], config: TorchBackendConfig | None = None):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            case = make_paged_case(np.random.default_rng(0), context_lens, 4, 2, 64, 16, q_lens=q_lens,
                                   nan_fill=False)
            args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens_q,
                    case.context_lens, case.scale)
            out = benchmark(TorchBackend(config).prefill, *args)
        finally:
            torch.set_num_threads(threads)
        assert out.shape == case.q.shape and bool(torch.isfinite(out).all())
    return run

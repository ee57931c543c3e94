"""Torch backend, one layer's attention of a prefill step of several prompts (opt-in: `make bench`).

Fresh prompts of mixed lengths, the tiny preset's shapes (4 query heads, 2 KV heads, head_dim 64, block
size 16), fp32, one thread; tiles with their padded query x context area bounded (the default,
`prefill_max_pad=0.25`) and unbounded (one tile per 8 MiB, as before). docs/benchmarks.md has the numbers.
"""
import numpy as np
import pytest
import torch

from gpu_backend.ops import TorchBackend, TorchBackendConfig
from gpu_backend.ops.cases import make_paged_case

PROMPTS = {"azure-C-like": [380, 1075, 1104, 1118, 1225], "spread": [42, 126, 431, 1140, 870],
           "equal": [1024] * 4}
PADDING = {"bounded": TorchBackendConfig(), "unbounded": TorchBackendConfig(prefill_max_pad=None)}


@pytest.mark.parametrize("padding", PADDING)
@pytest.mark.parametrize("prompts", PROMPTS)
def test_prefill_tiles(benchmark, prompts, padding):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lens = PROMPTS[prompts]
        case = make_paged_case(np.random.default_rng(0), lens, 4, 2, 64, 16, q_lens=lens, nan_fill=False)
        backend = TorchBackend(PADDING[padding])
        args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens_q, case.context_lens,
                case.scale)
        out = benchmark(backend.prefill, *args)
    finally:
        torch.set_num_threads(threads)
    assert out.shape == case.q.shape and bool(torch.isfinite(out).all())

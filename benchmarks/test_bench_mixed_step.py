"""Torch backend, one layer's attention of a mixed step (opt-in: `make bench`).

A 390-token prefill next to 0, 4 or 16 decoding sequences (contexts 300-855), the tiny preset's shapes
(4 query heads, 2 KV heads, head_dim 64, block size 16), fp32, one thread. Decode rows take the decode
path, so a mixed step costs about its prefill plus its decodes (docs/benchmarks.md records the numbers
from before, when decode rows were padded to the prefill's query length).
"""
import numpy as np
import pytest
import torch

from gpu_backend.ops import TorchBackend
from gpu_backend.ops.cases import make_paged_case


@pytest.mark.parametrize("num_decodes", [0, 4, 16])
def test_mixed_step_attention(benchmark, num_decodes):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        case = make_paged_case(np.random.default_rng(0), [390] + [300 + 37 * i for i in range(num_decodes)],
                               4, 2, 64, 16, q_lens=[390] + [1] * num_decodes, nan_fill=False)
        backend = TorchBackend()
        args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens_q, case.context_lens,
                case.scale)
        out = benchmark(backend.prefill, *args)
    finally:
        torch.set_num_threads(threads)
    assert out.shape == case.q.shape and bool(torch.isfinite(out).all())

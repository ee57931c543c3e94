"""Torch backend, one layer's attention of a mixed step (opt-in: `make bench`).

A 390-token prefill next to 0, 4 or 16 decoding sequences (contexts 300-855), the tiny preset's shapes
(4 query heads, 2 KV heads, head_dim 64, block size 16), fp32, one thread. Decode rows take the decode
path, so a mixed step costs about its prefill plus its decodes, not a prefill's query length per decode
row (docs/performance.md).
"""
import pytest


@pytest.mark.parametrize("num_decodes", [0, 4, 16])
def test_mixed_step_attention(prefill_attention, num_decodes):
    prefill_attention([390] + [300 + 37 * i for i in range(num_decodes)], [390] + [1] * num_decodes)

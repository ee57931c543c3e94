"""Torch backend, one layer's attention of a prefill step of several prompts (opt-in: `make bench`).

Fresh prompts of mixed lengths, the tiny preset's shapes, fp32, one thread (conftest.prefill_attention);
tiles with their padded query x context area bounded (the default, `prefill_max_pad=0.25`) and unbounded
(one tile per 8 MiB). docs/performance.md has the numbers.
"""
import pytest

from gpu_backend.ops import TorchBackendConfig

PROMPTS = {"azure-C-like": [380, 1075, 1104, 1118, 1225], "spread": [42, 126, 431, 1140, 870],
           "equal": [1024] * 4}
PADDING = {"bounded": TorchBackendConfig(), "unbounded": TorchBackendConfig(prefill_max_pad=None)}


@pytest.mark.parametrize("padding", PADDING)
@pytest.mark.parametrize("prompts", PROMPTS)
def test_prefill_tiles(prefill_attention, prompts, padding):
    prefill_attention(PROMPTS[prompts], PROMPTS[prompts], PADDING[padding])

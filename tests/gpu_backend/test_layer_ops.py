"""The fused layer kernels (gpu_backend/ops/triton_layer.py) against the torch reference (TorchLayerOps).

On a CPU they run under Triton's interpreter (the `kernels` fixture), in fp32 and fp16 (the interpreter
mis-handles bf16; on a GPU bf16 runs natively). The residual add and the rotation round where torch
rounds, so they give torch's values exactly in fp16 and bf16; fp32 may differ by contraction into fused
multiply-adds, and a norm's sum of squares by its order: both within a few ulps.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_backend.model import GemmaRMSNorm, RMSNorm
from gpu_backend.ops.layer_ops import TorchLayerOps, TritonLayerOps, layer_ops
from gpu_backend.ops.reference import relative_error
from gpu_backend.rope import RotaryEmbedding

pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _randn(rng, shape, dtype) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(DEVICE, dtype)


@pytest.fixture(scope="module")
def ops(kernels) -> tuple[TorchLayerOps, TritonLayerOps]:
    """The reference and the fused ops (interpreted on a CPU while this module runs)."""
    return TorchLayerOps(), TritonLayerOps()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
def test_rms_norm_and_the_residual_add_before_it_match_torch(ops, dtype, norm_cls):
    ref, fused = ops
    rng = np.random.default_rng(1)
    norm = norm_cls(48, 1e-6, dtype, DEVICE)  # 48: not a power of two, the tail is masked
    with torch.no_grad():
        norm.weight.copy_(_randn(rng, (48,), dtype))
    x, residual = _randn(rng, (5, 48), dtype), _randn(rng, (5, 48), dtype)
    assert relative_error(fused.rms_norm(norm, x), ref.rms_norm(norm, x).double()) <= TOLERANCE[dtype]
    got, got_sum = fused.add_rms_norm(norm, x, residual)
    want, want_sum = ref.add_rms_norm(norm, x, residual)
    assert torch.equal(got_sum, want_sum)
    assert relative_error(got, want.double()) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_of_strided_q_and_k_gives_torch_values(ops, dtype):
    ref, fused = ops
    rng = np.random.default_rng(2)
    num_tokens, hq, hkv, d = 4, 6, 2, 16
    qkv = _randn(rng, (num_tokens, (hq + 2 * hkv) * d), dtype)  # as the fused projection lays them out
    q = qkv[:, :hq * d].view(num_tokens, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(num_tokens, hkv, d)
    rotary = RotaryEmbedding(d, 10000.0, device=DEVICE)
    cos, sin = rotary.cos_sin(torch.tensor([0, 5, 17, 300], device=DEVICE), dtype)
    got, want = fused.rope(q, k, cos, sin), ref.rope(q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.is_contiguous()
        if dtype == torch.float32:
            assert relative_error(g, w.double()) <= TOLERANCE[dtype]
        else:
            assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(ops, dtype):
    ref, fused = ops
    gate_up = _randn(np.random.default_rng(3), (3, 2 * 1500), dtype)  # two column tiles, the second partial
    got, want = fused.act_mul(gate_up, gelu=False), ref.act_mul(gate_up, gelu=False)
    assert got.shape == (3, 1500) and relative_error(got, want.double()) <= TOLERANCE[dtype]


def test_the_triton_backend_brings_the_fused_ops_and_torch_the_reference():
    from gpu_backend.ops import get_backend

    assert type(layer_ops(get_backend("torch", "cpu"))) is TorchLayerOps
    assert type(layer_ops(type("Backend", (), {"name": "triton"})())) is TritonLayerOps


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_gpu_layer_ops_at_llama_1b_shapes_in_bf16(ops):
    """llama-1b-shape's decode rows: hidden 2048, 32:8 heads of 64, intermediate 8192, 64 tokens."""
    ref, fused = ops
    rng = np.random.default_rng(4)
    dtype = torch.bfloat16
    norm = RMSNorm(2048, 1e-5, dtype, DEVICE)
    with torch.no_grad():
        norm.weight.copy_(_randn(rng, (2048,), dtype))
    x, residual = _randn(rng, (64, 2048), dtype), _randn(rng, (64, 2048), dtype)
    got, got_sum = fused.add_rms_norm(norm, x, residual)
    want, want_sum = ref.add_rms_norm(norm, x, residual)
    assert torch.equal(got_sum, want_sum) and relative_error(got, want.double()) <= TOLERANCE[dtype]
    qkv = _randn(rng, (64, (32 + 2 * 8) * 64), dtype)
    q, k = qkv[:, :2048].view(64, 32, 64), qkv[:, 2048:2560].view(64, 8, 64)
    positions = torch.arange(64, device=DEVICE) * 37
    cos, sin = RotaryEmbedding(64, 500000.0, device=DEVICE).cos_sin(positions, dtype)
    for g, w in zip(fused.rope(q, k, cos, sin), ref.rope(q, k, cos, sin), strict=True):
        assert torch.equal(g, w)
    gate_up = _randn(rng, (64, 2 * 8192), dtype)
    got = fused.act_mul(gate_up, False)
    assert relative_error(got, ref.act_mul(gate_up, False).double()) <= TOLERANCE[dtype]

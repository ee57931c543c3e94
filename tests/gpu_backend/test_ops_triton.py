"""Triton kernels against the independent fp64 reference; on CPU under Triton's interpreter.

Without CUDA the `kernels` fixture (conftest.py) interprets the kernels for this module only. The
interpreter stores bfloat16 as uint16 and gets it wrong, so bf16 cases run there as float32 on
bf16-rounded data (fp32 tolerance); on a GPU they run natively.
Relative error ||out - ref|| / ||ref|| must stay within TOLERANCE[dtype] (recorded as `rel_err`).
Full-size cases are marked `gpu` and skipped without CUDA.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_backend.ops.cases import hide_out_of_window, make_paged_case, make_region_case
from gpu_backend.ops.checks import KernelInputError
from gpu_backend.ops.reference import reference_decode, reference_prefill, relative_error

pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
CONTEXTS = [1, 16, 37, 8, 64, 5, 23]  # 1, multiples of block sizes 8 and 16, odd tails


def _backend(kernels, **config):
    return kernels.TritonBackend(kernels.TritonBackendConfig(**config))


def _runnable(case, dtype):
    """Upcast a bf16 case to fp32 under the interpreter; returns (case tensors, dtype to judge by)."""
    tensors = [case.q, case.k_cache, case.v_cache]
    if dtype == torch.bfloat16 and not ON_GPU:
        return [t.float() for t in tensors], torch.float32
    return tensors, dtype


def _check(out, ref, dtype, record_property):
    err = relative_error(out, ref)
    record_property("rel_err", err)
    assert err <= TOLERANCE[dtype], f"relative error {err:.3e} > {TOLERANCE[dtype]:.0e} ({dtype})"


def _decode_case(kernels, record_property, rng, contexts, num_heads, num_kv_heads, head_dim, block_size,
                 dtype, **run):
    case = make_paged_case(rng, contexts, num_heads, num_kv_heads, head_dim, block_size, dtype=dtype,
                           device=DEVICE)
    (q, k_cache, v_cache), judge = _runnable(case, dtype)
    backend = _backend(kernels, **run.pop("config", {}))
    out = backend.decode(q, k_cache, v_cache, case.block_tables, case.context_lens, case.scale, **run)
    ref = reference_decode(q, k_cache, v_cache, case.block_tables, case.context_lens, case.scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    _check(out, ref, judge, record_property)
    return out


def _prefill_case(kernels, record_property, rng, contexts, q_lens, num_heads, num_kv_heads, head_dim,
                  block_size, dtype):
    case = make_paged_case(rng, contexts, num_heads, num_kv_heads, head_dim, block_size, dtype=dtype,
                           device=DEVICE, q_lens=q_lens)
    (q, k_cache, v_cache), judge = _runnable(case, dtype)
    args = (q, k_cache, v_cache, case.block_tables, case.cu_seqlens_q, case.context_lens, case.scale)
    out = _backend(kernels).prefill(*args)
    _check(out, reference_prefill(*args), judge, record_property)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim,block_size", [(64, 8), (80, 16)])
def test_decode_matches_fp64_reference(kernels, record_property, dtype, group, head_dim, block_size):
    rng = np.random.default_rng(1000 + 10 * group + head_dim)
    _decode_case(kernels, record_property, rng, CONTEXTS, 2 * group, 2, head_dim, block_size, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (80, 8)])
def test_prefill_matches_fp64_reference(kernels, record_property, dtype, group, head_dim, block_size):
    rng = np.random.default_rng(2000 + 10 * group + head_dim)
    # Whole prompt, prefix-cache hit, chunked prefill, q_len = 1 rows, a sequence with no new tokens.
    _prefill_case(kernels, record_property, rng, [1, 16, 37, 8, 64, 30, 23], [1, 16, 10, 1, 30, 0, 23],
                  2 * group, 2, head_dim, block_size, dtype)


@pytest.mark.parametrize("head_dim,block_size", [(96, 32), (128, 256), (256, 8)])
def test_other_head_dims_and_block_sizes(kernels, record_property, head_dim, block_size):
    rng = np.random.default_rng(3000 + head_dim)
    _decode_case(kernels, record_property, rng, [1, 40, 3], 8, 2, head_dim, block_size, torch.float16)
    _prefill_case(kernels, record_property, rng, [1, 40, 3], [1, 24, 3], 8, 2, head_dim, block_size,
                  torch.float16)


@pytest.mark.parametrize("dtype,group", [(torch.float32, 1), (torch.float16, 4)])
def test_split_k_agrees_with_one_pass(kernels, record_property, dtype, group):
    from gpu_backend.ops.triton_decode import split_plan

    contexts, block_size, block_n = [1, 100, 64, 129, 16, 77], 8, 16
    num_splits = 4
    max_blocks = -(-max(contexts) // block_size) + 1  # make_paged_case's table width
    tokens_per_split, effective = split_plan(max_blocks * block_size, num_splits, block_n)
    assert effective >= 3 and tokens_per_split < 77  # the long sequences really span several splits
    outs = [_decode_case(kernels, record_property, np.random.default_rng(4000 + group), contexts, 2 * group,
                         2, 64, block_size, dtype, num_splits=s, config={"block_n": block_n})
            for s in (1, num_splits)]
    assert relative_error(outs[1], outs[0].double()) <= TOLERANCE[dtype]


def test_split_heuristic():
    from gpu_backend.ops.triton_decode import SplitPolicy, choose_num_splits

    h100_sms = 132
    assert choose_num_splits(64, 8, 4096, h100_sms) == 1  # 512 programs already fill the device
    long_single = choose_num_splits(1, 8, 32768, h100_sms)
    assert 1 < long_single <= SplitPolicy().max_splits
    assert choose_num_splits(1, 8, 300, h100_sms) == 1  # too short to be worth a second kernel
    assert choose_num_splits(4, 8, 32768, h100_sms) <= long_single
    assert choose_num_splits(16, 8, 1024, h100_sms) == 1  # split is slower here on an H100 (SplitPolicy)


def test_split_decision_reads_the_longest_context_not_the_table_capacity(kernels, monkeypatch):
    """A short batch in a wide block table must not split: the engine passes the real longest context."""
    from gpu_backend.ops import triton_decode

    seen = []
    real = triton_decode.paged_decode
    monkeypatch.setattr(triton_decode, "paged_decode",
                        lambda *a, **k: seen.append(a[6]) or real(*a, **k))
    case = make_paged_case(np.random.default_rng(5), [3, 9], 2, 2, 64, 4, device=DEVICE)
    wide = torch.cat([case.block_tables, case.block_tables[:, :1].expand(2, 4096)], dim=1)
    backend = _backend(kernels, split_policy=kernels.SplitPolicy(min_tokens_per_split=16))
    backend.decode(case.q, case.k_cache, case.v_cache, wide, case.context_lens, case.scale, max_context_len=9)
    backend.decode(case.q, case.k_cache, case.v_cache, wide, case.context_lens, case.scale)
    # 4 programs on the 4-SM stand-in want 2 splits; 9 tokens are too few, 16k of table capacity are not.
    assert seen == [1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [1, 4])
def test_contiguous_regions_match_reference(kernels, record_property, dtype, block_size):
    """Regions passed as (start, length) read the same slots as a per-position table (NaN elsewhere)."""
    rng = np.random.default_rng(6000 + block_size)
    contexts = [1, 37, 8, 64, 5]
    case, per_slot = make_region_case(rng, contexts, 8, 2, 64, dtype=dtype, device=DEVICE,
                                      block_size=block_size)
    k_ref = case.k_cache.view(-1, 1, *case.k_cache.shape[2:])
    v_ref = case.v_cache.view(-1, 1, *case.v_cache.shape[2:])
    ref = reference_decode(case.q, k_ref, v_ref, per_slot, case.context_lens, case.scale)
    for splits in (1, 3):
        out = _backend(kernels, block_n=16).decode(case.q, case.k_cache, case.v_cache, case.block_tables,
                                                   case.context_lens, case.scale, num_splits=splits,
                                                   max_context_len=max(contexts), contiguous=True)
        _check(out, ref, dtype, record_property)
    q_lens = [1, 20, 8, 3, 5]
    case, per_slot = make_region_case(rng, contexts, 8, 2, 64, dtype=dtype, device=DEVICE, q_lens=q_lens,
                                      block_size=block_size)
    k_ref = case.k_cache.view(-1, 1, *case.k_cache.shape[2:])
    v_ref = case.v_cache.view(-1, 1, *case.v_cache.shape[2:])
    ref = reference_prefill(case.q, k_ref, v_ref, per_slot, case.cu_seqlens_q, case.context_lens, case.scale)
    out = _backend(kernels).prefill(case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens_q,
                                    case.context_lens, case.scale, max(q_lens), contiguous=True)
    _check(out, ref, dtype, record_property)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_writes_slots_and_skips_minus_one(kernels, dtype):
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.full((6, 8, 2, 80), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    qkv = torch.randn((7, 8, 80), generator=gen).to(device=DEVICE, dtype=dtype)
    key, value = qkv[:, 4:6], qkv[:, 6:8]  # strided views of a fused projection
    slots = torch.tensor([3, -1, 47, 8, 9, -1, 0], device=DEVICE)
    _backend(kernels).store_kv(key, value, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // 8, slot % 8], key[t])
            assert torch.equal(v_cache[slot // 8, slot % 8], value[t])
    assert int((~k_cache.isnan()).sum()) == 5 * 2 * 80


def test_unsupported_inputs_raise_typed_errors(kernels):
    rng = np.random.default_rng(6)
    case = make_paged_case(rng, [3, 9], 4, 2, 72, 8, device=DEVICE)
    with pytest.raises(KernelInputError, match="head_dim"):
        _backend(kernels).decode(case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens,
                                 1.0)
    if not ON_GPU:
        case = make_paged_case(rng, [3, 9], 4, 2, 64, 8, dtype=torch.bfloat16)
        with pytest.raises(KernelInputError, match="bfloat16"):
            _backend(kernels).decode(case.q, case.k_cache, case.v_cache, case.block_tables,
                                     case.context_lens, 1.0)


# -- full size on a GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_full_size_decode_and_prefill(kernels, record_property, dtype, group, head_dim, block_size):
    rng = np.random.default_rng(5000 + group + head_dim + block_size)
    contexts = [1, block_size, 4 * block_size, 4096] + rng.integers(1, 4096, size=28).tolist()
    _decode_case(kernels, record_property, rng, contexts, 8 * group, 8, head_dim, block_size, dtype)
    q_lens = [min(c, int(n)) for c, n in zip(contexts[:8], rng.integers(1, 512, size=8), strict=False)]
    _prefill_case(kernels, record_property, rng, contexts[:8], q_lens, 8 * group, 8, head_dim, block_size,
                  dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_long_context_split_k(kernels, record_property, dtype):
    rng = np.random.default_rng(6000)
    out_split = _decode_case(kernels, record_property, rng, [32768], 32, 8, 128, 16, dtype)
    out_one = _decode_case(kernels, record_property, np.random.default_rng(6000), [32768], 32, 8, 128, 16,
                           dtype, num_splits=1)
    assert relative_error(out_split, out_one.double()) <= TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_gpu_int64_addressing(kernels, record_property):
    """70,000 blocks and > 2^31 elements per pool; sequences live in its top blocks.

    GPU only: the interpreter copies every tensor argument to numpy on each launch, which would
    materialize both 4.6 GB pools; the torch backend runs the CPU version (test_ops_torch.py).
    """
    num_blocks, block_size, num_kv_heads, head_dim = 70_000, 16, 16, 128
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=torch.float16,
                         device="cuda")
    v_cache = torch.full_like(k_cache, float("nan"))
    assert k_cache.numel() > 2**31
    tables = torch.tensor([[69_999, 3, 69_990], [65_537, 69_998, 0]], dtype=torch.int32, device="cuda")
    context_lens = torch.tensor([40, 21], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(7)
    backend = _backend(kernels)
    for i, ctx in enumerate(context_lens.tolist()):
        pos = torch.arange(ctx, device="cuda")
        slots = tables[i].long()[pos // block_size] * block_size + pos % block_size
        kv = torch.randn((2, ctx, num_kv_heads, head_dim), generator=gen, device="cuda").half()
        backend.store_kv(kv[0], kv[1], k_cache, v_cache, slots)
        assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[slots], kv[0])
    q = torch.randn((2, 32, head_dim), generator=gen, device="cuda").half()
    scale = head_dim ** -0.5
    ref = reference_decode(q, k_cache, v_cache, tables, context_lens, scale)
    for splits in (1, 2):
        _check(backend.decode(q, k_cache, v_cache, tables, context_lens, scale, num_splits=splits), ref,
               torch.float16, record_property)
    cu = torch.tensor([0, 7, 28], dtype=torch.int32, device="cuda")
    q_pre = torch.randn((28, 32, head_dim), generator=gen, device="cuda").half()
    args = (q_pre, k_cache, v_cache, tables, cu, context_lens, scale)
    _check(backend.prefill(*args), reference_prefill(*args), torch.float16, record_property)


# -- sliding window and logit soft-capping ------------------------------------------------------------


@pytest.mark.parametrize("window,softcap,splits", [(8, None, 1), (13, None, 3), (1, None, 1), (9, 5.0, 1),
                                                   (None, 2.0, 2)])
def test_window_and_softcap_decode_match_reference(kernels, record_property, window, softcap, splits):
    """Blocks wholly before the window point at NaN: a kernel that reads them instead of skipping fails."""
    rng = np.random.default_rng(7000 + (window or 0))
    contexts = [1, 37, 64, 5, 45]
    case = make_paged_case(rng, contexts, 4, 2, 64, 4, device=DEVICE)
    tables = hide_out_of_window(case, window) if window else case.block_tables
    args = (case.q, case.k_cache, case.v_cache, tables, case.context_lens, case.scale)
    out = _backend(kernels, block_n=16).decode(*args, num_splits=splits, max_context_len=max(contexts),
                                               window=window, softcap=softcap)
    _check(out, reference_decode(*args, window=window, softcap=softcap), torch.float32, record_property)


@pytest.mark.parametrize("window,softcap", [(8, None), (5, 3.0)])
def test_window_and_softcap_prefill_match_reference(kernels, record_property, window, softcap):
    rng = np.random.default_rng(8000 + window)
    q_lens = [1, 20, 10, 0, 23]
    case = make_paged_case(rng, [1, 37, 30, 8, 45], 4, 2, 64, 4, device=DEVICE, q_lens=q_lens)
    tables = hide_out_of_window(case, window, q_lens)
    args = (case.q, case.k_cache, case.v_cache, tables, case.cu_seqlens_q, case.context_lens, case.scale)
    out = _backend(kernels, block_m=16, block_n=16).prefill(*args, window=window, softcap=softcap)
    _check(out, reference_prefill(*args, window=window, softcap=softcap), torch.float32, record_property)


@pytest.mark.parametrize("window", [1, 13])
def test_window_over_contiguous_regions_matches_reference(kernels, record_property, window):
    rng = np.random.default_rng(9000 + window)
    contexts = [1, 37, 8, 64, 5]
    case, per_slot = make_region_case(rng, contexts, 4, 2, 64, device=DEVICE)
    k_ref = case.k_cache.view(-1, 1, *case.k_cache.shape[2:])
    v_ref = case.v_cache.view(-1, 1, *case.v_cache.shape[2:])
    ref = reference_decode(case.q, k_ref, v_ref, per_slot, case.context_lens, case.scale, window)
    for splits in (1, 2):
        out = _backend(kernels, block_n=16).decode(case.q, case.k_cache, case.v_cache, case.block_tables,
                                                   case.context_lens, case.scale, num_splits=splits,
                                                   max_context_len=max(contexts), contiguous=True,
                                                   window=window)
        _check(out, ref, torch.float32, record_property)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_sliding_window_full_size(kernels, record_property, dtype, block_size):
    """Long contexts (split-K), a window off block boundaries, out-of-window blocks poisoned."""
    rng = np.random.default_rng(9100 + block_size)
    window = 1000
    contexts = [1, block_size, 999, 1001, 4096, 32768] + rng.integers(1, 8192, size=10).tolist()
    case = make_paged_case(rng, contexts, 32, 8, 128, block_size, dtype=dtype, device=DEVICE)
    tables = hide_out_of_window(case, window)
    args = (case.q, case.k_cache, case.v_cache, tables, case.context_lens, case.scale)
    ref = reference_decode(*args, window=window)
    for splits in (None, 1):
        out = _backend(kernels).decode(*args, num_splits=splits, max_context_len=max(contexts), window=window)
        _check(out, ref, dtype, record_property)
    q_lens = [min(c, int(n)) for c, n in zip(contexts[:8], rng.integers(1, 1500, size=8), strict=False)]
    case = make_paged_case(rng, contexts[:8], 32, 8, 128, block_size, dtype=dtype, device=DEVICE,
                           q_lens=q_lens)
    tables = hide_out_of_window(case, window, q_lens)
    args = (case.q, case.k_cache, case.v_cache, tables, case.cu_seqlens_q, case.context_lens, case.scale)
    _check(_backend(kernels).prefill(*args, window=window, softcap=30.0),
           reference_prefill(*args, window=window, softcap=30.0), dtype, record_property)

"""The torch attention backend against an independent fp64 reference (gpu_backend.ops.reference).

Relative error ||out - ref|| / ||ref|| must stay within TOLERANCE[dtype]; every case's error is recorded
as a junit property (`rel_err`) and shown in the failure message. Unused slots are NaN (cases.py).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_backend.ops import KernelInputError, TorchBackend, TorchBackendConfig, get_backend
from gpu_backend.ops.cases import hide_out_of_window, make_paged_case, make_region_case
from gpu_backend.ops.reference import reference_decode, reference_prefill, relative_error
from gpu_backend.ops.torch_gather import tiles_by_bytes

# Per-dtype bounds on ||out - ref|| / ||ref|| (observed: fp32 ~1e-7, fp16 ~2e-4, bf16 ~2e-3).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Ragged lengths: 1, exact multiples of the block size (8 and 16), and odd tails.
CONTEXTS = [1, 16, 37, 8, 64, 5, 23]
# Decode tiles: the default packs these small sequences into tiles of similar lengths (padding bounded);
# "padded" packs them all into one ragged tile; solo_bytes=0 gives every sequence a tile of its own,
# which takes the whole-block copy path. "one-tile" is the configuration get_backend() uses on CUDA.
TILINGS = {"batched": TorchBackendConfig(), "padded": TorchBackendConfig(decode_max_pad=None),
           "per-sequence": TorchBackendConfig(solo_bytes=0),
           "one-tile": TorchBackendConfig(tile_bytes=1 << 62, solo_bytes=1 << 62, reuse_workspace=False)}


def _check(out, ref, dtype, record_property):
    err = relative_error(out, ref)
    record_property("rel_err", err)
    assert err <= TOLERANCE[dtype], f"relative error {err:.3e} > {TOLERANCE[dtype]:.0e} ({dtype})"


@pytest.mark.parametrize("tiling", TILINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim,block_size", [(64, 8), (80, 16)])
def test_decode_matches_fp64_reference(dtype, group, head_dim, block_size, tiling, record_property):
    rng = np.random.default_rng(100 + group + head_dim)
    case = make_paged_case(rng, CONTEXTS, 2 * group, 2, head_dim, block_size, dtype=dtype)
    out = TorchBackend(TILINGS[tiling]).decode(case.q, case.k_cache, case.v_cache, case.block_tables,
                                               case.context_lens, case.scale)
    ref = reference_decode(case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens,
                           case.scale)
    assert out.shape == case.q.shape and out.dtype == dtype
    _check(out, ref, dtype, record_property)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (80, 8)])
def test_prefill_matches_fp64_reference(dtype, group, head_dim, block_size, record_property):
    rng = np.random.default_rng(200 + group + head_dim)
    # Full prompt, prefix-cache hit, chunked prefill, q_len=1 rows, and a sequence with no new tokens.
    q_lens = [1, 16, 10, 1, 30, 0, 23]
    case = make_paged_case(rng, CONTEXTS[:5] + [30, 23], 2 * group, 2, head_dim, block_size, dtype=dtype,
                           q_lens=q_lens)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens_q, case.context_lens,
            case.scale)
    out = TorchBackend().prefill(*args)
    _check(out, reference_prefill(*args), dtype, record_property)


def test_small_tiles_agree_with_one_tile(record_property):
    """Tiling by bytes (many tiles of mixed lengths) must not change the result."""
    rng = np.random.default_rng(3)
    case = make_paged_case(rng, CONTEXTS, 8, 2, 64, 8, q_lens=[1, 5, 37, 8, 2, 5, 1])
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens_q, case.context_lens,
            case.scale)
    tiny = TorchBackend(TorchBackendConfig(tile_bytes=4096)).prefill(*args)
    one = TorchBackend(TorchBackendConfig(tile_bytes=1 << 40)).prefill(*args)
    padded = TorchBackend(TorchBackendConfig(tile_bytes=1 << 40, prefill_max_pad=None)).prefill(*args)
    _check(tiny, reference_prefill(*args), torch.float32, record_property)
    torch.testing.assert_close(tiny, one, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(padded, one, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_pad", [0.0, 0.25, 1.0])
def test_prefill_tiles_bound_their_padded_area(max_pad):
    """Every prefill tile's padded query x context rectangle stays within (1 + max_pad) x its rows' own."""
    rng = np.random.default_rng(7)
    ctx = [int(c) for c in rng.integers(1, 1500, size=24)] + [600] * 6
    q = [int(rng.integers(1, c + 1)) for c in ctx[:24]] + [600] * 6  # prompts, chunks, prefix hits
    tiles = tiles_by_bytes(ctx, q, 1024, 8 << 20, max_pad=max_pad)
    assert sorted(i for rows, _, _ in tiles for i in rows) == list(range(len(ctx)))
    for rows, max_ctx, max_q in tiles:
        assert (max_ctx, max_q) == (max(ctx[i] for i in rows), max(q[i] for i in rows))
        assert len(rows) * max_q * max_ctx <= (1 + max_pad) * sum(q[i] * ctx[i] for i in rows)
    assert any(len(rows) >= 6 for rows, _, _ in tiles)  # equal prompts still share a tile
    assert len(tiles_by_bytes(ctx, q, 1024, 8 << 20)) < len(tiles)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), st.floats(0.0, 1.0)), min_size=1, max_size=40),
       st.sampled_from([0.0, 0.25, 1.0]), st.sampled_from([1 << 16, 8 << 20]))
def test_any_tiling_covers_every_sequence_once_within_its_padding_bound(seqs, max_pad, tile_bytes):
    ctx = [c for c, _ in seqs]
    q = [max(1, round(f * c)) for c, f in seqs]
    tiles = tiles_by_bytes(ctx, q, 1024, tile_bytes, max_pad=max_pad)
    assert sorted(i for rows, _, _ in tiles for i in rows) == list(range(len(ctx)))
    for rows, max_ctx, max_q in tiles:
        assert len(rows) * max_q * max_ctx <= (1 + max_pad) * sum(q[i] * ctx[i] for i in rows)


@pytest.mark.parametrize("max_pad", [0.0, 0.25, 1.0])
def test_decode_tiles_bound_their_padding(max_pad):
    """Every tile's padded K/V (rows x longest context) stays within (1 + max_pad) x its real tokens."""
    rng = np.random.default_rng(6)
    ctx = [int(c) for c in rng.integers(1, 900, size=64)] + [400] * 16
    tiles = tiles_by_bytes(ctx, [1] * len(ctx), 1024, 8 << 20, 1 << 20, max_pad)
    assert sorted(i for rows, _, _ in tiles for i in rows) == list(range(len(ctx)))
    for rows, max_ctx, _ in tiles:
        assert max_ctx == max(ctx[i] for i in rows)
        assert len(rows) * max_ctx <= (1 + max_pad) * sum(ctx[i] for i in rows)
    assert any(len(rows) >= 16 for rows, _, _ in tiles)  # equal contexts still share a tile
    unbounded = tiles_by_bytes(ctx, [1] * len(ctx), 1024, 8 << 20, 1 << 20)
    assert len(unbounded) < len(tiles)


def test_nan_fill_catches_reading_past_the_context():
    """Sanity of the test harness: one position past a context length must read NaN."""
    rng = np.random.default_rng(4)
    case = make_paged_case(rng, [5, 16], 4, 2, 64, 8)
    longer = case.context_lens + torch.tensor([1, 1], dtype=torch.int32)
    ref = reference_decode(case.q, case.k_cache, case.v_cache, case.block_tables, longer, case.scale)
    assert torch.isnan(ref).any(dim=(1, 2)).all()


@pytest.mark.parametrize("tiling", TILINGS)
def test_decode_empty_context_gives_zeros(tiling):
    rng = np.random.default_rng(5)
    case = make_paged_case(rng, [0, 9], 4, 1, 64, 8)
    out = TorchBackend(TILINGS[tiling]).decode(case.q, case.k_cache, case.v_cache, case.block_tables,
                                               case.context_lens, case.scale)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(out[1]).all()


def test_store_kv_writes_slots_and_skips_minus_one():
    torch.manual_seed(0)
    k_cache = torch.full((6, 8, 2, 80), float("nan"))
    v_cache = k_cache.clone()
    qkv = torch.randn(7, 8, 80)  # key/value as strided views of a fused projection
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([3, -1, 47, 8, 9, -1, 0])
    TorchBackend().store_kv(key, value, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // 8, slot % 8], key[t])
            assert torch.equal(v_cache[slot // 8, slot % 8], value[t])
    assert int((~k_cache.isnan()).sum()) == 5 * 2 * 80  # nothing else written


@pytest.mark.parametrize("tiling", TILINGS)
def test_int64_addressing_past_2_pow_31_elements(tiling, record_property):
    """A pool of 70,000 blocks and > 2^31 elements; sequences live in its top blocks.

    torch.empty maps the pool lazily, so only the touched blocks cost memory (a few MiB).
    """
    num_blocks, block_size, num_kv_heads, head_dim = 70_000, 16, 16, 128
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=torch.float16)
    v_cache = torch.empty(shape, dtype=torch.float16)
    assert k_cache.numel() > 2**31
    tables = torch.tensor([[69_999, 3, 69_990], [65_537, 69_998, 0]], dtype=torch.int32)
    context_lens = torch.tensor([40, 21], dtype=torch.int32)
    gen = torch.Generator().manual_seed(6)
    backend = TorchBackend(TILINGS[tiling])
    for i, ctx in enumerate(context_lens.tolist()):
        pos = torch.arange(ctx)
        slots = tables[i].long()[pos // block_size] * block_size + pos % block_size
        # Tail of the last block: NaN, so a read past the context fails.
        last = int(tables[i, (ctx - 1) // block_size])
        k_cache[last], v_cache[last] = float("nan"), float("nan")
        kv = torch.randn((2, ctx, num_kv_heads, head_dim), generator=gen).half()
        backend.store_kv(kv[0], kv[1], k_cache, v_cache, slots)
    q = torch.randn((2, 32, head_dim), generator=gen).half()
    out = backend.decode(q, k_cache, v_cache, tables, context_lens, head_dim ** -0.5)
    ref = reference_decode(q, k_cache, v_cache, tables, context_lens, head_dim ** -0.5)
    err = relative_error(out, ref)
    record_property("rel_err", err)
    assert err <= TOLERANCE[torch.float16]


def test_get_backend_names():
    assert get_backend("torch").name == "torch"
    if not torch.cuda.is_available():
        assert get_backend("auto").name == "torch"
    with pytest.raises(KernelInputError, match="unknown attention backend"):
        get_backend("cuda-graphs")


def test_bad_shapes_raise_typed_errors():
    rng = np.random.default_rng(7)
    case = make_paged_case(rng, [5, 9], 6, 4, 64, 8)  # 6 query heads over 4 KV heads: not GQA
    with pytest.raises(KernelInputError, match="not a multiple"):
        TorchBackend().decode(case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 1.0)
    case = make_paged_case(rng, [5, 9], 4, 2, 64, 8)
    too_long = torch.tensor([5, 10_000], dtype=torch.int32)
    with pytest.raises(KernelInputError, match="exceeds block_tables capacity"):
        TorchBackend().decode(case.q, case.k_cache, case.v_cache, case.block_tables, too_long, 1.0)
    with pytest.raises(KernelInputError, match="cu_seqlens_q"):
        TorchBackend().prefill(case.q, case.k_cache, case.v_cache, case.block_tables,
                               torch.tensor([0, 1, 3], dtype=torch.int32), case.context_lens, 1.0)


@pytest.mark.parametrize("block_size", [1, 4])
def test_contiguous_regions_match_reference(block_size, record_property):
    """Regions (start, length) read exactly their slots; NaN everywhere else never leaks in."""
    rng = np.random.default_rng(70 + block_size)
    contexts, q_lens = [1, 37, 8, 64, 5], [1, 20, 8, 3, 5]
    for lens in (None, q_lens):
        case, per_slot = make_region_case(rng, contexts, 8, 2, 64, q_lens=lens, block_size=block_size)
        k_ref = case.k_cache.view(-1, 1, *case.k_cache.shape[2:])
        v_ref = case.v_cache.view(-1, 1, *case.v_cache.shape[2:])
        backend = TorchBackend()
        if lens is None:
            ref = reference_decode(case.q, k_ref, v_ref, per_slot, case.context_lens, case.scale)
            out = backend.decode(case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens,
                                 case.scale, contiguous=True)
        else:
            args = (case.cu_seqlens_q, case.context_lens, case.scale)
            ref = reference_prefill(case.q, k_ref, v_ref, per_slot, *args)
            out = backend.prefill(case.q, case.k_cache, case.v_cache, case.block_tables, *args,
                                  contiguous=True)
        err = relative_error(out, ref)
        record_property("rel_err", err)
        assert err <= 1e-5


# -- sliding window and logit soft-capping ------------------------------------------------------------
WINDOW_CONTEXTS = [1, 16, 37, 8, 64, 5, 23, 45]


@pytest.mark.parametrize("tiling", TILINGS)
@pytest.mark.parametrize("window,softcap", [(8, None), (13, None), (1, None), (100, None), (9, 5.0),
                                            (None, 2.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_and_softcap_decode_match_reference(tiling, window, softcap, dtype, record_property):
    """Blocks wholly before the window point at NaN: reading one instead of skipping it shows up."""
    rng = np.random.default_rng(300 + (window or 0))
    case = make_paged_case(rng, WINDOW_CONTEXTS, 8, 2, 64, 4, dtype=dtype)
    tables = hide_out_of_window(case, window) if window else case.block_tables
    args = (case.q, case.k_cache, case.v_cache, tables, case.context_lens, case.scale)
    out = TorchBackend(TILINGS[tiling]).decode(*args, window=window, softcap=softcap)
    ref = reference_decode(*args, window=window, softcap=softcap)
    _check(out, ref, dtype, record_property)
    if window and window < 37:  # the window changes the answer
        assert relative_error(reference_decode(*args[:3], case.block_tables, *args[4:]), ref) > 1e-2


@pytest.mark.parametrize("window,softcap", [(8, None), (13, None), (1, None), (6, 3.0), (None, 2.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_window_and_softcap_prefill_match_reference(window, softcap, dtype, record_property):
    rng = np.random.default_rng(400 + (window or 0))
    q_lens = [1, 16, 10, 1, 30, 0, 23, 20]
    case = make_paged_case(rng, WINDOW_CONTEXTS[:5] + [30, 23, 45], 8, 2, 64, 4, dtype=dtype, q_lens=q_lens)
    tables = hide_out_of_window(case, window, q_lens) if window else case.block_tables
    args = (case.q, case.k_cache, case.v_cache, tables, case.cu_seqlens_q, case.context_lens, case.scale)
    for config in (TorchBackendConfig(), TorchBackendConfig(tile_bytes=4096)):
        out = TorchBackend(config).prefill(*args, window=window, softcap=softcap)
        _check(out, reference_prefill(*args, window=window, softcap=softcap), dtype, record_property)


def test_window_and_softcap_refuse_bad_values():
    case = make_paged_case(np.random.default_rng(7), [3, 9], 4, 2, 64, 8)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale)
    with pytest.raises(KernelInputError, match="sliding window"):
        TorchBackend().decode(*args, window=-1)
    with pytest.raises(KernelInputError, match="soft-cap"):
        TorchBackend().decode(*args, softcap=-2.0)


@pytest.mark.parametrize("window", [1, 8, 13])
def test_window_over_contiguous_regions_matches_reference(window, record_property):
    rng = np.random.default_rng(500 + window)
    contexts, q_lens = [1, 37, 8, 64, 5], [1, 20, 8, 3, 5]
    for lens in (None, q_lens):
        case, per_slot = make_region_case(rng, contexts, 8, 2, 64, q_lens=lens)
        k_ref = case.k_cache.view(-1, 1, *case.k_cache.shape[2:])
        v_ref = case.v_cache.view(-1, 1, *case.v_cache.shape[2:])
        if lens is None:
            out = TorchBackend().decode(case.q, case.k_cache, case.v_cache, case.block_tables,
                                        case.context_lens, case.scale, contiguous=True, window=window)
            ref = reference_decode(case.q, k_ref, v_ref, per_slot, case.context_lens, case.scale, window)
        else:
            args = (case.cu_seqlens_q, case.context_lens, case.scale)
            out = TorchBackend().prefill(case.q, case.k_cache, case.v_cache, case.block_tables, *args,
                                         contiguous=True, window=window)
            ref = reference_prefill(case.q, k_ref, v_ref, per_slot, *args, window)
        _check(out, ref, torch.float32, record_property)

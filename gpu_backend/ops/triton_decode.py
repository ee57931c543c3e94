"""Triton paged decode attention: one query token per sequence, K/V read through the block table.

Grid (B, Hkv, S): a program owns one KV head of one sequence and serves all G = Hq // Hkv query heads
that share it from a single load of each K/V tile (GQA packing; G is padded to >= 16 rows for tl.dot).
With S > 1 (split-K) each sequence's context is cut into S equal runs of whole BLOCK_N tiles, sized on
the device from that sequence's own length, and each program covers one run and writes fp32 partials
(unnormalized acc, running max m, sum l); `_split_reduce_kernel` merges them. Sizing each sequence's
runs on the device keeps every split busy in a CUDA graph, whose split count was fixed at capture for
the longest context allowed, and in a batch of mixed lengths. Softmax is online, fp32,
in the log2 domain. Tiles of BLOCK_N tokens may span several KV blocks: each token looks up its own
physical block, so any block size works. All pool offsets are int64.

Sliding window (window > 0, a per-layer argument): the query at position ctx - 1 sees positions
[ctx - window, ctx). The loop starts at the first KV block holding one of them, so blocks wholly before
the window are never read (nor their block-table entries); only that first block's head is masked.
Splits then cover [that block's start, ctx) rather than [0, ctx).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_backend.ops.triton_tile import attend_tile, interpreting, jit_unspecialized

LOG2E = 1.4426950408889634
# The reduce kernel's split tile: one size for every split count the heuristic picks (a constexpr per
# count would compile a variant per power of two); rows past the split count are masked, never loaded.
SPLITS_PAD = 64


@triton.jit
def split_tokens(span, num_splits, BLOCK_N: tl.constexpr):
    """Positions per split of a sequence whose splits cover `span` positions: whole BLOCK_N tiles, at
    least one (so an empty context divides by something)."""
    return tl.maximum(tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N, BLOCK_N)


# Both change from step to step when decode runs eagerly (CUDA graphs fix them at capture).
@jit_unspecialized("num_splits", "stride_bt")
def _paged_decode_kernel(
    out_ptr,  # [B, Hq, D] (1-pass)
    part_acc_ptr, part_m_ptr, part_l_ptr,  # [B, Hq, S, D_PAD], [B, Hq, S], [B, Hq, S] fp32 (split-K)
    q_ptr,  # [B, Hq, D]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32/int64; [B, 1] region starts if CONTIGUOUS
    context_lens_ptr,  # [B] int32
    scale_log2,  # softmax scale * log2(e)
    softcap_log2,  # logit soft-cap * log2(e) (SOFTCAP)
    window,  # sliding window in tokens (SLIDING)
    num_heads, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
    CONTIGUOUS: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, WHILE_LOOP: tl.constexpr,
):
    """Online-softmax attention of G query heads over positions [lo + split*tps, min(.. + tps, ctx)).

    lo is 0, or with SLIDING the first position of the KV block that holds position ctx - window; tps
    (split_tokens) is this sequence's run length.
    """
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    if SLIDING:
        win_start = tl.maximum(ctx - window, 0)
        lo = (win_start // BLOCK_SIZE) * BLOCK_SIZE
    else:
        win_start = 0
        lo = 0
    tps = split_tokens(ctx - lo, num_splits, BLOCK_N)
    start = lo + split * tps
    end = tl.minimum(start + tps, ctx)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    d_mask = offs_d < D  # head dims 80, 96: padded to 128 and masked
    heads = kvh * G + offs_g  # [G_PAD] query heads served by this KV head
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [G_PAD, D_PAD]
    q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    region_start = tl.load(bt_row).to(tl.int64)  # CONTIGUOUS: first slot of the region (else unused)
    q_pos = offs_g  # unused by the non-causal tile (every row sees every key)
    q_lo = tl.zeros([G_PAD], tl.int32) + win_start  # [G_PAD] (SLIDING only)
    if WHILE_LOOP:  # the interpreter (see triton_tile)
        n0 = start
        while n0 < end:
            m_i, l_i, acc = attend_tile(n0, end, q, m_i, l_i, acc, q_pos, q_lo, k_cache_ptr, v_cache_ptr,
                                        bt_row, region_start, kvh, stride_cb, stride_cs, stride_ch,
                                        scale_log2, softcap_log2, offs_n, offs_d, d_mask, BLOCK_SIZE,
                                        CONTIGUOUS, False, SLIDING, SOFTCAP, DOT_PREC)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = attend_tile(n0, end, q, m_i, l_i, acc, q_pos, q_lo, k_cache_ptr, v_cache_ptr,
                                        bt_row, region_start, kvh, stride_cb, stride_cs, stride_ch,
                                        scale_log2, softcap_log2, offs_n, offs_d, d_mask, BLOCK_SIZE,
                                        CONTIGUOUS, False, SLIDING, SOFTCAP, DOT_PREC)

    if SPLIT:
        row = (b * num_heads + heads) * num_splits + split  # [G_PAD]
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], acc, mask=g_mask[:, None])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty context -> zeros
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@jit_unspecialized("num_splits")
def _split_reduce_kernel(
    out_ptr,  # [B, Hq, D]
    part_acc_ptr, part_m_ptr, part_l_ptr,  # [B, Hq, S, D_PAD], [B, Hq, S], [B, Hq, S] fp32
    context_lens_ptr,  # [B] int32
    window, num_heads, num_splits, stride_ob, stride_oh,
    D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SLIDING: tl.constexpr,
):
    """Merge the split-K partials of one (sequence, query head): rescale by exp2(m_s - max m)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    ctx = tl.load(context_lens_ptr + b)
    if SLIDING:  # noqa: SIM108 - the splits started at the window's first block (see the decode kernel)
        span = ctx - (tl.maximum(ctx - window, 0) // BLOCK_SIZE) * BLOCK_SIZE
    else:
        span = ctx
    # Splits past the last that holds a position ran no tile.
    used = tl.minimum(tl.cdiv(span, split_tokens(span, num_splits, BLOCK_N)), num_splits)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < used
    row = (b * num_heads + h) * num_splits + offs_s  # [S_PAD]
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # empty context: keep weights finite
    w = tl.exp2(m - m_max)  # [S_PAD]
    l_total = tl.sum(w * l_s, 0)
    acc = tl.load(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(l_total > 0, l_total, 1.0)  # [D_PAD]
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < D)


@dataclass(frozen=True)
class SplitPolicy:
    """Split-K heuristic: split only when B * Hkv programs cannot fill the device."""

    programs_per_sm: int = 2  # aim for this many (sequence, kv head, split) programs per SM
    # Below this a split's fixed cost (partials, a second kernel) outweighs its parallelism: on an H100,
    # splitting 16 sequences of 1k context nearly doubles their time, while one of 32k runs 3x faster.
    min_tokens_per_split: int = 1024
    max_splits: int = SPLITS_PAD  # bounds the partial buffers; more would widen the reduce tile


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int,
                      policy: SplitPolicy = SplitPolicy()) -> int:
    """Number of context splits for a decode call (1 = single-pass kernel, no reduce).

    max_context is the longest context of the batch (not the block table's capacity, which may be far
    larger and would split short batches).
    """
    programs = num_seqs * num_kv_heads
    target = policy.programs_per_sm * num_sms
    if programs >= target:
        return 1
    by_length = max_context // policy.min_tokens_per_split
    return max(1, min(triton.cdiv(target, max(programs, 1)), by_length, policy.max_splits))


def decode_span(max_context: int, window: int, block_size: int) -> int:
    """The most positions one decode query reads: its context, or at most window + block_size - 1 (the
    window plus the head of the first block it reaches into)."""
    return max_context if window <= 0 else min(max_context, window + block_size - 1)


def split_plan(max_context: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """(tokens_per_split, effective num_splits) for the longest context: splits hold whole BLOCK_N tiles
    and none of its splits is empty (the kernels size each sequence's splits the same way)."""
    tokens_per_split = triton.cdiv(triton.cdiv(max(max_context, 1), num_splits), block_n) * block_n
    return tokens_per_split, triton.cdiv(max(max_context, 1), tokens_per_split)


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float, num_splits: int,
                 max_context: int, block_n: int = 64, num_warps: int = 4,
                 contiguous: bool = False, window: int = 0, softcap: float = 0.0,
                 num_stages: int | None = None) -> torch.Tensor:
    """Launch decode (1-pass when num_splits == 1, else split-K + reduce); returns [B, Hq, D].

    max_context: an upper bound of context_lens (the engine knows the exact longest context on the
    host); it bounds the number of splits (split_plan), and each sequence's splits share its own context,
    or its window's span (decode_span). contiguous: block_tables
    [B, 1] holds region starts. window > 0: sliding-window attention; softcap > 0: logit soft-capping.
    num_stages: the software pipeline depth of the tile loop (None: Triton's default).
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    d_pad = triton.next_power_of_2(head_dim)
    span = decode_span(max_context, window, block_size)
    _, num_splits = split_plan(span, num_splits, block_n)
    split = num_splits > 1
    if split:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, d_pad), dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused by the 1-pass specialization
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_acc, part_m, part_l, q, k_cache, v_cache, block_tables, context_lens,
        scale * LOG2E, softcap * LOG2E, window, num_heads, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=split,
        DOT_PREC="ieee" if k_cache.dtype == torch.float32 else "tf32",
        CONTIGUOUS=contiguous, SLIDING=window > 0, SOFTCAP=softcap > 0, WHILE_LOOP=interpreting(),
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
    )
    if split:
        _split_reduce_kernel[(num_seqs, num_heads)](
            out, part_acc, part_m, part_l, context_lens, window, num_heads, num_splits,
            out.stride(0), out.stride(1),
            D=head_dim, D_PAD=d_pad, S_PAD=max(SPLITS_PAD, triton.next_power_of_2(num_splits)),
            BLOCK_SIZE=block_size, BLOCK_N=block_n, SLIDING=window > 0,
        )
    return out

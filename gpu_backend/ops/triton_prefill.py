"""Triton paged prefill attention: packed new tokens attend causally to their whole paged context.

Sequence i has q_len_i = cu[i+1] - cu[i] new tokens at positions ctx_i - q_len_i .. ctx_i - 1, already
stored in the pool; every key (cached prefix and new tokens alike) is read through the block table.
Grid (B, Hkv, ceil(max_q_len / BLOCK_Q)): a program takes BLOCK_Q tokens x the G query heads of one KV
head as BLOCK_M = BLOCK_Q * G_PAD rows (row r: token r // G_PAD, head r % G_PAD), so each K/V tile
load serves all of them. Covers prefix-cache hits, chunked prefill, recompute and q_len = 1 rows.
With a sliding window (window > 0) the query at position p sees [p - window + 1, p]: a program's loop
starts at the KV block holding its first query's first visible position, so blocks wholly before every
window of the tile are never read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_backend.ops.triton_decode import LOG2E
from gpu_backend.ops.triton_tile import attend_tile, interpreting, jit_unspecialized


@jit_unspecialized("stride_bt")  # the block table's width is the step's longest sequence, in blocks
def _paged_prefill_kernel(
    out_ptr, q_ptr,  # [T, Hq, D]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32/int64; [B, 1] region starts if CONTIGUOUS
    cu_seqlens_ptr,  # [B + 1] int32
    context_lens_ptr,  # [B] int32, including the new tokens
    scale_log2,
    softcap_log2,  # logit soft-cap * log2(e) (SOFTCAP)
    window,  # sliding window in tokens (SLIDING)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    CONTIGUOUS: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, WHILE_LOOP: tl.constexpr,
):
    """Causal online-softmax attention for BLOCK_Q new tokens x G heads of one sequence."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    q_tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + b)
    q_len = tl.load(cu_seqlens_ptr + b + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(context_lens_ptr + b)
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    tok = q_tile * BLOCK_Q + offs_m // G_PAD  # [BLOCK_M] token index within the sequence
    g = offs_m % G_PAD
    m_valid = (tok < q_len) & (g < G)
    d_mask = offs_d < D
    q_pos = ctx - q_len + tok  # [BLOCK_M] absolute position of each query row
    q_rows = (q_start + tok).to(tl.int64)
    heads = kvh * G + g
    io_mask = m_valid[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)  # [BLOCK_M, D_PAD]
    q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # The tile's last query sits at ctx - q_len + min((q_tile+1)*BLOCK_Q, q_len) - 1.
    kv_end = ctx - q_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    if SLIDING:
        q_lo = q_pos - window + 1  # [BLOCK_M]
        # The tile's first query sits at ctx - q_len + q_tile * BLOCK_Q; its window starts earliest.
        first_visible = tl.maximum(ctx - q_len + q_tile * BLOCK_Q - window + 1, 0)
        kv_start = (first_visible // BLOCK_SIZE) * BLOCK_SIZE
    else:
        q_lo = q_pos
        kv_start = 0
    bt_row = block_tables_ptr + b * stride_bt
    region_start = tl.load(bt_row).to(tl.int64)  # CONTIGUOUS: first slot of the region (else unused)
    if WHILE_LOOP:  # the interpreter (see triton_tile)
        n0 = tl.zeros([], tl.int32) + kv_start
        while n0 < kv_end:
            m_i, l_i, acc = attend_tile(n0, kv_end, q, m_i, l_i, acc, q_pos, q_lo, k_cache_ptr, v_cache_ptr,
                                        bt_row, region_start, kvh, stride_cb, stride_cs, stride_ch,
                                        scale_log2, softcap_log2, offs_n, offs_d, d_mask, BLOCK_SIZE,
                                        CONTIGUOUS, True, SLIDING, SOFTCAP, DOT_PREC)
            n0 += BLOCK_N
    else:
        for n0 in range(kv_start, kv_end, BLOCK_N):
            m_i, l_i, acc = attend_tile(n0, kv_end, q, m_i, l_i, acc, q_pos, q_lo, k_cache_ptr, v_cache_ptr,
                                        bt_row, region_start, kvh, stride_cb, stride_cs, stride_ch,
                                        scale_log2, softcap_log2, offs_n, offs_d, d_mask, BLOCK_SIZE,
                                        CONTIGUOUS, True, SLIDING, SOFTCAP, DOT_PREC)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale: float,
                  max_query_len: int, block_m: int = 64, block_n: int = 64,
                  num_warps: int = 4, contiguous: bool = False, window: int = 0,
                  softcap: float = 0.0) -> torch.Tensor:
    """Launch the prefill kernel over (B, Hkv, query tiles); returns [T, Hq, D].

    contiguous: block_tables [B, 1] holds each sequence's region start (slot) in the pool.
    window > 0: sliding-window attention; softcap > 0: logit soft-capping.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    block_q = max(1, block_m // g_pad)
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _paged_prefill_kernel[grid](
        out, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale * LOG2E, softcap * LOG2E,
        window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        G=group, G_PAD=g_pad, D=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_N=block_n,
        DOT_PREC="ieee" if k_cache.dtype == torch.float32 else "tf32",
        CONTIGUOUS=contiguous, SLIDING=window > 0, SOFTCAP=softcap > 0, WHILE_LOOP=interpreting(),
        num_warps=num_warps,
    )
    return out

"""Triton paged prefill attention: packed new tokens attend causally to their whole paged context.

Sequence i has q_len_i = cu[i+1] - cu[i] new tokens at positions ctx_i - q_len_i .. ctx_i - 1, already
stored in the pool; every key (cached prefix and new tokens alike) is read through the block table.
Grid (B, Hkv, ceil(max_q_len / BLOCK_Q)): a program takes BLOCK_Q tokens x the G query heads of one KV
head as BLOCK_M = BLOCK_Q * G_PAD rows (row r: token r // G_PAD, head r % G_PAD), so each K/V tile
load serves all of them. Covers prefix-cache hits, chunked prefill, recompute and q_len = 1 rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_backend.ops.triton_decode import LOG2E


@triton.jit
def _paged_prefill_kernel(
    out_ptr, q_ptr,  # [T, Hq, D]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    cu_seqlens_ptr,  # [B + 1] int32
    context_lens_ptr,  # [B] int32, including the new tokens
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
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
    bt_row = block_tables_ptr + b * stride_bt
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + offs_n  # [BLOCK_N]
        n_mask = pos < kv_end
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs + kvh * stride_ch  # [BLOCK_N]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        # K tile [BLOCK_N, D_PAD]; masked lanes (past the context, padded dims) read as 0.
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # [BLOCK_M, BLOCK_N]
        allowed = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # V tile [BLOCK_N, D_PAD], same addresses as K.
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale: float,
                  max_query_len: int, block_m: int = 64, block_n: int = 64,
                  num_warps: int = 4) -> torch.Tensor:
    """Launch the prefill kernel over (B, Hkv, query tiles); returns [T, Hq, D]."""
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
        out, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        G=group, G_PAD=g_pad, D=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_N=block_n,
        DOT_PREC="ieee" if k_cache.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )
    return out

"""The inner step shared by the Triton decode and prefill kernels: one BLOCK_N tile of K/V.

A tile's addresses come either from the block table (paged: each position looks up its block) or from
a region start (contiguous: slot = start + position, no table read). `attend_tile` folds the tile into
the online-softmax state (m, l, acc), fp32, log2 domain. Both kernels loop over tiles with `range`
when compiled (so Triton can pipeline the loads) and with `while` under the interpreter: Triton 3.6's
interpreter holds scalars as shape-(1,) arrays, and `range` with such a bound raises "only
0-dimensional arrays can be converted to Python scalars" on NumPy >= 2.4 (3.9 is fine either way).
"""
from __future__ import annotations

import inspect

import triton
import triton.language as tl


def jit_unspecialized(*names: str):
    """@triton.jit that compiles one kernel for every value of the named integer arguments.

    Triton specializes an int argument on whether it is a multiple of 16, so an argument that changes
    from step to step (a block table's width, a split count) compiles a new variant the first time each
    class turns up (about half a second on an H200, inside a measured step). Given to Triton as indices:
    older releases take no names.
    """
    def wrap(fn):
        params = list(inspect.signature(fn).parameters)
        return triton.jit(fn, do_not_specialize=[params.index(n) for n in names])
    return wrap


@triton.jit
def tanh(x):
    """tanh from exp2 of a non-positive argument: no overflow, and the interpreter runs it too."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|); 2 log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def attend_tile(
    n0, end,  # tile start; exclusive end of the visible keys
    q, m_i, l_i, acc,  # q [M, D_PAD]; online-softmax state [M], [M], [M, D_PAD] fp32
    q_pos,  # [M] absolute query positions (CAUSAL only)
    q_lo,  # [M] first position each row may see (SLIDING only: q_pos - window + 1)
    k_cache_ptr, v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    bt_row, region_start, kvh, stride_cb, stride_cs, stride_ch, scale_log2,
    softcap_log2,  # SOFTCAP: the logit cap times log2(e)
    offs_n, offs_d, d_mask,  # [BLOCK_N], [D_PAD], [D_PAD]
    BLOCK_SIZE: tl.constexpr, CONTIGUOUS: tl.constexpr, CAUSAL: tl.constexpr, SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Online-softmax update of (m_i, l_i, acc) with keys/values at positions [n0, n0 + BLOCK_N) < end.

    SLIDING masks the positions of this tile before a row's window (the callers start their loops at
    the first block that holds a visible position, so only that block's head is masked); SOFTCAP maps
    each logit s to cap * tanh(s / cap) before the mask, as Gemma 2 does.
    """
    pos = n0 + offs_n  # [BLOCK_N]
    n_mask = pos < end
    if CONTIGUOUS:  # a region: slot = start + pos
        slot = region_start + pos.to(tl.int64)
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
    else:
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = (pos % BLOCK_SIZE).to(tl.int64)
    kv_off = blk * stride_cb + off * stride_cs + kvh * stride_ch  # [BLOCK_N] int64
    kv_mask = n_mask[:, None] & d_mask[None, :]
    # K tile [BLOCK_N, D_PAD]; masked lanes (past the context, padded dims) read as 0.
    k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # [M, BLOCK_N]
    if SOFTCAP:  # (cap log2e) tanh(s / (cap log2e)) is cap tanh(logit / cap) in the log2 domain
        s = softcap_log2 * tanh(s / softcap_log2)
    if CAUSAL:
        allowed = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
    else:
        allowed = n_mask[None, :] & (q_pos[:, None] >= 0)
    if SLIDING:
        allowed = allowed & (pos[None, :] >= q_lo[:, None])
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])  # [M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    # V tile [BLOCK_N, D_PAD], same addresses as K.
    v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)  # [M, D_PAD]
    return m_new, l_i, acc


def interpreting() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(attend_tile).__name__ == "InterpretedFunction"

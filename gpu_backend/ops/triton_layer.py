"""Triton kernels for a decoder layer's per-token ops beside attention: RMSNorm (with the residual add
before it), the rotary embedding of q and k, and SiLU-and-multiply.

In a CUDA graph each launch costs the GPU microseconds whatever its size, and torch's code for these ops
(TorchLayerOps in layer_ops.py, the reference) launches about 25 kernels per layer: a norm is seven
(cast, square, mean, add, rsqrt, multiply, cast) before the weight. These are one each. They round where
torch rounds (to the activations' dtype after each op torch runs in that dtype), so the residual add and
the rotation give torch's values; a norm reduces its sum of squares in another order (last-bit fp32
differences).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,  # x, residual, out, sum: [T, N] (row strides below); w [N]
    n_cols, eps, stride_x, stride_res, stride_out, stride_sum,
    BLOCK: tl.constexpr, HAS_RES: tl.constexpr, GEMMA: tl.constexpr,
):
    """One row: (x + residual, stored to sum, when HAS_RES), then its RMS norm times the weight."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:  # torch adds in the activations' dtype: round the fp32 sum once
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    y = x32 * tl.rsqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:  # noqa: SIM108 - (1 + w) in fp32, then one cast
        out = y * (1.0 + w)
    else:  # cast, then the weight in the activations' dtype
        out = w * y.to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(dt), mask=mask)


@triton.jit
def _rotate(x_ptr, out_ptr, c1, c2, s1, s2, t, num_heads, stride_xt, stride_xh, stride_ot, stride_oh,
            HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate one token's heads: [x1, x2] -> [x1 c1 - x2 s1, x2 c2 + x1 s2], rounding each product and
    the sum to the output dtype as torch's x * cos + rotate_half(x) * sin does."""
    dt = out_ptr.dtype.element_ty
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_heads) & (d < HALF)
    src = x_ptr + t * stride_xt + h * stride_xh + d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    dst = out_ptr + t * stride_ot + h * stride_oh + d
    tl.store(dst, o1.to(dt), mask=mask)
    tl.store(dst + HALF, o2.to(dt), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,  # q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D]
    num_q_heads, num_k_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (t, 0) rotates token t's query heads, (t, 1) its key heads."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    dmask = d < HALF
    row_c, row_s = cos_ptr + t * stride_ct + d, sin_ptr + t * stride_ct + d
    c1 = tl.load(row_c, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(row_c + HALF, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(row_s, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(row_s + HALF, mask=dmask, other=0.0).to(tl.float32)
    if tl.program_id(1) == 0:
        _rotate(q_ptr, q_out_ptr, c1, c2, s1, s2, t, num_q_heads, stride_qt, stride_qh, stride_qot,
                stride_qoh, HALF, BLOCK_H, BLOCK_D)
    else:
        _rotate(k_ptr, k_out_ptr, c1, c2, s1, s2, t, num_k_heads, stride_kt, stride_kh, stride_kot,
                stride_koh, HALF, BLOCK_H, BLOCK_D)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    """out = silu(gate) * up for x = [gate | up] [T, 2N], rounding silu's output first as torch does."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(dt), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x [T, N] (of x + residual when given); returns (normed, x + residual or None)."""
    num_rows, n = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else None
    res = residual if residual is not None else x
    summed = total if total is not None else out
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            x, res, weight, out, summed, n, eps, x.stride(0), res.stride(0), out.stride(0), summed.stride(0),
            BLOCK=triton.next_power_of_2(n), HAS_RES=residual is not None, GEMMA=gemma,
            num_warps=8 if n >= 4096 else 4)
    return out, total


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hkv, D] (any strides but the last) rotated by cos/sin [T, D]; new tensors."""
    num_tokens, num_q, head_dim = q.shape
    num_k = k.shape[1]
    q_out = torch.empty((num_tokens, num_q, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_k, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens:
        half = head_dim // 2
        _rope_kernel[(num_tokens, 2)](
            q, k, cos, sin, q_out, k_out, num_q, num_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos.stride(0), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            HALF=half, BLOCK_H=triton.next_power_of_2(max(num_q, num_k)),
            BLOCK_D=triton.next_power_of_2(half))
    return q_out, k_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up = [gate | up] [T, 2N] -> [T, N]."""
    num_rows, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty((num_rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows:
        block = 1024
        _silu_mul_kernel[(num_rows, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0),
                                                            BLOCK=block)
    return out

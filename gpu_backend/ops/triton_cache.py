"""Triton store_kv: scatter the K/V of new tokens into their pool slots (slot -1 = skip)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr,  # [T, Hkv, D], any token/head strides, contiguous D
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hkv, D], contiguous
    slot_mapping_ptr,  # [T] int32/int64
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    HKV: tl.constexpr, HKV_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program per token: copies its [Hkv, D] key and value rows to slot_mapping[t]."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    offs_h = tl.arange(0, HKV_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < D)  # [HKV_PAD, D_PAD]
    key = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    value = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    # int64 slot: block * stride_cb exceeds 2^31 elements in large pools.
    base = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    dst = base + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Launch _store_kv_kernel over T tokens (inputs already validated by the backend)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HKV=num_kv_heads, HKV_PAD=triton.next_power_of_2(num_kv_heads),
        D=head_dim, D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )

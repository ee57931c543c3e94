"""Random paged-attention inputs for tests and benchmarks.

Block tables are shuffled (non-contiguous) and, when `share_blocks`, full blocks are drawn with
replacement so physical blocks repeat within and across sequences (prefix sharing). With `nan_fill`
every slot no sequence may read — the tail of each last block, unreferenced blocks and the table
padding, which points at an all-NaN block — holds NaN, so reading past a context length shows up.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PagedCase:
    """Inputs of one paged attention call (decode when every q_len is 1)."""

    q: torch.Tensor  # [T, Hq, D], sequences packed
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32, including the new tokens
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    scale: float


def make_paged_case(rng: np.random.Generator, context_lens: list[int], num_heads: int, num_kv_heads: int,
                    head_dim: int, block_size: int, dtype=torch.float32, device="cpu",
                    q_lens: list[int] | None = None, share_blocks: bool = True, nan_fill: bool = True,
                    extra_blocks: int = 2) -> PagedCase:
    """Build a random paged case; q_lens defaults to 1 query per sequence (decode)."""
    q_lens = [1] * len(context_lens) if q_lens is None else list(q_lens)
    full = [c // block_size for c in context_lens]
    partial = [int(c % block_size != 0) for c in context_lens]
    num_shared = max(1, sum(full) // 2) if share_blocks else sum(full)
    # Physical ids: shared full blocks, one private block per partial tail, spare blocks, one poison block.
    num_blocks = num_shared + sum(partial) + extra_blocks + 1
    ids = rng.permutation(num_blocks)
    full_ids, tail_ids = ids[:num_shared], ids[num_shared:num_shared + sum(partial)]
    poison = int(ids[-1])
    max_blocks = max([f + p for f, p in zip(full, partial, strict=False)] + [1]) + 1  # +1: padding column
    tables = np.full((len(context_lens), max_blocks), poison, dtype=np.int32)
    next_full, next_tail = 0, 0
    for i, (f, p) in enumerate(zip(full, partial, strict=False)):
        if share_blocks:
            tables[i, :f] = rng.choice(full_ids, size=f, replace=True)
        else:
            tables[i, :f] = full_ids[next_full:next_full + f]
            next_full += f
        if p:
            tables[i, f] = tail_ids[next_tail]
            next_tail += 1

    gen = torch.Generator(device=device).manual_seed(int(rng.integers(2**62)))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    if nan_fill:
        _poison_unused(k_cache, v_cache, tables, context_lens, block_size)
    q = torch.randn((sum(q_lens), num_heads, head_dim), generator=gen, device=device,
                    dtype=torch.float32).to(dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return PagedCase(
        q=q, k_cache=k_cache, v_cache=v_cache,
        block_tables=torch.from_numpy(tables).to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.from_numpy(cu).to(device),
        scale=head_dim ** -0.5,
    )


def _poison_unused(k_cache, v_cache, tables: np.ndarray, context_lens: list[int], block_size: int) -> None:
    """Set every slot that no sequence reads to NaN."""
    readable = np.zeros(k_cache.shape[0] * block_size, dtype=bool)
    for i, ctx in enumerate(context_lens):
        pos = np.arange(ctx)
        readable[tables[i, pos // block_size].astype(np.int64) * block_size + pos % block_size] = True
    unused = torch.from_numpy(np.flatnonzero(~readable)).to(k_cache.device)
    for cache in (k_cache, v_cache):
        cache.view(-1, *cache.shape[2:]).index_fill_(0, unused, float("nan"))


def make_region_case(rng: np.random.Generator, context_lens: list[int], num_heads: int, num_kv_heads: int,
                     head_dim: int, dtype=torch.float32, device="cpu", q_lens: list[int] | None = None,
                     block_size: int = 1) -> tuple[PagedCase, torch.Tensor]:
    """A contiguous-allocator case: each sequence owns a region [start, start + reserved) of a linear pool.

    Regions are reserved larger than their contexts and separated by gaps; every slot no context covers
    is NaN. Returns (case with block_tables [B, 1] region starts, per-position block tables of the same
    case for the reference). `block_size` > 1 views the slot space as blocks to exercise the general
    slot -> (block, offset) path (the engine's contiguous pool uses 1).
    """
    q_lens = [1] * len(context_lens) if q_lens is None else list(q_lens)
    starts, cursor = [], int(rng.integers(0, 5))
    for ctx in context_lens:
        starts.append(cursor)
        cursor += ctx + int(rng.integers(0, 9))  # reserved beyond the context, then a gap
    num_slots = -(-(cursor + 1) // block_size) * block_size
    gen = torch.Generator(device=device).manual_seed(int(rng.integers(2**62)))
    shape = (num_slots // block_size, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    readable = np.zeros(num_slots, dtype=bool)
    for start, ctx in zip(starts, context_lens, strict=True):
        readable[start:start + ctx] = True
    unused = torch.from_numpy(np.flatnonzero(~readable)).to(device)
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim).index_fill_(0, unused, float("nan"))
    q = torch.randn((sum(q_lens), num_heads, head_dim), generator=gen, device=device,
                    dtype=torch.float32).to(dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    case = PagedCase(q=q, k_cache=k_cache, v_cache=v_cache,
                     block_tables=torch.tensor(starts, dtype=torch.int64, device=device)[:, None],
                     context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
                     cu_seqlens_q=torch.from_numpy(cu).to(device), scale=head_dim ** -0.5)
    # The reference reads the same slots through one-slot blocks of the [num_slots, 1, Hkv, D] view.
    width = max(context_lens + [1])
    per_slot = np.full((len(starts), width), int(np.flatnonzero(~readable)[0]), dtype=np.int64)
    for i, (start, ctx) in enumerate(zip(starts, context_lens, strict=True)):
        per_slot[i, :ctx] = np.arange(start, start + ctx)
    return case, torch.from_numpy(per_slot).to(device)


def hide_out_of_window(case: PagedCase, window: int, q_lens: list[int] | None = None) -> torch.Tensor:
    """The case's block tables with every block wholly before each sequence's first window pointed at an
    all-NaN block: a kernel that reads (rather than skips) such a block returns NaN."""
    tables = case.block_tables.clone()
    lens = case.context_lens.tolist()
    q_lens = [1] * len(lens) if q_lens is None else q_lens
    block_size = case.k_cache.shape[1]
    poison = int(tables[0, -1])  # the padding column points at the poison block
    for i, (ctx, n) in enumerate(zip(lens, q_lens, strict=True)):
        hidden = max(0, ctx - n - window + 1) // block_size
        tables[i, :hidden] = poison
    return tables

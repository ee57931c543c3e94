"""Gathering paged K/V into small dense tiles for the torch backend.

Rows of the pool are addressed per (slot, kv head): the pool viewed as [num_slots * Hkv, D] and the
row of (slot, h) is slot * Hkv + h (int64, so pools past 2^31 elements work). Choosing rows in
(sequence, head, position) order makes one `index_select` produce K/V directly in the contiguous
[n, Hkv, L, D] layout that batched matmul and SDPA read fastest. Positions past a sequence's context
point at row 0 and are zeroed after the copy, so garbage (or NaN) in unused slots never reaches the math.
"""
from __future__ import annotations

import torch

# Padding between slot rows of a one-sequence tile (see Gatherer.gather_slots).
ROW_PAD_BYTES = 64


def tiles_by_bytes(ctx_list: list[int], q_lens: list[int], token_bytes: int, tile_bytes: int,
                   solo_bytes: int | None = None, max_pad: float | None = None):
    """Sort sequences by (context, q_len) and cut them into tiles (rows, max_ctx, max_q) of <= tile_bytes.

    A tile's gathered K+V (n x max_ctx x token_bytes) and its [n, Q, L] mask both count against the
    budget; a sequence larger than the budget, or with at least `solo_bytes` of K+V, gets a tile of
    its own (solo tiles come last, longest last). With `max_pad`, a tile is also cut before a sequence
    that would pad it to more than (1 + max_pad) x the query x context area its rows really hold (for
    decode rows, q = 1: their context tokens).
    """
    order = sorted(range(len(ctx_list)), key=lambda i: (ctx_list[i], q_lens[i]))
    solo = [] if solo_bytes is None else [i for i in order if ctx_list[i] * token_bytes >= solo_bytes]
    order = [i for i in order if i not in set(solo)]
    tiles, rows, max_ctx, max_q, real = [], [], 0, 0, 0
    for i in order:
        new_ctx, new_q = max(max_ctx, ctx_list[i], 1), max(max_q, q_lens[i])
        n = len(rows) + 1
        # A padded (query, position) pair is copied, zeroed, multiplied and masked like a real one: past
        # max_pad the tile costs more than its rows' areas (what a paged kernel, and the latency model,
        # charge).
        area = max(q_lens[i], 1) * max(ctx_list[i], 1)
        padded = max_pad is not None and n * max(new_q, 1) * new_ctx > (1 + max_pad) * (real + area)
        if rows and (n * new_ctx * token_bytes > tile_bytes or n * new_q * new_ctx > tile_bytes or padded):
            tiles.append((rows, max_ctx, max_q))
            rows, new_ctx, new_q, real = [], max(ctx_list[i], 1), q_lens[i], 0
        rows.append(i)
        max_ctx, max_q, real = new_ctx, new_q, real + area
    if rows:
        tiles.append((rows, max_ctx, max_q))
    return tiles + [([i], max(ctx_list[i], 1), q_lens[i]) for i in solo]


class Gatherer:
    """Copies the K/V rows of a tile into caller-provided buffers (reused across tiles and calls)."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k_buf: torch.Tensor,
                 v_buf: torch.Tensor):
        _, self.block_size, self.num_kv_heads, self.head_dim = k_cache.shape
        # 2-D views: index_select copies whole rows with memcpy (10-50x faster on CPU than on 3-D views).
        self.k_rows = k_cache.view(-1, self.head_dim)  # [num_slots * Hkv, D]
        self.v_rows = v_cache.view(-1, self.head_dim)
        self.k_slots = k_cache.view(-1, self.num_kv_heads * self.head_dim)  # [num_slots, Hkv * D]
        self.v_slots = v_cache.view(-1, self.num_kv_heads * self.head_dim)
        self.k_buf, self.v_buf = k_buf.view(-1), v_buf.view(-1)

    def rows(self, block_tables: torch.Tensor, ctx: torch.Tensor, max_ctx: int):
        """Pool row of every (sequence, kv head, position): ([n, Hkv, L] int64, valid [n, L] bool)."""
        pos = torch.arange(max_ctx, device=ctx.device)
        blocks = block_tables[:, pos // self.block_size].to(torch.int64)  # [n, L]
        slots = blocks * self.block_size + pos % self.block_size
        valid = pos[None, :] < ctx[:, None]
        slots = torch.where(valid, slots, 0)
        heads = torch.arange(self.num_kv_heads, device=ctx.device)
        return slots[:, None, :] * self.num_kv_heads + heads[None, :, None], valid

    def gather(self, rows: torch.Tensor, valid: torch.Tensor | None):
        """K, V [n, Hkv, L, D] for rows [n, Hkv, L]; rows where valid [n, L] is False are zeroed."""
        n, heads, length = rows.shape
        size = n * heads * length
        keys = self.k_buf[: size * self.head_dim].view(size, self.head_dim)
        values = self.v_buf[: size * self.head_dim].view(size, self.head_dim)
        flat = rows.reshape(-1)
        torch.index_select(self.k_rows, 0, flat, out=keys)
        torch.index_select(self.v_rows, 0, flat, out=values)
        if valid is not None:
            invalid = torch.nonzero(~valid[:, None, :].expand(n, heads, length).reshape(-1)).squeeze(1)
            keys.index_fill_(0, invalid, 0)
            values.index_fill_(0, invalid, 0)
        shape = (n, heads, length, self.head_dim)
        return keys.view(shape), values.view(shape)

    def gather_slots(self, slots: torch.Tensor, which: str, into: str | None = None) -> torch.Tensor:
        """K or V ("k" / "v") of one sequence's slots [L] as a slot-major [L, Hkv, D] view.

        Rows land `ROW_PAD_BYTES` apart beyond Hkv*D elements: with Hkv*D*elem a multiple of 4 KiB (8 x
        128 fp32), unpadded per-head rows all map to the same cache sets and the strided matmuls that
        read them run ~1.6x slower (4K aliasing). `into` picks the buffer (default: same as `which`).
        """
        source = self.k_slots if which == "k" else self.v_slots
        buf = self.k_buf if (into or which) == "k" else self.v_buf
        width = source.shape[1]
        stride = width + ROW_PAD_BYTES // source.element_size()
        out = buf[: slots.shape[0] * stride].view(-1, stride)[:, :width]
        torch.index_select(source, 0, slots, out=out)
        return out.unflatten(1, (self.num_kv_heads, self.head_dim))

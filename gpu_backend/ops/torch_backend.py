"""Pure-torch paged attention: gather the referenced slots into a dense tile, then batched math.

This backend runs everywhere (CPU engine, reference for the Triton kernels). K/V are gathered from the
pool through the block table with one vectorized `index_select` per tile (torch_gather.py); positions
past a sequence's context are zeroed and masked, so garbage (or NaN) in unused slots never matters.

Sequences are sorted by context length and processed in tiles whose gathered K+V stays within
`tile_bytes`: on a CPU this keeps the gathered copy in the last-level cache, so the paged path reads
the pool from memory once, like attention over a dense cache. The number of tiles grows with bytes,
not with tokens or blocks; everything inside a tile is vectorized.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_backend.ops.checks import (
    KernelInputError,
    check_cache_pair,
    check_query,
    check_store,
    check_tables,
    check_window,
)
from gpu_backend.ops.torch_gather import ROW_PAD_BYTES, Gatherer, tiles_by_bytes
from gpu_backend.ops.torch_window import capped_attention, shift_to_window


@dataclass(frozen=True)
class TorchBackendConfig:
    """Tuning of the torch backend."""

    # Bytes of gathered K+V per tile: small enough to stay in the last-level cache between the copy
    # and the math (8 MiB measured well on a 2-core EPYC with 32 MiB L3, docs/kernels.md). On CUDA
    # tiling buys nothing, so get_backend() raises it there.
    tile_bytes: int = 8 << 20
    # Decode: a sequence with at least this many K+V bytes gets a tile of its own, copied as whole
    # blocks and read in place by BLAS (no padding, no mask); below it, batching saves per-op overhead.
    solo_bytes: int = 1 << 20
    # Decode: a tile is cut where padding its sequences to the longest would exceed this fraction of
    # their context tokens (None: no limit). See tiles_by_bytes and docs/calibration.md.
    decode_max_pad: float | None = 0.25
    # Prefill: the same bound on each tile's padded query x context area (the mask covers the whole
    # rectangle, so a short prompt tiled with a long one pays for the long one's area).
    prefill_max_pad: float | None = 0.25
    # Keep the gather buffers between calls: fresh multi-MiB CPU allocations come back from the OS as
    # new pages, and faulting them in costs as much as the gather itself. Off on CUDA (its caching
    # allocator already reuses memory, and a kept buffer would sit on KV-cache memory).
    reuse_workspace: bool = True


class TorchBackend:
    """Gather-based paged attention in plain torch (CPU and reference backend); one per thread."""

    name = "torch"

    def __init__(self, config: TorchBackendConfig | None = None):
        self.config = config or TorchBackendConfig()
        self._workspace: dict[tuple, torch.Tensor] = {}  # (device, dtype) -> flat buffer, see config

    def _buffers(self, k_cache: torch.Tensor, tiles) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat gather buffers large enough for the biggest tile of this call."""
        row = k_cache.shape[2] * k_cache.shape[3] + ROW_PAD_BYTES // k_cache.element_size()
        need = max(len(r) * c for r, c, _ in tiles) * row
        key = (k_cache.device, k_cache.dtype)
        flat = self._workspace.get(key)
        if flat is None or flat.numel() < 2 * need:
            flat = torch.empty(2 * need, dtype=k_cache.dtype, device=k_cache.device)
            if self.config.reuse_workspace:
                self._workspace[key] = flat
        return flat[:need].view(-1, row), flat[need: 2 * need].view(-1, row)

    # -- KV store -------------------------------------------------------------------------------
    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        """Write key/value [T, Hkv, D] into the pool at slot_mapping [T]; slot -1 is skipped."""
        _, _, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
        check_store(key, value, k_cache, slot_mapping)
        slots = slot_mapping.to(device=k_cache.device, dtype=torch.int64)
        keep = torch.nonzero(slots >= 0).squeeze(1)
        slots = slots.index_select(0, keep)
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, slots, key.index_select(0, keep).to(k_cache.dtype))
        v_flat.index_copy_(0, slots, value.index_select(0, keep).to(v_cache.dtype))

    # -- decode ---------------------------------------------------------------------------------
    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale: float, *,
               max_context_len: int | None = None, contiguous: bool = False, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """One query per sequence: q [B, Hq, D] over its whole paged context -> out [B, Hq, D].

        contiguous: block_tables [B, 1] holds region starts (see `region_tables`). window: sliding window
        in tokens (None/0: full attention; whole blocks before it are never gathered); softcap: logit
        soft-cap (None/0: none).
        """
        window, softcap = check_window(window, softcap)
        if contiguous:
            k_cache, v_cache, block_tables = region_tables(k_cache, v_cache, block_tables, context_lens,
                                                           max_context_len)
        _, block_size, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
        group = check_query(q, num_kv_heads, head_dim, "decode")
        num_seqs, num_heads, _ = q.shape
        check_tables(block_tables, context_lens, num_seqs, "decode")
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if num_seqs == 0:
            return out
        ctx_list = [int(c) for c in context_lens.tolist()]
        _check_fits(ctx_list, block_tables, block_size, "decode")
        if window:
            block_tables, ctx_list = shift_to_window(block_tables, ctx_list, [1] * num_seqs, block_size,
                                                     window)
            context_lens = torch.tensor(ctx_list, dtype=torch.int64, device=context_lens.device)
        token_bytes = 2 * num_kv_heads * head_dim * k_cache.element_size()
        tiles = tiles_by_bytes(ctx_list, [1] * num_seqs, token_bytes, self.config.tile_bytes,
                               self.config.solo_bytes, self.config.decode_max_pad)
        order = [i for rows, _, _ in tiles for i in rows]  # sequences sorted by context length
        in_order = order == list(range(num_seqs))
        order_t = torch.tensor(order, dtype=torch.int64, device=q.device)
        pick = (lambda t: t) if in_order else (lambda t: t.index_select(0, order_t))
        # GQA packed by folding the group into the query axis: [B, Hkv, G, D] against [n, Hkv, L, D].
        q_sorted = pick(q).reshape(num_seqs, num_kv_heads, group, head_dim)
        ctx_sorted = pick(context_lens).to(torch.int64)
        tables_sorted = pick(block_tables).to(torch.int64)
        gather = Gatherer(k_cache, v_cache, *self._buffers(k_cache, tiles))
        out_sorted = torch.empty_like(q_sorted)
        start = 0
        for tile_rows, max_ctx, _ in tiles:
            end = start + len(tile_rows)
            if end - start == 1:  # one long sequence fills the tile: exact slots, strided BLAS
                ctx = ctx_list[tile_rows[0]]
                pos = torch.arange(max(0, ctx - window) if window else 0, ctx, device=q.device)
                slots = tables_sorted[start, pos // block_size] * block_size + pos % block_size
                _single_decode(q_sorted[start], gather, slots, scale, out=out_sorted[start], softcap=softcap)
                start = end
                continue
            rows, valid = gather.rows(tables_sorted[start:end], ctx_sorted[start:end], max_ctx)
            # Rows are sorted by context, so the first one is the shortest: ragged iff it is < max_ctx.
            ragged = ctx_list[tile_rows[0]] < max_ctx
            keys, values = gather.gather(rows, valid if ragged else None)  # [n, Hkv, L, D]
            # Empty contexts keep position 0 (zeroed K/V) so their softmax stays finite: output 0.
            mask = (valid | (torch.arange(max_ctx, device=q.device) == 0)) if ragged else None
            if window and max(ctx_list[i] for i in tile_rows) > window:  # else no position is outside
                # Relative positions (shift_to_window): the window is [ctx - window, ctx).
                pos = torch.arange(max_ctx, device=q.device)
                in_window = pos[None, :] >= ctx_sorted[start:end, None] - window
                mask = in_window if mask is None else mask & in_window
            out_sorted[start:end] = _decode_attention(q_sorted[start:end], keys, values, mask, scale, softcap)
            start = end
        out_sorted = out_sorted.view(num_seqs, num_heads, head_dim)
        if in_order:
            return out_sorted
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return out.index_copy_(0, order_t, out_sorted)

    # -- prefill --------------------------------------------------------------------------------
    def prefill(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale: float,
                max_query_len: int | None = None, *, contiguous: bool = False, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """Packed queries q [T, Hq, D]: each sequence's last q_len positions attend causally -> [T, Hq, D].

        window and softcap as in `decode`.
        """
        window, softcap = check_window(window, softcap)
        if contiguous:
            k_cache, v_cache, block_tables = region_tables(k_cache, v_cache, block_tables, context_lens)
        _, block_size, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
        group = check_query(q, num_kv_heads, head_dim, "prefill")
        num_tokens, num_heads, _ = q.shape
        num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else -1
        check_tables(block_tables, context_lens, num_seqs, "prefill")
        cu = [int(c) for c in cu_seqlens_q.tolist()]
        if len(cu) != num_seqs + 1 or cu[0] != 0 or cu[-1] != num_tokens:
            raise KernelInputError(
                f"prefill cu_seqlens_q must be [0, ..., {num_tokens}] with {num_seqs + 1} entries, got {cu}")
        q_lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=False)]
        ctx_list = [int(c) for c in context_lens.tolist()]
        bad = [i for i, (n, c) in enumerate(zip(q_lens, ctx_list, strict=False)) if n < 0 or n > c]
        if bad:
            raise KernelInputError(f"prefill sequence {bad[0]}: query length {q_lens[bad[0]]} is negative or "
                                   f"exceeds its context length {ctx_list[bad[0]]}")
        _check_fits(ctx_list, block_tables, block_size, "prefill")
        full_tables, full_lens = block_tables, context_lens  # the decode rows shift their own tables
        if window:
            block_tables, ctx_list = shift_to_window(block_tables, ctx_list, q_lens, block_size, window)
            context_lens = torch.tensor(ctx_list, dtype=torch.int64, device=context_lens.device)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        seqs = list(range(num_seqs))
        decoding = [i for i in seqs if q_lens[i] == 1]
        if decoding and len(decoding) < num_seqs:
            # A decode row tiled with a prefill is padded to the prefill's query length (a mixed step tiled
            # so costs 3-5x the sum of its parts on the CPU, docs/calibration.md): decode rows take the
            # decode path.
            rows_t = torch.tensor(decoding, dtype=torch.int64, device=q.device)
            tok_t = torch.tensor([cu[i] for i in decoding], dtype=torch.int64, device=q.device)
            out.index_copy_(0, tok_t, self.decode(q.index_select(0, tok_t), k_cache, v_cache,
                                                  full_tables.index_select(0, rows_t),
                                                  full_lens.index_select(0, rows_t), scale,
                                                  window=window, softcap=softcap))
            seqs = [i for i in seqs if q_lens[i] != 1]
        token_bytes = 2 * num_kv_heads * head_dim * k_cache.element_size()
        tiles = [([seqs[r] for r in rows], max_ctx, max_q) for rows, max_ctx, max_q in
                 tiles_by_bytes([ctx_list[i] for i in seqs], [q_lens[i] for i in seqs], token_bytes,
                                self.config.tile_bytes, max_pad=self.config.prefill_max_pad) if max_q > 0]
        if not tiles:
            return out
        gather = Gatherer(k_cache, v_cache, *self._buffers(k_cache, tiles))
        q_ext = torch.cat([q, q.new_zeros(1, num_heads, head_dim)])  # row T: padding for short sequences
        cu_t = cu_seqlens_q.to(device=q.device, dtype=torch.int64)
        for rows, max_ctx, max_q in tiles:
            idx = torch.tensor(rows, dtype=torch.int64, device=q.device)
            ctx = context_lens.index_select(0, idx).to(torch.int64)
            start = cu_t.index_select(0, idx)
            q_len = cu_t.index_select(0, idx + 1) - start
            j = torch.arange(max_q, device=q.device)
            real = j[None, :] < q_len[:, None]  # [n, Qmax]
            q_idx = torch.where(real, start[:, None] + j[None, :], num_tokens)
            q_pos = ctx[:, None] - q_len[:, None] + j[None, :]  # absolute position of each query
            if window:  # padding rows copy the last real one, so none is wholly outside its window
                last = (q_len - 1).clamp(min=0)
                q_pos = ctx[:, None] - q_len[:, None] + torch.minimum(j[None, :], last[:, None])
            rows, valid = gather.rows(block_tables.index_select(0, idx), ctx, max_ctx)
            keys, values = gather.gather(rows, valid)  # [n, Hkv, L, D]
            pos = torch.arange(max_ctx, device=q.device)
            # Causal over cached + new positions; every row keeps position 0 so no row is fully masked.
            mask = (pos[None, None, :] <= q_pos.clamp(min=0)[:, :, None])[:, None]  # [n, 1, Qmax, L]
            if window:
                mask = mask & (pos[None, None, :] > q_pos[:, :, None] - window)[:, None]
            q_tile = q_ext[q_idx].transpose(1, 2)  # [n, Hq, Qmax, D]
            if softcap:
                o = capped_attention(q_tile, keys, values, mask, scale, softcap)
            else:
                kwargs = {"enable_gqa": True} if group > 1 else {}
                o = F.scaled_dot_product_attention(q_tile, keys, values, attn_mask=mask, scale=scale,
                                                   **kwargs)
            o = o.transpose(1, 2)  # [n, Qmax, Hq, D]
            out.index_copy_(0, q_idx[real], o[real].to(q.dtype))
        return out


def region_tables(k_cache, v_cache, starts, context_lens, max_context_len: int | None = None):
    """Regions (start [B, 1], length) as one-slot blocks: k, v as [num_slots, 1, Hkv, D], [B, L] slots.

    The gather backend reads through per-position tables anyway; the Triton kernels read regions
    directly. Positions past a context point at slot start + p and are masked like any padding.
    """
    if starts.dim() != 2 or starts.shape[1] != 1:
        raise KernelInputError(
            f"contiguous block_tables must be [B, 1] region starts, got {tuple(starts.shape)}")
    _, _, num_kv_heads, head_dim = k_cache.shape
    k_slots = k_cache.view(-1, 1, num_kv_heads, head_dim)
    v_slots = v_cache.view(-1, 1, num_kv_heads, head_dim)
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if context_lens.numel() else 0
    pos = torch.arange(max(max_context_len, 1), device=starts.device, dtype=torch.int64)
    tables = (starts.to(torch.int64) + pos[None, :]).clamp_(max=k_slots.shape[0] - 1)
    return k_slots, v_slots, tables


def _check_fits(ctx_list: list[int], block_tables: torch.Tensor, block_size: int, what: str) -> None:
    """Every context must be covered by the block table's columns."""
    capacity = block_tables.shape[1] * block_size
    over = [i for i, c in enumerate(ctx_list) if c > capacity or c < 0]
    if over:
        raise KernelInputError(f"{what} sequence {over[0]}: context length {ctx_list[over[0]]} is negative "
                               f"or exceeds block_tables capacity {capacity} tokens")


def _single_decode(q, gather: Gatherer, slots: torch.Tensor, scale: float, out: torch.Tensor,
                   softcap: float = 0.0) -> None:
    """One sequence: q [Hkv, G, D] over its context's slots [L] -> out [Hkv, G, D] (written in place).

    K/V are copied slot by slot into slot-major [L, Hkv, D] (exactly the context: no padding, no
    mask); the per-head matrices are strided views that BLAS reads in place. In fp32, V reuses K's
    buffer once the scores exist, so the tile stays small and hot in cache.
    """
    if slots.shape[0] == 0:
        out.zero_()
        return
    keys = gather.gather_slots(slots, "k")
    if softcap:
        values = gather.gather_slots(slots, "v")
        out.copy_(capped_attention(q[:, None], keys.transpose(0, 1)[:, None], values.transpose(0, 1)[:, None],
                                   None, scale, softcap)[:, 0])
        return
    if q.dtype == torch.float32:
        probs = torch.softmax(torch.bmm(q * scale, keys.permute(1, 2, 0)), dim=-1)  # [Hkv, G, L]
        values = gather.gather_slots(slots, "v", into="k")
        torch.bmm(probs, values.transpose(0, 1), out=out)
        return
    values = gather.gather_slots(slots, "v")
    out.copy_(F.scaled_dot_product_attention(q[None], keys.transpose(0, 1)[None],
                                             values.transpose(0, 1)[None], scale=scale)[0])


def _decode_attention(q, keys, values, mask, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """q [n, Hkv, G, D] (GQA group folded into the query axis) over K/V [n, Hkv, L, D] -> [n, Hkv, G, D].

    fp32 uses matmul-softmax-matmul, measured faster than CPU SDPA for these skinny (G-row) products;
    fp16/bf16 go through SDPA, which accumulates in fp32. mask [n, L] (True = attend) or None.
    """
    if softcap:
        return capped_attention(q, keys, values, None if mask is None else mask[:, None, None, :], scale,
                                softcap)
    if q.dtype == torch.float32:
        scores = torch.matmul(q * scale, keys.transpose(-1, -2))  # [n, Hkv, G, L]
        if mask is not None:
            scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), values)
    attn_mask = None if mask is None else mask[:, None, None, :]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, scale=scale)

"""Slow, obvious fp64 attention over a paged cache, written independently of both backends.

Each sequence's dense K/V is rebuilt by explicit indexing (block_tables[i][p // block_size], p % block_size)
and attention is plain softmax(q k^T * scale) v in float64. Only for tests and small checks.
A sliding window W lets the query at position p see [p - W + 1, p] (transformers' and vLLM's rule); a
soft-cap c replaces each logit s by c * tanh(s / c) before the mask (Gemma 2).
"""
from __future__ import annotations

import torch


def _dense_kv(k_cache, v_cache, table: list[int], lo: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K, V [ctx - lo, Hkv, D] in fp64 of positions [lo, ctx) of one sequence, slot by slot through
    its block table (slots before lo are never read)."""
    block_size = k_cache.shape[1]
    blocks = torch.tensor([table[p // block_size] for p in range(lo, ctx)], dtype=torch.int64)
    offsets = torch.tensor([p % block_size for p in range(lo, ctx)], dtype=torch.int64)
    blocks, offsets = blocks.to(k_cache.device), offsets.to(k_cache.device)
    return k_cache[blocks, offsets].double(), v_cache[blocks, offsets].double()


def reference_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale: float,
                      window: int | None = None, softcap: float | None = None):
    """fp64 [T, Hq, D]: sequence i's queries sit at its last q_len positions and attend causally
    (within the last `window` positions when window > 0)."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)  # fp64 on q's device
    cu = [int(c) for c in cu_seqlens_q.tolist()]
    tables = block_tables.tolist()
    for i, ctx in enumerate(int(c) for c in context_lens.tolist()):
        start, end = cu[i], cu[i + 1]
        if end == start or ctx == 0:
            continue
        # Positions before the first query's window are never visible, so never read.
        lo = max(0, ctx - (end - start) - window + 1) if window else 0
        keys, values = _dense_kv(k_cache, v_cache, tables[i], lo, ctx)
        keys = keys.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
        values = values.repeat_interleave(group, dim=1)
        qs = q[start:end].double()  # [n, Hq, D]
        q_pos = torch.arange(ctx - (end - start), ctx, device=q.device)
        scores = torch.einsum("nhd,phd->hnp", qs, keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        key_pos = torch.arange(lo, ctx, device=q.device)[None, :]
        allowed = key_pos <= q_pos[:, None]  # [n, ctx]
        if window:
            allowed &= key_pos > q_pos[:, None] - window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hnp,phd->nhd", probs, values)
    return out


def reference_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                     window: int | None = None, softcap: float | None = None):
    """fp64 [B, Hq, D]: one query per sequence at its last position (zeros for an empty context)."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return reference_prefill(q, k_cache, v_cache, block_tables, cu, context_lens, scale, window, softcap)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (NaN anywhere in out makes it NaN)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    return float(torch.linalg.vector_norm(out64 - ref64) / torch.linalg.vector_norm(ref64).clamp(min=1e-300))

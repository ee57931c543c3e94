"""Slow, obvious fp64 attention over a paged cache, written independently of both backends.

Each sequence's dense K/V is rebuilt by explicit indexing (block_tables[i][p // block_size], p % block_size)
and attention is plain softmax(q k^T * scale) v in float64. Only for tests and small checks.
"""
from __future__ import annotations

import torch


def _dense_kv(k_cache, v_cache, table: list[int], ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K, V [ctx, Hkv, D] in fp64 for one sequence, slot by slot through its block table."""
    block_size = k_cache.shape[1]
    blocks = torch.tensor([table[p // block_size] for p in range(ctx)], dtype=torch.int64)
    offsets = torch.tensor([p % block_size for p in range(ctx)], dtype=torch.int64)
    blocks, offsets = blocks.to(k_cache.device), offsets.to(k_cache.device)
    return k_cache[blocks, offsets].double(), v_cache[blocks, offsets].double()


def reference_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale: float):
    """fp64 [T, Hq, D]: sequence i's queries sit at its last q_len positions and attend causally."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)  # fp64 on q's device
    cu = [int(c) for c in cu_seqlens_q.tolist()]
    tables = block_tables.tolist()
    for i, ctx in enumerate(int(c) for c in context_lens.tolist()):
        start, end = cu[i], cu[i + 1]
        if end == start or ctx == 0:
            continue
        keys, values = _dense_kv(k_cache, v_cache, tables[i], ctx)
        keys = keys.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
        values = values.repeat_interleave(group, dim=1)
        qs = q[start:end].double()  # [n, Hq, D]
        q_pos = torch.arange(ctx - (end - start), ctx, device=q.device)
        scores = torch.einsum("nhd,phd->hnp", qs, keys) * scale
        allowed = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [n, ctx]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hnp,phd->nhd", probs, values)
    return out


def reference_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float):
    """fp64 [B, Hq, D]: one query per sequence at its last position (zeros for an empty context)."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return reference_prefill(q, k_cache, v_cache, block_tables, cu, context_lens, scale)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (NaN anywhere in out makes it NaN)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    return float(torch.linalg.vector_norm(out64 - ref64) / torch.linalg.vector_norm(ref64).clamp(min=1e-300))

"""Sliding windows and logit soft-capping for the torch backend.

A sliding-window layer's query at position p sees [p - window + 1, p]. Before gathering, each sequence's
block table is shifted left by the whole blocks that lie before its first query's window
(`shift_to_window`), so the gather never copies them and positions become relative to the first kept
block; the window mask is then applied in those relative positions (differences are unchanged). Soft-
capping (Gemma 2) maps every logit s to cap * tanh(s / cap) before the mask, which SDPA cannot do, so
capped layers take the explicit matmul-softmax-matmul path of `capped_attention`.
"""
from __future__ import annotations

import torch


def shift_to_window(block_tables: torch.Tensor, ctx_list: list[int], q_lens: list[int], block_size: int,
                    window: int) -> tuple[torch.Tensor, list[int]]:
    """Block tables [B, W] without each sequence's blocks wholly before its first query's window, and the
    context lengths counted from the first kept block."""
    shifts = [max(0, c - n - window + 1) // block_size for c, n in zip(ctx_list, q_lens, strict=True)]
    if not any(shifts):
        return block_tables, ctx_list
    width = block_tables.shape[1]
    shift_t = torch.tensor(shifts, dtype=torch.int64, device=block_tables.device)
    cols = (torch.arange(width, device=block_tables.device)[None, :] + shift_t[:, None]).clamp_(max=width - 1)
    tables = torch.gather(block_tables.to(torch.int64), 1, cols)
    return tables, [c - s * block_size for c, s in zip(ctx_list, shifts, strict=True)]


def capped_attention(q, keys, values, mask, scale: float, softcap: float) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scale / cap), masked) v in fp32 with GQA folded: q [n, Hq, Q, D] against
    K/V [n, Hkv, L, D], mask broadcastable to [n, Hq, Q, L] (True = attend) or None -> [n, Hq, Q, D]."""
    group = q.shape[1] // keys.shape[1]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float() * scale, keys.float().transpose(-1, -2))
    scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values.float()).to(q.dtype)

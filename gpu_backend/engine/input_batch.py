"""Packed forward inputs for a mixed batch of prefills and decodes (no padding between sequences).

The engine describes each scheduled sequence by the tokens it computes this step, the position of the
first of them, and its block table; this module turns that into the flat tensors the model and the
attention kernels read (the types of `gpu_backend.model_input`). Token-level arrays are built with numpy
so cost does not grow with Python loops over tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple

import numpy as np
import torch

from gpu_backend.model_input import AttentionMetadata, ModelInput

VIEW_ALIGN = 2  # int64 elements: every metadata view starts on a 16-byte boundary (see build_model_input)


class SequenceInput(NamedTuple):
    """One sequence's share of a step (a NamedTuple: the engine makes one per sequence per step).

    token_ids: the tokens computed this step (a whole prompt, a prompt chunk, or one decode token);
    start_pos: position of token_ids[0] (= tokens already in the KV cache for this sequence);
    block_table: physical block ids in logical order, covering at least start_pos + len(token_ids) tokens
    (contiguous: `(region_start,)`);
    num_logits: how many of its last tokens need logits (1 to sample, 0 for a non-final prefill chunk);
    seq_id: whose table it is (the engine's BlockTableStore keys rows by it; -1 when unused).
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    num_logits: int = 1
    seq_id: int = -1


def build_model_input(seqs: Sequence[SequenceInput], block_size: int,
                      device: torch.device | str = "cpu", *, contiguous: bool = False,
                      block_tables: np.ndarray | None = None,
                      table_lens: np.ndarray | None = None) -> ModelInput:
    """Pack `seqs` into flat input ids, positions and attention metadata on `device`.

    contiguous: each `block_table` is `(region_start,)`, a slot range [start, start + context) of a
    linear pool, and the kernels read it as (start, length) - no per-token table is built.
    block_tables / table_lens: the step's paged tables already laid out [B, max_blocks] with the
    number of valid columns per row (a `BlockTableStore` keeps them across steps); when given, the
    `block_table` fields of `seqs` are not read.
    """
    if not seqs:
        raise ValueError("build_model_input needs at least one sequence")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_seqs = len(seqs)
    q_lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=num_seqs)
    starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=num_seqs)
    num_logits = np.fromiter((s.num_logits for s in seqs), dtype=np.int64, count=num_seqs)
    if contiguous:
        tables = np.fromiter((s.block_table[0] for s in seqs), dtype=np.int64, count=num_seqs)[:, None]
        lens = None
    elif block_tables is not None:
        tables, lens = block_tables, table_lens
    else:
        tables, lens = _pack_tables([s.block_table for s in seqs])
    _check_shapes(q_lens, starts, num_logits, lens, block_size)

    num_tokens = int(q_lens.sum())
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    context_lens = starts + q_lens
    if num_tokens == num_seqs:  # decode-only: one token per sequence, no per-token expansion
        positions = starts
        logits_indices = np.flatnonzero(num_logits)
        if contiguous:
            slot_mapping = tables[:, 0] + positions
        else:
            slot_mapping = tables[np.arange(num_seqs), positions // block_size] * block_size + \
                positions % block_size
        token_ids = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64, count=num_seqs)
    else:
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
        positions = starts[seq_of_token] + (np.arange(num_tokens) - cu[:-1][seq_of_token])
        if contiguous:
            slot_mapping = tables[seq_of_token, 0] + positions
        else:
            slot_mapping = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        # The last num_logits tokens of each sequence, in sequence order.
        logits_seq = np.repeat(np.arange(num_seqs), num_logits)
        logits_cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_logits, out=logits_cu[1:])
        within = np.arange(int(num_logits.sum())) - logits_cu[:-1][logits_seq]
        rank_from_end = num_logits[logits_seq] - within
        logits_indices = cu[1:][logits_seq] - rank_from_end
        token_ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64, count=num_tokens)

    # One host->device copy per step: every integer array goes into one int64 staging buffer (pinned
    # on CUDA) and the metadata tensors are views of the copy. The kernels take int64 tables. Each view
    # starts 16-byte aligned: Triton specializes pointers on 16-byte alignment, and views at offsets
    # that change with the step's sizes would compile a new kernel variant for each new combination.
    parts = (token_ids, positions, slot_mapping, tables.reshape(-1), context_lens, cu, logits_indices)
    starts = np.concatenate(([0], np.cumsum([-(-p.size // VIEW_ALIGN) * VIEW_ALIGN for p in parts])))
    staging = np.zeros(int(starts[-1]), dtype=np.int64)
    for start, part in zip(starts, parts, strict=False):
        staging[start: start + part.size] = part
    flat = _to_device(staging, device)
    views = [flat[start: start + part.size] for start, part in zip(starts, parts, strict=False)]
    ids_t, pos_t, slots_t, tables_t, ctx_t, cu_t, logits_t = views
    metadata = AttentionMetadata(
        slot_mapping=slots_t,
        block_tables=tables_t.view(tables.shape),
        context_lens=ctx_t,
        cu_seqlens_q=cu_t,
        logits_indices=logits_t,
        max_q_len=int(q_lens.max()),
        max_context_len=int(context_lens.max()),
        contiguous=contiguous,
    )
    return ModelInput(ids_t, pos_t, metadata)


def _pack_tables(tables: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """[B, max_blocks] int64 (0-padded) and the number of blocks per row, with no per-row Python copy."""
    lens = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
    out = np.zeros((len(tables), max(int(lens.max()), 1)), dtype=np.int64)
    flat = np.fromiter(chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))
    out[np.arange(out.shape[1])[None, :] < lens[:, None]] = flat
    return out, lens


def _to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """The array as a tensor on `device`: through pinned memory and one non-blocking copy on CUDA."""
    host = torch.from_numpy(array)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def build_attn_metadata(seqs: Sequence[SequenceInput], block_size: int,
                        device: torch.device | str = "cpu", *, contiguous: bool = False) -> AttentionMetadata:
    """Only the attention metadata of `build_model_input`."""
    return build_model_input(seqs, block_size, device, contiguous=contiguous).attn_metadata


def _check_shapes(q_lens: np.ndarray, starts: np.ndarray, num_logits: np.ndarray,
                  table_lens: np.ndarray | None, block_size: int) -> None:
    """Reject descriptions the kernels would silently mis-handle (these are engine bugs, not user input)."""
    bad = np.flatnonzero(q_lens == 0)
    if bad.size:
        raise ValueError(f"sequence {bad[0]}: no tokens to compute")
    bad = np.flatnonzero(starts < 0)
    if bad.size:
        raise ValueError(f"sequence {bad[0]}: negative start_pos {starts[bad[0]]}")
    bad = np.flatnonzero((num_logits < 0) | (num_logits > q_lens))
    if bad.size:
        i = bad[0]
        raise ValueError(f"sequence {i}: num_logits {num_logits[i]} not in [0, {q_lens[i]}]")
    if table_lens is None:
        return
    needed = -(-(starts + q_lens) // block_size)
    bad = np.flatnonzero(table_lens < needed)
    if bad.size:
        i = bad[0]
        raise ValueError(f"sequence {i}: {starts[i] + q_lens[i]} tokens need {needed[i]} blocks of "
                         f"{block_size}, block table has {table_lens[i]}")

"""Packed forward inputs for a mixed batch of prefills and decodes (no padding between sequences).

The engine describes each scheduled sequence by the tokens it computes this step, the position of the
first of them, and its block table; this module turns that into the flat tensors the model and the
attention kernels read. Token-level arrays are built with numpy so cost does not grow with Python
loops over tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SequenceInput:
    """One sequence's share of a step.

    token_ids: the tokens computed this step (a whole prompt, a prompt chunk, or one decode token);
    start_pos: position of token_ids[0] (= tokens already in the KV cache for this sequence);
    block_table: physical block ids in logical order, covering at least start_pos + len(token_ids) tokens;
    num_logits: how many of its last tokens need logits (1 to sample, 0 for a non-final prefill chunk).
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    num_logits: int = 1


@dataclass(frozen=True)
class AttentionMetadata:
    """What the attention kernels need for one packed step (all tensors on the model's device)."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 past each sequence's blocks
    context_lens: torch.Tensor  # [B] int32: tokens of each sequence including this step's
    cu_seqlens_q: torch.Tensor  # [B+1] int32: offsets of each sequence's tokens in the packed batch
    logits_indices: torch.Tensor  # [L] int64: packed rows whose logits are returned, in sequence order
    max_q_len: int  # host-side copies so the model can pick a kernel without a device sync
    max_context_len: int

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch (B)."""
        return self.context_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        """Every sequence computes exactly one token, so the decode kernel applies."""
        return self.max_q_len == 1


@dataclass(frozen=True)
class ModelInput:
    """Everything one forward call takes besides the weights and the KV cache."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata


def build_model_input(seqs: Sequence[SequenceInput], block_size: int,
                      device: torch.device | str = "cpu") -> ModelInput:
    """Pack `seqs` into flat input ids, positions and attention metadata on `device`."""
    if not seqs:
        raise ValueError("build_model_input needs at least one sequence")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    q_lens = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
    starts = np.array([s.start_pos for s in seqs], dtype=np.int64)
    num_logits = np.array([s.num_logits for s in seqs], dtype=np.int64)
    _check_shapes(seqs, q_lens, starts, num_logits, block_size)

    num_seqs, num_tokens = len(seqs), int(q_lens.sum())
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
    positions = starts[seq_of_token] + (np.arange(num_tokens) - cu[:-1][seq_of_token])

    max_blocks = max(len(s.block_table) for s in seqs)
    block_tables = np.zeros((num_seqs, max(max_blocks, 1)), dtype=np.int64)
    for i, s in enumerate(seqs):
        block_tables[i, : len(s.block_table)] = s.block_table
    block_of_token = block_tables[seq_of_token, positions // block_size]
    slot_mapping = block_of_token * block_size + positions % block_size

    # The last num_logits tokens of each sequence, in sequence order.
    logits_seq = np.repeat(np.arange(num_seqs), num_logits)
    logits_cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(num_logits, out=logits_cu[1:])
    rank_from_end = num_logits[logits_seq] - (np.arange(int(num_logits.sum())) - logits_cu[:-1][logits_seq])
    logits_indices = cu[1:][logits_seq] - rank_from_end

    context_lens = starts + q_lens
    token_ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64, count=num_tokens)

    def put(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array).to(device=device, dtype=dtype)

    metadata = AttentionMetadata(
        slot_mapping=put(slot_mapping, torch.int64),
        block_tables=put(block_tables, torch.int32),
        context_lens=put(context_lens, torch.int32),
        cu_seqlens_q=put(cu, torch.int32),
        logits_indices=put(logits_indices, torch.int64),
        max_q_len=int(q_lens.max()),
        max_context_len=int(context_lens.max()),
    )
    return ModelInput(put(token_ids, torch.int64), put(positions, torch.int64), metadata)


def build_attn_metadata(seqs: Sequence[SequenceInput], block_size: int,
                        device: torch.device | str = "cpu") -> AttentionMetadata:
    """Only the attention metadata of `build_model_input`."""
    return build_model_input(seqs, block_size, device).attn_metadata


def _check_shapes(seqs: Sequence[SequenceInput], q_lens: np.ndarray, starts: np.ndarray,
                  num_logits: np.ndarray, block_size: int) -> None:
    """Reject descriptions the kernels would silently mis-handle (these are engine bugs, not user input)."""
    for i, s in enumerate(seqs):
        if q_lens[i] == 0:
            raise ValueError(f"sequence {i}: no tokens to compute")
        if starts[i] < 0:
            raise ValueError(f"sequence {i}: negative start_pos {starts[i]}")
        if not 0 <= num_logits[i] <= q_lens[i]:
            raise ValueError(f"sequence {i}: num_logits {num_logits[i]} not in [0, {q_lens[i]}]")
        needed = -(-(int(starts[i]) + int(q_lens[i])) // block_size)
        if len(s.block_table) < needed:
            raise ValueError(f"sequence {i}: {starts[i] + q_lens[i]} tokens need {needed} blocks of "
                             f"{block_size}, block table has {len(s.block_table)}")

"""What one forward call of the model reads besides its weights and the KV cache.

These types belong to the model layer: the engine (`gpu_backend.engine.input_batch`) builds them, and the
model and the attention kernels read them, so the model never imports the engine.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """What the attention kernels need for one packed step (all tensors on the model's device)."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [B, max_blocks] int64, 0-padded; [B, 1] region starts when contiguous
    context_lens: torch.Tensor  # [B] int64: tokens of each sequence including this step's
    cu_seqlens_q: torch.Tensor  # [B+1] int64: offsets of each sequence's tokens in the packed batch
    logits_indices: torch.Tensor  # [L] int64: packed rows whose logits are returned, in sequence order
    max_q_len: int  # host-side copies so the model can pick a kernel without a device sync
    max_context_len: int
    # True: block_tables is [B, 1] holding each sequence's region start in a linear slot pool, and
    # sequence b's context is slots [start, start + context_lens[b]) (contiguous allocators).
    contiguous: bool = False
    # A layout of several KV cache groups: each layer's metadata, whose slot mapping and block tables are
    # its group's (gpu_backend/engine/group_tables.py); None: every layer reads this one.
    layer_metadata: tuple[AttentionMetadata, ...] | None = None

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer `layer` attends with."""
        return self if self.layer_metadata is None else self.layer_metadata[layer]

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

"""A step's block tables and slot mappings for every KV cache group (the grouped engine's input batch).

The GroupedBlockManager keeps each sequence's table per group, where a sliding group's blocks that left
the window are holes (None: vLLM's null block). Each layer attends with its group's metadata
(`AttentionMetadata.layer_metadata`); tokens, positions and context lengths are the same for every group.
A hole becomes `NULL_BLOCK` in the tensors: the kernels never read a block wholly before the window of a
sequence's first query this step, and `check_no_hole_read` refuses a step that would read or write one.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import chain

import numpy as np
import torch

from gpu_backend.engine.input_batch import SequenceInput, build_model_input
from gpu_backend.engine.kv_groups import group_of_layer
from gpu_backend.model_input import ModelInput

NULL_BLOCK = 0  # any valid id would do: what a hole points to is never read
_HOLE = -1


def pack_group_tables(tables: Sequence[Sequence[int | None]]) -> tuple[np.ndarray, np.ndarray]:
    """[B, max_blocks] int64 (holes -1, padding 0) and the number of entries per row."""
    lens = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
    out = np.zeros((len(tables), max(int(lens.max()), 1)), dtype=np.int64)
    flat = np.fromiter((_HOLE if b is None else b for b in chain.from_iterable(tables)), dtype=np.int64,
                       count=int(lens.sum()))
    out[np.arange(out.shape[1])[None, :] < lens[:, None]] = flat
    return out, lens


def check_no_hole_read(tables: np.ndarray, first_read: np.ndarray, group: int) -> None:
    """Refuse tables with a hole at or after the first block a row's kernels read (engine bugs)."""
    cols = np.arange(tables.shape[1])[None, :]
    last_hole = np.where(tables == _HOLE, cols, -1).max(axis=1)
    bad = np.flatnonzero(last_hole >= first_read)
    if bad.size:
        r = bad[0]
        raise RuntimeError(f"KV cache group {group}: sequence {r} of the step reads block {last_hole[r]}, "
                           f"which its window handed back (it reads from block {first_read[r]} on)")


class GroupInputs:
    """Builds a grouped engine's packed step from the allocator's per-group tables."""

    def __init__(self, allocator, device: torch.device):
        self.tables = allocator.tables.tables  # seq id -> each group's table (the allocator's own lists)
        self.block_size = allocator.block_size
        layout = allocator.layout
        self.windows = [g.spec.window if g.spec.slides else None for g in layout.groups]
        self.layer_group = group_of_layer(layout)
        self.device = device

    def model_input(self, inputs: list[SequenceInput]) -> ModelInput:
        """The step's inputs; layer l reads the tables and writes the slots of its group."""
        bs = self.block_size
        starts = np.fromiter((i.start_pos for i in inputs), dtype=np.int64, count=len(inputs))
        metas = []
        step = None
        for g, window in enumerate(self.windows):
            tables, lens = pack_group_tables([self.tables[i.seq_id][g] for i in inputs])
            # The first block a row reads: its first query's window start (every block for full attention);
            # this step's slots lie at or after it, so no write lands in a hole either.
            first = np.zeros_like(starts) if window is None else np.maximum(starts - window + 1, 0) // bs
            check_no_hole_read(tables, first, g)
            tables[tables == _HOLE] = NULL_BLOCK
            built = build_model_input(inputs, bs, self.device, block_tables=tables, table_lens=lens)
            step = step or built
            metas.append(built.attn_metadata)
        layers = tuple(metas[g] for g in self.layer_group)
        return ModelInput(step.input_ids, step.positions, replace(metas[0], layer_metadata=layers))

"""Packed inputs: the decode fast path, contiguous regions and the one-copy staging layout."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_backend.engine.input_batch import SequenceInput, build_model_input


def _random_seqs(rng, decode_only: bool, contiguous: bool, block_size: int):
    seqs = []
    for _ in range(7):
        start = int(rng.integers(0, 40))
        q_len = 1 if decode_only else int(rng.integers(1, 10))
        if contiguous:
            table = [int(rng.integers(0, 500))]
        else:
            num_blocks = -(-(start + q_len) // block_size) + int(rng.integers(0, 2))
            table = rng.permutation(200)[:num_blocks].tolist()
        seqs.append(SequenceInput(rng.integers(0, 50, q_len).tolist(), start, table,
                                  num_logits=int(rng.integers(0, q_len + 1))))
    return seqs


@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.parametrize("contiguous", [True, False])
def test_packed_inputs_match_per_token_definition(decode_only, contiguous):
    rng = np.random.default_rng(11 + 2 * decode_only + contiguous)
    block_size = 4
    seqs = _random_seqs(rng, decode_only, contiguous, block_size)
    step = build_model_input(seqs, block_size, contiguous=contiguous)
    meta = step.attn_metadata
    ids, pos, slots, logits, offset = [], [], [], [], 0
    for s in seqs:
        for j, token in enumerate(s.token_ids):
            p = s.start_pos + j
            ids.append(token)
            pos.append(p)
            # A region's slot is start + position; a paged slot goes through the block table.
            slots.append(s.block_table[0] + p if contiguous else
                         s.block_table[p // block_size] * block_size + p % block_size)
        offset += len(s.token_ids)
        logits.extend(range(offset - s.num_logits, offset))
    assert step.input_ids.tolist() == ids
    assert step.positions.tolist() == pos
    assert meta.slot_mapping.tolist() == slots
    assert meta.logits_indices.tolist() == logits
    assert meta.context_lens.tolist() == [s.start_pos + len(s.token_ids) for s in seqs]
    assert meta.is_decode_only == decode_only and meta.contiguous == contiguous
    if contiguous:
        assert meta.block_tables.tolist() == [[s.block_table[0]] for s in seqs]
    else:
        for i, s in enumerate(seqs):
            assert meta.block_tables[i, : len(s.block_table)].tolist() == list(s.block_table)
            assert not meta.block_tables[i, len(s.block_table):].any()


def test_all_step_tensors_come_from_one_staging_buffer():
    seqs = [SequenceInput([4], 9, [2, 3]), SequenceInput([5, 6], 0, [7])]
    step = build_model_input(seqs, 8)
    meta = step.attn_metadata
    tensors = [step.input_ids, step.positions, meta.slot_mapping, meta.block_tables, meta.context_lens,
               meta.cu_seqlens_q, meta.logits_indices]
    # One host->device copy per step needs every array in one buffer.
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert all(t.dtype == torch.int64 for t in tensors)


def test_precomputed_tables_are_checked_against_their_lengths():
    tables = np.array([[3, 4], [5, 0]], dtype=np.int64)
    seqs = [SequenceInput([1], 7, [99]), SequenceInput([2], 4, [99])]
    with pytest.raises(ValueError, match="need 2 blocks"):
        build_model_input(seqs, 4, block_tables=tables, table_lens=np.array([2, 1]))
    step = build_model_input(seqs, 4, block_tables=tables, table_lens=np.array([2, 2]))
    assert step.attn_metadata.slot_mapping.tolist() == [4 * 4 + 3, 0 * 4 + 0]

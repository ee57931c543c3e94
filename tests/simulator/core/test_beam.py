"""simulator.core.beam: the prune/fork step both beam searches take, on real allocators."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.core import BlockManager, ContiguousAllocator, Sequence, SequenceGroup, SequenceStatus
from simulator.core.beam import prune_and_fork
from simulator.core.invariants import check_invariants

PROMPT = 5
FINAL = 64


def finish_with(allocator):
    """What the scheduler's `finish_seq` does: free the sequence and mark it finished."""
    def finish(seq: Sequence) -> None:
        allocator.free(seq)
        seq.status = SequenceStatus.FINISHED
    return finish


def beam_group(allocator, width: int, ids) -> SequenceGroup:
    """A running beam group of `width` sequences on `allocator`, each with one generated token."""
    seqs = [Sequence(next(ids), PROMPT, FINAL, request_id=0, token_ids=list(range(PROMPT)))
            for _ in range(width)]
    group = SequenceGroup(0, seqs, beam_width=width)
    allocator.allocate(group)
    for s in seqs:
        s.status = SequenceStatus.RUNNING
        allocator.append_slot(s)
        s.append_token(7)
    return group


def paged(width: int) -> BlockManager:
    # Each of the `width` beams may grow by a few blocks of its own after the forks.
    return BlockManager(8 * width + 8, 4, enable_prefix_caching=False, debug=True)


def contiguous(width: int) -> ContiguousAllocator:
    # Exactly `width` regions: forks fit only because the childless beams are freed first.
    return ContiguousAllocator(width * FINAL, "oracle", "first-fit", max_model_len=FINAL, debug=True)


def holds_nothing(allocator, seq: Sequence) -> bool:
    """Whether `seq` holds no device or CPU memory in `allocator`."""
    return not seq.block_table and not seq.cpu_block_table and seq.region is None


def test_frees_in_beam_order_then_forks_parent_by_parent():
    alloc = paged(4)
    ids = itertools.count(100)
    group = beam_group(alloc, 4, ids)
    b0, b1, b2, b3 = group.seqs
    finished = []

    def finish(seq):
        finished.append(seq)
        finish_with(alloc)(seq)

    forked = prune_and_fork(group, [b0, b1, b2, b3], [0, 3, 0, 1], allocator=alloc, finish=finish,
                            new_seq_id=lambda: next(ids))
    assert finished == [b0, b2]
    assert [c.seq_id for c in forked] == [104, 105]
    assert group.seqs == [b1, b3, *forked]
    assert all(c.block_table == b1.block_table and c.num_generated == b1.num_generated for c in forked)
    assert holds_nothing(alloc, b0) and holds_nothing(alloc, b2)
    check_invariants(alloc)


def test_contiguous_forks_report_their_copies():
    alloc = contiguous(3)
    ids = itertools.count()
    group = beam_group(alloc, 3, ids)
    copies = []
    forked = prune_and_fork(group, list(group.seqs), [0, 0, 3], allocator=alloc,
                            finish=finish_with(alloc), new_seq_id=lambda: next(ids), on_copies=copies.append)
    parent = group.seqs[0]
    assert len(forked) == 2 and len(copies) == 2
    for child, pairs in zip(forked, copies, strict=True):
        # A region of its own holding the parent's slots: one copy of the parent's filled span.
        assert child.region is not None and child.region[0] != parent.region[0]
        assert pairs == [(parent.region[0], child.region[0], parent.num_tokens)]
    check_invariants(alloc)


@pytest.mark.parametrize("counts, message", [([1, 2], "3 beams but 2 child counts"),
                                             ([3, -1, 1], "negative")])
def test_bad_child_counts_are_refused_before_anything_changes(counts, message):
    alloc = paged(3)
    ids = itertools.count()
    group = beam_group(alloc, 3, ids)
    before = list(group.seqs)
    with pytest.raises(ValueError, match=message):
        prune_and_fork(group, list(before), counts, allocator=alloc, finish=finish_with(alloc),
                       new_seq_id=lambda: next(ids))
    assert group.seqs == before and not any(s.is_finished for s in before)
    check_invariants(alloc)


@settings(max_examples=60, deadline=None)
@given(width=st.integers(1, 6), rounds=st.lists(st.lists(st.integers(0, 5), min_size=6, max_size=6),
                                                 min_size=1, max_size=5),
       contiguous_pool=st.booleans())
def test_any_prune_and_fork_keeps_the_allocator_sound(width, rounds, contiguous_pool):
    """Rounds of beam steps: each of the `width` next beams picks a parent among the live ones."""
    alloc = contiguous(width) if contiguous_pool else paged(width)
    ids = itertools.count()
    group = beam_group(alloc, width, ids)
    for picks in rounds:
        beams = [s for s in group.seqs if not s.is_finished]
        counts = [0] * len(beams)
        for p in picks[:width]:
            counts[p % len(beams)] += 1
        tables = {b.seq_id: (list(b.block_table), b.region, b.num_tokens) for b in beams}
        forked = prune_and_fork(group, beams, counts, allocator=alloc, finish=finish_with(alloc),
                                new_seq_id=lambda: next(ids))
        check_invariants(alloc)
        parents = [b for b, c in zip(beams, counts, strict=True) for _ in range(c - 1)]
        kept = [b for b, c in zip(beams, counts, strict=True) if c > 0]
        assert group.seqs == kept + forked and len(forked) == len(parents)
        for b in kept:  # a kept beam keeps what it held
            assert (b.block_table, b.region, b.num_tokens) == tables[b.seq_id]
        for child, parent in zip(forked, parents, strict=True):
            assert child.num_tokens == parent.num_tokens and not child.is_finished
            if contiguous_pool:
                assert child.region is not None and child.region != parent.region
            else:
                assert child.block_table == parent.block_table  # shared, not copied
        for b in beams:
            if b not in kept:
                assert b.is_finished and holds_nothing(alloc, b)
        for s in group.seqs:  # the next token: copy-on-write where a partial block is shared
            alloc.append_slot(s)
            s.append_token(7)
        check_invariants(alloc)

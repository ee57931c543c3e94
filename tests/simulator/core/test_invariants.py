"""The invariant checker itself: each kind of corrupted pool state is caught and named."""
from __future__ import annotations

import pytest

from simulator.core.errors import InvariantError
from simulator.core.invariants import check_invariants


@pytest.fixture
def swapped(paged, make_group):
    """A pool with one group on the device and one swapped out to the CPU."""
    bm = paged(16, 4, num_cpu_blocks=8, debug=False)
    on_device, away = make_group(6), make_group(5)
    bm.allocate(on_device)
    bm.allocate(away)
    bm.swap_out(away)
    check_invariants(bm)
    return bm, away.seqs[0]


def _break_gpu_ref(bm, seq):
    bm.pool.ref[bm.pool.free[-1]] = 1


def _gpu_block_twice(bm, seq):
    bm.pool.free.append(bm.pool.free[0])


def _cpu_ref_off(bm, seq):
    bm.swap.ref[seq.cpu_block_table[0]] += 1


def _cpu_ref_on_idle_block(bm, seq):
    bm.swap.ref[bm.swap.free[0]] = 1


def _cpu_free_loses_a_block(bm, seq):
    bm.swap.free.pop()


def _cpu_free_holds_a_block_twice(bm, seq):
    bm.swap.free[0] = bm.swap.free[1]


def _cpu_free_holds_a_held_block(bm, seq):
    bm.swap.free[0] = seq.cpu_block_table[0]


@pytest.mark.parametrize(("corrupt", "message"), [
    (_break_gpu_ref, "ref count 1 but 0 table entries"),
    (_gpu_block_twice, "a block appears twice in the free stack"),
    (_cpu_ref_off, "CPU block .*: ref count 2 but 1 entries"),
    (_cpu_ref_on_idle_block, "CPU block .*: ref count 1 but 0 entries"),
    (_cpu_free_loses_a_block, "CPU free list does not hold exactly"),
    (_cpu_free_holds_a_block_twice, "CPU free list does not hold exactly"),
    (_cpu_free_holds_a_held_block, "CPU free list does not hold exactly"),
])
def test_a_corrupted_pool_is_caught(swapped, corrupt, message):
    bm, seq = swapped
    corrupt(bm, seq)
    with pytest.raises(InvariantError, match=message):
        check_invariants(bm)

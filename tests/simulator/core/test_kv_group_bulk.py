"""The GroupedBlockManager's one-pass block work (kv_group_bulk.py) against its per-group path.

Every mutation of a CheckedManager first runs on a deep copy whose tables take and release group by group
(`bulk = False`), then on itself; the return values and the whole state after (the pool's ref counts, fill
levels, content keys, free stack, LRU order and counters, every table and per-group counter, the swap
pool, the sequences' token counts) must be equal, so block ids and eviction order match exactly. The
property test drives it with the random interleavings of test_kv_groups_props.py; the fixed cases below
make sure the one-pass paths (takes that evict, window runs handed back to the prefix cache) run.
"""
from __future__ import annotations

import copy

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from simulator import Sequence, SequenceGroup
from simulator.core.kv_layout import LayerKV, kv_cache_groups
from simulator.core.paged.kv_groups import GroupedBlockManager
from tests.simulator.core.test_kv_groups_props import GroupedMachine


def snapshot(bm: GroupedBlockManager) -> dict:
    """Everything the manager's block work can change, as plain values."""
    pool, t, swap = bm.pool, bm.tables, bm.swap
    return {
        "pool": (pool.ref, pool.filled, pool.key, pool.hash, pool.cached, pool.free, list(pool.free_cached),
                 pool.total_filled, pool.plain, pool.stats.as_dict()),
        "tables": (t.tables, t.held_in, t.filled_in, t.group_of, t.starts, t.remove_at, t.pending,
                   t.quiet_total, t.exclusive, t.window_released, t.publishes, t.internal,
                   t.num_internal_slots, t.chains),
        "swap": (swap.free, swap.ref, swap.filled, swap.group, swap.cpu_tables, swap.starts,
                 sorted(swap.seqs)),
        "seqs": {sid: (s.num_tokens, s.num_cached_tokens) for sid, s in bm.seqs.items()},
    }


def _checked(name: str):
    method = getattr(GroupedBlockManager, name)

    def run(self, *args):
        twin, twin_args = copy.deepcopy((self, args))
        twin.tables.bulk = False
        want = got = None
        try:
            want = method(twin, *twin_args)
        except Exception as e:  # noqa: BLE001 - the one-pass path must fail the same way
            want = type(e)
        try:
            got = method(self, *args)
        except Exception as e:  # noqa: BLE001
            got = type(e)
            if got is not want:
                raise
        assert got == want, name
        assert snapshot(self) == snapshot(twin), name
        if isinstance(got, type):
            raise got(f"{name} failed on both paths")
        return got

    run.__doc__ = f"`{name}`, checked against the per-group path."
    return run


class CheckedManager(GroupedBlockManager):
    """A GroupedBlockManager whose mutations are checked against the per-group path."""

    allocate = _checked("allocate")
    cache_blocks = _checked("cache_blocks")
    append_slot = _checked("append_slot")
    fork = _checked("fork")
    free = _checked("free")
    swap_out = _checked("swap_out")
    swap_in = _checked("swap_in")


class BulkMachine(GroupedMachine):
    """The grouped state machine over a CheckedManager, its layouts drawn so that prompts outrun their
    windows by several blocks (window runs to hand back) and pools run short (takes that evict)."""

    manager = CheckedManager

    @initialize(num_blocks=st.integers(4, 48), block_size=st.integers(1, 2),
                layers=st.lists(st.one_of(st.none(), st.integers(1, 4)), min_size=2, max_size=5),
                num_cpu=st.integers(0, 40), caching=st.sampled_from([True, True, True, False]),
                collide=st.booleans())
    def setup(self, num_blocks, block_size, layers, num_cpu, caching, collide):
        """A pool of the drawn layout (prefix caching on three times out of four)."""
        super().setup(num_blocks, block_size, layers, num_cpu, caching, collide)


TestBulkMachine = BulkMachine.TestCase
TestBulkMachine.settings = settings(max_examples=120, stateful_step_count=30, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


def _manager(num_blocks: int, caching: bool = True) -> CheckedManager:
    """Three sliding groups (window 6) and a full group of 2-token blocks."""
    specs = [LayerKV("sliding_window", 2, 4, 6)] * 3 + [LayerKV("full", 2, 4)]
    return CheckedManager(num_blocks, kv_cache_groups(specs), enable_prefix_caching=caching)


def _request(rid: int, prompt: list[int], extra: int = 8) -> SequenceGroup:
    return SequenceGroup(rid, [Sequence(rid, len(prompt), len(prompt) + extra, request_id=rid,
                                        token_ids=list(prompt))])


def test_window_runs_and_evicting_takes_match_the_per_group_path():
    bm = _manager(60)
    first = _request(1, list(range(20)))
    bm.allocate(first)
    assert bm.tables.num_groups == 4 and bm.pool.stats.evictions == 0
    seq = first.seqs[0]
    seq.token_ids.append(99)
    bm.append_slot(seq, 1)  # the windows hand back their leading blocks, published: kept cached
    assert bm.window_cached_blocks() > 0
    bm.free(seq)
    second = _request(2, [7] * 30)
    bm.allocate(second)  # more blocks than the free stack holds: the oldest cached ones are evicted
    assert bm.pool.stats.evictions > 0
    seq = second.seqs[0]
    for token in range(5):
        seq.token_ids.append(token)
        bm.append_slot(seq, 1)
    bm.free(seq)
    assert bm.num_used_blocks == 0


def test_a_window_run_some_blocks_of_which_are_shared():
    bm = _manager(80)
    first, second = _request(1, list(range(16))), _request(2, list(range(16)) + [5, 5])
    bm.allocate(first)
    assert bm.allocate(second) > 0  # second holds first's blocks too
    seq = second.seqs[0]
    seq.token_ids.append(1)
    bm.append_slot(seq, 1)  # hands back a run of which first still holds part
    bm.free(first.seqs[0])
    bm.free(seq)
    assert bm.num_used_blocks == 0

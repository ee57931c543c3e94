"""KV tiers behind the GroupedBlockManager (kv_group_tiers.py): pool invariants under random use, hits
that every group can serve, tokens by source, and a zero-size tier changing nothing."""
from __future__ import annotations

from simulator import Sequence, SequenceGroup
from simulator.core.kv_layout import LayerKV, kv_cache_groups
from simulator.core.paged.kv_groups import GroupedBlockManager

FULL_AND_SLIDING = kv_cache_groups([LayerKV("full", 2, 4), LayerKV("sliding_window", 2, 4, 64)])


def _request(bm, tokens: list[int], seq_id: int) -> Sequence:
    """A one-sequence request of `tokens`, allocated."""
    s = Sequence(seq_id, len(tokens), len(tokens) + 4, request_id=seq_id, token_ids=list(tokens))
    bm.allocate(SequenceGroup(seq_id, [s], n=1))
    return s


def test_taking_one_groups_blocks_never_evicts_another_groups_hit():
    bm = GroupedBlockManager(12, FULL_AND_SLIDING, debug=True)
    bm.free(_request(bm, [1, 2, 3, 4, 5], 1))  # its cached blocks: group 0's released first (oldest)
    bm.free(_request(bm, [9, 9, 9, 9, 9], 2))
    _request(bm, [7] * (len(bm.pool.free) // 2 * 2), 3)  # holds the free stack: taking must evict
    assert not bm.pool.free
    b = _request(bm, [1, 2, 3, 4, 6, 6, 6], 4)  # debug: the invariants are checked after allocating
    assert b.num_cached_tokens == 4
    groups = bm.tables.group_of
    assert [{groups[bid] for bid in table} for table in bm.tables.tables[b.seq_id]] == [{0}, {1}]

"""A prompt's fresh blocks are taken at once and published in one pass; where an eviction and a publish
meet on one hash, one block at a time: either way the pool ends as taking and publishing block by block."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator import BlockManager, Sequence, SequenceGroup


def _pool_state(bm: BlockManager) -> tuple:
    p = bm.pool
    return p.ref, p.filled, p.key, p.hash, dict(p.cached), list(p.free_cached), p.free, p.total_filled


def _allocate_block_by_block(bm: BlockManager, seq: Sequence) -> None:
    """The reference: the prompt's cached prefix, then one block taken and published at a time."""
    pool, bs, n = bm.pool, bm.block_size, seq.length
    seq.block_table = []
    for bid in bm.prefix_cache.lookup(seq):
        pool.incref(bid, seq.request_id, seq.seq_id)
        seq.block_table.append(bid)
    for i in range(len(seq.block_table), -(-n // bs)):
        bid = pool.take(1, seq.request_id, seq.seq_id)[0]
        pool.filled[bid] = min(bs, n - i * bs)
        pool.total_filled += pool.filled[bid]
        seq.block_table.append(bid)
        if i < n // bs:
            bm.prefix_cache.publish(seq, i, bid)
    seq.num_tokens = n
    bm.seqs[seq.seq_id] = seq


def _group(rid: int, keys: list[int], length: int) -> SequenceGroup:
    return SequenceGroup(rid, [Sequence(rid, length, length, request_id=rid, prefix_keys=keys)])


def test_an_evicted_block_holding_a_published_hash_leaves_the_cache_as_one_at_a_time():
    # Every content hashes alike: the cached free block 0 (hash 7) is evicted by the prompt that publishes
    # hash 7 again. Block by block, the publishes come first (the cache keeps block 0, first wins) and the
    # eviction then drops hash 7: nothing stays cached.
    bm = BlockManager(3, 1, watermark=0.0, hash_fn=lambda key: 7, debug=True)
    first = _group(0, [1], 2)
    bm.allocate(first)
    bm.free(first.seqs[0])
    assert dict(bm.pool.cached) == {7: 0}
    second = _group(1, [2, 3], 3)
    chain = bm.prefix_cache.chain(second.seqs[0], 0, 2)
    assert not bm.pool.evicts_none_of(3, [h for _, h in chain])
    bm.allocate(second)
    assert second.seqs[0].block_table == [1, 2, 0]
    assert bm.pool.cached == {}
    assert [bm.pool.hash[b] for b in (1, 2)] == [7, 7]


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(2, 20), block_size=st.integers(1, 3), collide=st.booleans(),
       ops=st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=8), st.integers(0, 2),
                              st.booleans()), min_size=1, max_size=25))
def test_taking_at_once_leaves_the_pool_as_taking_block_by_block(num_blocks, block_size, collide, ops):
    hash_fn = (lambda key: hash(key) % 5) if collide else hash
    fast = BlockManager(num_blocks, block_size, watermark=0.0, hash_fn=hash_fn, debug=True)
    slow = BlockManager(num_blocks, block_size, watermark=0.0, hash_fn=hash_fn)
    held: list[tuple[SequenceGroup, SequenceGroup]] = []
    for rid, (keys, tail, release) in enumerate(ops):
        length = len(keys) * block_size + tail + 1
        pair = (_group(rid, keys, length), _group(rid, keys, length))
        if release and held:
            old = held.pop(0)
            fast.free(old[0].seqs[0])
            slow.free(old[1].seqs[0])
        if fast.pool.num_free >= -(-length // block_size):
            fast.allocate(pair[0])
            _allocate_block_by_block(slow, pair[1].seqs[0])
            held.append(pair)
            assert pair[0].seqs[0].block_table == pair[1].seqs[0].block_table
        assert _pool_state(fast) == _pool_state(slow)

"""Debug invariant checks: recompute allocator state from scratch and compare.

Off by default, on in tests (`debug=True`)."""
from __future__ import annotations

from collections import Counter

from simulator.core.allocator import KVAllocator
from simulator.core.errors import InvariantError

# The checkers read the allocators' private state; they take the interface type so that this module,
# which both allocators import, imports neither of them.


def _fail(msg: str) -> None:
    raise InvariantError(msg)


def check_block_manager(bm: KVAllocator) -> None:
    """Ref counts match block tables, pools partition the blocks, fill levels match sequence lengths."""
    bs = bm.block_size
    refs = Counter(b for s in bm._seqs.values() for b in s.block_table)
    for bid in range(bm.num_blocks):
        if bm._ref[bid] < 0:
            _fail(f"block {bid} has negative ref count {bm._ref[bid]}")
        if bm._ref[bid] != refs.get(bid, 0):
            _fail(f"block {bid}: ref count {bm._ref[bid]} but {refs.get(bid, 0)} table entries")
    if bm._plain and (any(r > 1 for r in bm._ref) or any(k is not None for k in bm._key)):
        _fail("the manager claims no block was ever shared or keyed, but one is")
    free = bm._free
    if len(set(free)) != len(free):
        _fail("a block appears twice in the free stack")
    cached_free = set(bm._free_cached)
    if cached_free & set(free):
        _fail("a block is in both free pools")
    idle = {b for b in range(bm.num_blocks) if bm._ref[b] == 0}
    if idle != set(free) | cached_free:
        _fail("free pools do not hold exactly the blocks with ref count 0")
    if bm.num_free_blocks + bm.num_used_blocks != bm.num_blocks:
        _fail("free + used != total blocks")
    for h, bid in bm._cached.items():
        if bm._hash[bid] != h or bm._key[bid] is None:
            _fail(f"cache entry {h} points at block {bid} whose hash is {bm._hash[bid]}")
        if bid in set(free):
            _fail(f"cached block {bid} sits in the uncached free stack")
        if bm._filled[bid] != bs:
            _fail(f"cached block {bid} is not full ({bm._filled[bid]}/{bs})")
    for bid in cached_free:
        if bm._cached.get(bm._hash[bid]) != bid:
            _fail(f"block {bid} is in the cached free pool but not published in the cache")
    total = sum(bm._filled[b] for b in range(bm.num_blocks) if bm._ref[b] > 0)
    if total != bm._total_filled:
        _fail(f"filled slots {total} != running total {bm._total_filled}")
    for s in bm._seqs.values():
        n = s.num_tokens
        if len(s.block_table) != -(-n // bs):
            _fail(f"sequence {s.seq_id}: {n} tokens in {len(s.block_table)} blocks of {bs}")
        for i, bid in enumerate(s.block_table):
            want = min(bs, n - i * bs)
            if bm._filled[bid] != want:
                # Another owner changed a shared block, or fill accounting drifted.
                _fail(f"sequence {s.seq_id} block {i} (id {bid}) holds {bm._filled[bid]} tokens, "
                      f"sequence expects {want}")
        if s.seq_id in bm._cpu_seqs:
            _fail(f"sequence {s.seq_id} is both on the device and swapped out")
    cpu_refs = Counter(c for s in bm._cpu_seqs.values() for c in s.cpu_block_table)
    for cid in range(bm.num_cpu_blocks):
        if bm._cpu_ref[cid] != cpu_refs.get(cid, 0):
            _fail(f"CPU block {cid}: ref count {bm._cpu_ref[cid]} but {cpu_refs.get(cid, 0)} entries")
    if {c for c in range(bm.num_cpu_blocks) if bm._cpu_ref[c] == 0} != set(bm._cpu_free) or \
            len(set(bm._cpu_free)) != len(bm._cpu_free):
        _fail("CPU free list does not hold exactly the CPU blocks with ref count 0")
    b = bm.breakdown()
    if b.token_states + b.reservation + b.internal_fragmentation + b.external_fragmentation + b.free \
            != b.capacity or min(b.reservation, b.internal_fragmentation) < 0:
        _fail(f"taxonomy does not add up: {b}")


def check_contiguous(ca: KVAllocator) -> None:
    """Regions never overlap, free space + regions cover the pool exactly, sums match."""
    spans = sorted([(s.region[0], ca._placed[s.seq_id]) for s in ca._seqs.values()]
                   + list(ca._placement.free_spans()))
    pos = 0
    for start, size in spans:
        if start != pos:
            _fail(f"slot space has a gap or overlap at {pos} (next span starts at {start})")
        pos = start + size
    if pos != ca._placement.capacity:
        _fail(f"spans cover {pos} slots, pool has {ca._placement.capacity}")
    tokens = sum(s.num_tokens for s in ca._seqs.values())
    if tokens != ca._tokens:
        _fail(f"token total {tokens} != running total {ca._tokens}")
    for s in ca._seqs.values():
        if s.num_tokens > s.region[1]:
            _fail(f"sequence {s.seq_id} holds {s.num_tokens} tokens in a {s.region[1]}-slot region")
    b = ca.breakdown()
    if b.token_states + b.reservation + b.internal_fragmentation + b.external_fragmentation + b.free \
            != b.capacity or min(b.reservation, b.internal_fragmentation, b.free) < 0:
        _fail(f"taxonomy does not add up: {b}")

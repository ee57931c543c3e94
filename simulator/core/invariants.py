"""Debug invariant checks: recompute an allocator's state from scratch and compare.

Off by default; on in tests (`debug=True` checks after every mutation, or call `check_invariants`)."""
from __future__ import annotations

from collections import Counter

from simulator.core.allocator import KVAllocator
from simulator.core.errors import InvariantError

# The checkers read the allocators' internal state; they take the interface type so that this module,
# which both allocators import, imports neither of them.


def check_invariants(alloc: KVAllocator) -> None:
    """Raise InvariantError if the allocator's state does not match what its sequences hold."""
    if getattr(alloc, "layout", None) is not None:
        check_grouped(alloc)
    elif alloc.name == "paged":
        check_block_manager(alloc)
    else:
        check_contiguous(alloc)


def _fail(msg: str) -> None:
    raise InvariantError(msg)


def check_block_manager(bm: KVAllocator) -> None:
    """Ref counts match block tables, pools partition the blocks, fill levels match sequence lengths."""
    pool, swap = bm.pool, bm.swap
    bs = bm.block_size
    refs = Counter(b for s in bm.seqs.values() for b in s.block_table)
    for bid in range(bm.num_blocks):
        if pool.ref[bid] < 0:
            _fail(f"block {bid} has negative ref count {pool.ref[bid]}")
        if pool.ref[bid] != refs.get(bid, 0):
            _fail(f"block {bid}: ref count {pool.ref[bid]} but {refs.get(bid, 0)} table entries")
    if pool.plain and (any(r > 1 for r in pool.ref) or any(k is not None for k in pool.key)):
        _fail("the pool claims no block was ever shared or keyed, but one is")
    free = pool.free
    if len(set(free)) != len(free):
        _fail("a block appears twice in the free stack")
    cached_free = set(pool.free_cached)
    if cached_free & set(free):
        _fail("a block is in both free pools")
    idle = {b for b in range(bm.num_blocks) if pool.ref[b] == 0}
    if idle != set(free) | cached_free:
        _fail("free pools do not hold exactly the blocks with ref count 0")
    if bm.num_free_blocks + bm.num_used_blocks != bm.num_blocks:
        _fail("free + used != total blocks")
    for h, bid in pool.cached.items():
        if pool.hash[bid] != h or pool.key[bid] is None:
            _fail(f"cache entry {h} points at block {bid} whose hash is {pool.hash[bid]}")
        if bid in set(free):
            _fail(f"cached block {bid} sits in the uncached free stack")
        if pool.filled[bid] != bs:
            _fail(f"cached block {bid} is not full ({pool.filled[bid]}/{bs})")
    for bid in cached_free:
        if pool.cached.get(pool.hash[bid]) != bid:
            _fail(f"block {bid} is in the cached free pool but not published in the cache")
    total = sum(pool.filled[b] for b in range(bm.num_blocks) if pool.ref[b] > 0)
    if total != pool.total_filled:
        _fail(f"filled slots {total} != running total {pool.total_filled}")
    for s in bm.seqs.values():
        n = s.num_tokens
        if len(s.block_table) != -(-n // bs):
            _fail(f"sequence {s.seq_id}: {n} tokens in {len(s.block_table)} blocks of {bs}")
        for i, bid in enumerate(s.block_table):
            want = min(bs, n - i * bs)
            if pool.filled[bid] != want:
                # Another owner changed a shared block, or fill accounting drifted.
                _fail(f"sequence {s.seq_id} block {i} (id {bid}) holds {pool.filled[bid]} tokens, "
                      f"sequence expects {want}")
        if s.seq_id in swap.seqs:
            _fail(f"sequence {s.seq_id} is both on the device and swapped out")
    # The CPU pool often has millions of blocks (4 GiB of a small model's pages): every pass over it is a
    # C-level one, and a Python loop runs only over the blocks tables hold or to name a failure.
    cpu_refs = Counter(c for s in swap.seqs.values() for c in s.cpu_block_table)
    cpu_ref, cpu_free = swap.ref, swap.free
    num_idle = cpu_ref.count(0)
    if any(cpu_ref[c] != n for c, n in cpu_refs.items()) or swap.num_blocks - num_idle != len(cpu_refs):
        cid = next(c for c in range(swap.num_blocks) if cpu_ref[c] != cpu_refs.get(c, 0))
        _fail(f"CPU block {cid}: ref count {cpu_ref[cid]} but {cpu_refs.get(cid, 0)} entries")
    # As many entries as idle blocks, each idle, none twice: exactly the idle blocks.
    if len(cpu_free) != num_idle or any(map(cpu_ref.__getitem__, cpu_free)) or \
            len(set(cpu_free)) != len(cpu_free):
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
    if tokens != ca.tokens_held:
        _fail(f"token total {tokens} != running total {ca.tokens_held}")
    for s in ca._seqs.values():
        if s.num_tokens > s.region[1]:
            _fail(f"sequence {s.seq_id} holds {s.num_tokens} tokens in a {s.region[1]}-slot region")
    b = ca.breakdown()
    if b.token_states + b.reservation + b.internal_fragmentation + b.external_fragmentation + b.free \
            != b.capacity or min(b.reservation, b.internal_fragmentation, b.free) < 0:
        _fail(f"taxonomy does not add up: {b}")


def check_grouped(bm) -> None:
    """One pool partitioned into free and held blocks; ref counts, per-group counters and fill levels
    match the tables; windows only hand back blocks wholly outside them; cached blocks are keyed by their
    group; the CPU pool matches its tables; the taxonomy adds up."""
    pool, t, swap, bs = bm.pool, bm.tables, bm.swap, bm.block_size
    for sid in t.pending:  # pending decode tokens into their blocks' fill levels first
        t.settle(sid)
    if t.quiet_total:
        _fail(f"{t.quiet_total} decode tokens are counted but belong to no held sequence")
    refs = Counter(b for sid in bm.seqs for table in t.tables[sid] for b in table if b is not None)
    if any(set(d) != set(bm.seqs) for d in (t.tables, t.starts, t.remove_at, t.pending, t.exclusive)) \
            or set(swap.starts) != set(swap.seqs):
        _fail("block tables and held sequences differ")
    for bid in range(bm.num_blocks):
        if pool.ref[bid] != refs.get(bid, 0):
            _fail(f"block {bid}: ref count {pool.ref[bid]} but {refs.get(bid, 0)} table entries")
    free, cached_free = pool.free, set(pool.free_cached)
    if len(set(free)) != len(free) or cached_free & set(free):
        _fail("a block is twice in the free pools")
    if {b for b in range(bm.num_blocks) if pool.ref[b] == 0} != set(free) | cached_free:
        _fail("free pools do not hold exactly the blocks with ref count 0")
    held, filled = [0] * t.num_groups, [0] * t.num_groups
    for bid in refs:
        held[t.group_of[bid]] += 1
        filled[t.group_of[bid]] += pool.filled[bid]
    if held != t.held_in or filled != t.filled_in:
        _fail(f"per-group counters {t.held_in}/{t.filled_in} != tables' {held}/{filled}")
    if sum(filled) != pool.total_filled:
        _fail(f"filled slots {sum(filled)} != running total {pool.total_filled}")
    for sid, s in bm.seqs.items():
        n = s.num_tokens
        for g, table in enumerate(t.tables[sid]):
            if len(table) != -(-n // bs):
                _fail(f"sequence {sid} group {g}: {n} tokens in {len(table)} blocks of {bs}")
            holes = [i for i, b in enumerate(table) if b is None]
            if holes != list(range(t.starts[sid][g])):
                _fail(f"sequence {sid} group {g}: holes {holes} are not its first {t.starts[sid][g]} blocks")
            if holes and holes[-1] >= t.skipped(g, n):
                _fail(f"sequence {sid} group {g}: block {holes[-1]} handed back inside the window")
            for i, bid in enumerate(table):
                if bid is None:
                    continue
                if t.group_of[bid] != g:
                    _fail(f"sequence {sid} group {g} holds block {bid} of group {t.group_of[bid]}")
                if pool.filled[bid] != min(bs, n - i * bs):
                    _fail(f"sequence {sid} group {g} block {i} (id {bid}) holds {pool.filled[bid]} tokens")
    for h, bid in pool.cached.items():
        key = pool.key[bid]
        if pool.hash[bid] != h or key is None or key[0] != t.group_of[bid] or pool.filled[bid] != bs:
            _fail(f"cache entry {h} -> block {bid} is not a full block keyed by its group")
    for bid in cached_free:
        if pool.cached.get(pool.hash[bid]) != bid:
            _fail(f"block {bid} is in the cached free pool but not published")
    if not t.window_released <= cached_free:  # the breakdown counts them as cached free blocks
        _fail(f"window-released blocks {sorted(t.window_released - cached_free)} are not cached free")
    cpu_refs = Counter(c for rows in swap.cpu_tables.values() for row in rows for c in row if c is not None)
    for cid in range(swap.num_blocks):
        if swap.ref[cid] != cpu_refs.get(cid, 0):
            _fail(f"CPU block {cid}: ref count {swap.ref[cid]} but {cpu_refs.get(cid, 0)} entries")
    if {c for c in range(swap.num_blocks) if swap.ref[c] == 0} != set(swap.free):
        _fail("CPU free list does not hold exactly the CPU blocks with ref count 0")
    if set(swap.seqs) & set(bm.seqs):
        _fail("a sequence is both on the device and swapped out")
    b = bm.breakdown()
    if b.token_states + b.reservation + b.internal_fragmentation + b.external_fragmentation + b.free \
            != b.capacity or min(b.reservation, b.internal_fragmentation) < 0:
        _fail(f"taxonomy does not add up: {b}")
    if not (0 <= b.padding <= b.internal_fragmentation and 0 <= b.window_cached <= b.cached_free <= b.free):
        _fail(f"padding or window-kept blocks exceed the state they are part of: {b}")

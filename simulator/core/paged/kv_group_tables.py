"""Per-group block tables over one BlockPool (the GroupedBlockManager's state, kv_groups.py): taking and
releasing blocks group by group, windows freeing skipped blocks, and the sequences' internal fragmentation
(prefix keys and hits valid in every group are kv_group_hits.py's, the CPU pool kv_group_swap.py's).

A table entry is a block id, or None where a sliding window has handed the block back (vLLM's null
block). Counters per group (`held_in`, `filled_in`) change only when a block's ref count goes between 0
and 1, so the breakdown reads them without walking the pool.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from simulator.core.kv_layout import KVLayout
from simulator.core.paged.block_pool import BlockPool
from simulator.core.paged.kv_group_bulk import GroupBulk
from simulator.core.paged.kv_group_hits import GroupHits
from simulator.core.sequence import Sequence


def block_fills(tokens: int, block_size: int) -> list[int]:
    """The fill of each of the fresh blocks that `tokens` more tokens take: full ones, then the rest."""
    num = _cdiv(tokens, block_size)
    return [block_size] * (num - 1) + [tokens - (num - 1) * block_size]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GroupSpec:
    """What the tables need of one KV cache group."""

    layers: int  # real layers in the group
    padding: int  # layer slots of each block that no layer uses
    window: int | None  # tokens a sliding-window layer attends to (None: full attention)
    need: int  # blocks a prefix hit must have before its end: ceil((window - 1) / block_size), or 0


class GroupTables(GroupHits, GroupBulk):
    """The per-group tables, counters, content keys and CPU pool of a GroupedBlockManager."""

    def __init__(self, pool: BlockPool, seqs: dict[int, Sequence], layout: KVLayout, enabled: bool,
                 hash_fn: Callable[[object], int]) -> None:
        self.pool, self.seqs, self.enabled, self.hash_fn = pool, seqs, enabled, hash_fn
        bs = self.block_size = pool.block_size
        self.specs = [GroupSpec(len(g.layers), layout.padding_layers(g),
                                g.spec.window if g.spec.slides else None,
                                _cdiv(g.spec.window - 1, bs) if g.spec.slides else 0) for g in layout.groups]
        self.num_groups = len(self.specs)
        self.tables: dict[int, list[list[int | None]]] = {}
        self.held_in = [0] * self.num_groups  # referenced blocks of each group
        self.filled_in = [0] * self.num_groups  # token slots filled in them
        self.group_of = [0] * pool.num_blocks  # the group a block was last taken for
        self.starts: dict[int, list[int]] = {}  # seq id -> each group's first block still held
        self.remove_at: dict[int, int] = {}  # seq id -> the computed length at which a window next frees
        self.windowed = [g for g, spec in enumerate(self.specs) if spec.window is not None]
        self.hit_order = sorted(range(self.num_groups), key=lambda g: self.specs[g].need)  # full first
        # Decode tokens written into every group's own last block are counted here first and settled into
        # the blocks' fill levels when the sequence next does anything else (one count per token, not one
        # per group); `exclusive` says that no last block of the sequence is shared.
        self.pending: dict[int, int] = {}
        self.quiet_total = 0
        self.exclusive: dict[int, bool] = {}
        self.init_hits()
        self.internal: dict[int, int] = {}  # seq id -> internal layer slots counted for it
        self.num_internal_slots = 0
        self.window_released: set[int] = set()  # blocks a window handed back while published
        self.tiers = None  # KV tiers below the GPU, when attached (kv_group_tiers.py)
        self.skipped_at: dict[int, int] = {}  # hit in blocks -> leading blocks the windows leave out
        self.bulk = True  # take and release all groups' blocks in one pass where the pool allows it

    # ----------------------------------------------------------------- blocks of one group
    def take(self, g: int, num: int, rid: int, sid: int, fills: list[int]) -> list[int]:
        """`num` fresh blocks for group `g` taken by sequence `sid`, filled as `fills` says."""
        pool = self.pool
        new = pool.take(num, rid, sid)
        filled, group_of = pool.filled, self.group_of
        for bid, f in zip(new, fills, strict=True):
            filled[bid] = f
            group_of[bid] = g
        if self.window_released:
            self.window_released.difference_update(new)
        total = sum(fills)
        pool.total_filled += total
        self.held_in[g] += num
        self.filled_in[g] += total
        return new

    def incref(self, bid: int, rid: int, sid: int) -> None:
        """One more holder of `bid` (a hit on a free cached block brings it back, to sequence `sid`)."""
        if self.pool.ref[bid] == 0:
            g = self.group_of[bid]
            self.held_in[g] += 1
            self.filled_in[g] += self.pool.filled[bid]
            self.window_released.discard(bid)
        self.pool.incref(bid, rid, sid)

    def release(self, bids: list[int]) -> None:
        """One holder less of each of `bids` (blocks of one table, in order: the last is released first)."""
        pool, ref = self.pool, self.pool.ref
        last = [bid for bid in bids if ref[bid] == 1]  # the blocks this release frees
        if last:
            g = self.group_of[last[0]]  # one table's blocks: all of one group
            self.held_in[g] -= len(last)
            self.filled_in[g] -= sum(map(pool.filled.__getitem__, last))
        pool.release_table(bids)

    def fill(self, bid: int, more: int) -> None:
        """`more` token slots of held block `bid` filled."""
        self.pool.filled[bid] += more
        self.pool.total_filled += more
        self.filled_in[self.group_of[bid]] += more

    # ----------------------------------------------------------------- windows
    def first_held(self, g: int, num_blocks: int) -> int:
        """First block a sliding group still needs once `num_blocks` blocks of tokens are computed
        (`remove_skipped_blocks`: tokens older than window - 1 behind the computed ones are skipped)."""
        window = self.specs[g].window
        if window is None:
            return 0
        return max(0, num_blocks * self.block_size - window + 1) // self.block_size

    def skipped(self, g: int, num_computed: int) -> int:
        """Leading blocks of group `g` wholly outside the window after `num_computed` tokens."""
        window = self.specs[g].window
        return 0 if window is None else max(0, num_computed - window + 1) // self.block_size

    def next_removal(self, sid: int) -> None:
        """Record when a window of `sid` next hands a block back: once `window - 1` tokens are computed
        past the end of its first held block."""
        starts, bs = self.starts[sid], self.block_size
        self.remove_at[sid] = min(((starts[g] + 1) * bs + self.specs[g].window - 1 for g in self.windowed),
                                  default=1 << 62)

    def quiet(self, seq: Sequence, k: int) -> bool:
        """Whether growing `seq` by `k` is the common decode token: one slot in every group's own partly
        filled last block, no window hands anything back and no block completes for publishing."""
        n, bs = seq.num_tokens, self.block_size
        if k != 1 or not n % bs or n >= self.remove_at[seq.seq_id] or not self.exclusive[seq.seq_id]:
            return False
        return (n + 1) % bs != 0 or seq.token_ids is None or not self.enabled

    def settle(self, sid: int) -> None:
        """Write the sequence's pending decode tokens into its last blocks' fill levels."""
        p = self.pending[sid]
        if p:
            filled, filled_in = self.pool.filled, self.filled_in
            for g, table in enumerate(self.tables[sid]):
                filled[table[-1]] += p
                filled_in[g] += p
            self.pool.total_filled += p * self.num_groups
            self.quiet_total -= p
            self.pending[sid] = 0

    def mark_exclusive(self, sid: int) -> None:
        """Record whether every last block of `sid` is its own."""
        ref = self.pool.ref
        self.exclusive[sid] = all(ref[table[-1]] == 1 for table in self.tables[sid])

    # ----------------------------------------------------------------- sizes
    def prompt_blocks(self, length: int, hit: int) -> int:
        """Blocks a sequence of `length` tokens holds right after allocation with `hit` blocks hit."""
        skipped = self.skipped_at.get(hit)
        if skipped is None:  # asked for the waiting request at every step: kept per hit
            skipped = self.skipped_at[hit] = sum(self.first_held(g, hit) for g in range(self.num_groups))
        return _cdiv(length, self.block_size) * self.num_groups - skipped

    def peak_blocks(self, length: int, chunk: int = 1) -> int:
        """Blocks one sequence holds at most while it grows to `length` tokens by at most `chunk` at a
        time (1: decoding; a window frees the blocks it has passed before each step takes new ones)."""
        total = _cdiv(length, self.block_size)
        top = _cdiv(chunk, self.block_size) + 1
        return sum(total if s.window is None else min(total, s.need + top) for s in self.specs)

    # ----------------------------------------------------------------- sequences
    def allocate_one(self, seq: Sequence, rid: int, budget: int, chunked: bool = False) -> int:
        """Every group's blocks for the tokens of `seq` (hits first): all of them, or (`chunked`) those up
        to `budget` tokens past the hit, as vLLM v1 allocates a prefill chunk; publish the full blocks
        within `budget` tokens past the hit; return the hit in tokens."""
        bs, n, stats = self.block_size, seq.length, self.pool.stats
        hit, hits = self.longest_hit(seq)
        if self.tiers is not None:  # pages in KV tiers may extend the hit (kv_group_tiers.py)
            loaded = self.tiers.allocate(seq, rid, budget, hit, chunked)
            if loaded is not None:
                return loaded
        slots = min(n, hit * bs + budget) if chunked else n
        chain = self.lookup_chain(seq)
        if chain is not None:  # its blocks are published under the keys the lookup built
            self.chains.setdefault(seq.seq_id, chain)
        if self.enabled:
            stats.prefix_queries += (n - 1) // bs
            stats.prefix_query_tokens += n
        stats.prefix_hits += hit
        stats.prefix_hit_tokens += hit * bs
        total = _cdiv(slots, bs)
        # Every group's hits are held before any group takes a fresh block (vLLM touches them all first),
        # so that no take evicts a cached block another group is about to reuse.
        for per_group in hits:
            for bid in per_group:
                self.incref(bid, rid, seq.seq_id)
        fills = block_fills(slots - hit * bs, bs) if slots > hit * bs else []
        starts = [self.first_held(g, hit) for g in range(self.num_groups)]
        tables = [[None] * starts[g] + hits[g] + new
                  for g, new in enumerate(self.take_each(total - hit, rid, seq.seq_id, fills))]
        self.hold(seq, tables, starts, slots, hit * bs)
        self.publish_range(seq, hit, min(n, hit * bs + budget) // bs)
        return hit * bs

    def share_tables(self, src: Sequence, dst: Sequence) -> None:
        """`dst` holds every block `src` holds, in every group."""
        rid = src.request_id
        self.settle(src.seq_id)
        tables = self.tables[src.seq_id]
        for table in tables:
            for bid in table:
                if bid is not None:
                    self.incref(bid, rid, src.seq_id)
        self.tables[dst.seq_id] = [list(t) for t in tables]
        self.starts[dst.seq_id] = list(self.starts[src.seq_id])
        self.remove_at[dst.seq_id] = self.remove_at[src.seq_id]
        self.pending[dst.seq_id] = 0
        self.exclusive[src.seq_id] = self.exclusive[dst.seq_id] = False
        dst.num_tokens = src.num_tokens
        self.seqs[dst.seq_id] = dst
        self.count_internal(dst)

    def share_prompt(self, src: Sequence, dst: Sequence, shared: int) -> None:
        """`dst` holds the first `shared` blocks `src` holds, in every group, and its own blocks for the rest
        of its tokens (`src` holds no block a window skips past them: its hit is within them)."""
        rid, sid, n, bs = dst.request_id, dst.seq_id, dst.length, self.block_size
        heads = [table[:shared] for table in self.tables[src.seq_id]]
        for head in heads:
            for bid in head:
                if bid is not None:
                    self.incref(bid, rid, sid)
        own = self.take_each(_cdiv(n, bs) - shared, rid, sid, block_fills(n - shared * bs, bs))
        tables = [head + new for head, new in zip(heads, own, strict=True)]
        self.hold(dst, tables, list(self.starts[src.seq_id]), n, shared * bs)

    def hold(self, seq: Sequence, tables: list[list[int | None]], starts: list[int], num_tokens: int,
             num_cached_tokens: int) -> None:
        """Record that `seq` holds `tables` (each group's first held block at `starts`) for `num_tokens`
        tokens, `num_cached_tokens` of them not computed by it."""
        sid = seq.seq_id
        self.tables[sid], self.starts[sid] = tables, starts
        self.next_removal(sid)
        self.pending[sid] = 0
        self.mark_exclusive(sid)
        seq.num_tokens = num_tokens
        seq.num_cached_tokens = num_cached_tokens
        self.seqs[sid] = seq
        self.count_internal(seq)

    def append_need(self, seq: Sequence, k: int) -> int:
        """Free blocks growing `seq` by `k` tokens takes, less what its windows hand back first."""
        if self.quiet(seq, k):
            return 0
        n, bs, ref = seq.num_tokens, self.block_size, self.pool.ref
        grow = _cdiv(n + k, bs) - _cdiv(n, bs)
        need = 0
        starts = self.starts[seq.seq_id]
        for g, table in enumerate(self.tables[seq.seq_id]):
            need += grow
            if n % bs and ref[table[-1]] > 1:
                need += 1  # the shared partial last block is copied first
            need -= list(map(ref.__getitem__, table[starts[g]:self.skipped(g, n)])).count(1)
        return need

    def remove_skipped(self, seq: Sequence, num_computed: int) -> None:
        """Hand back the blocks every window has passed (`SlidingWindowManager.remove_skipped_blocks`),
        newest first, as vLLM frees a chain: its tail is evicted before the blocks a hit needs first."""
        starts = self.starts[seq.seq_id]
        for g, table in enumerate(self.tables[seq.seq_id]):
            end = self.skipped(g, num_computed)
            if end <= starts[g]:
                continue
            gone = table[starts[g]:end]
            table[starts[g]:end] = [None] * len(gone)
            self.release_run(gone, True)
            starts[g] = end
        self.next_removal(seq.seq_id)

    def grow(self, seq: Sequence, k: int) -> list[tuple[int, int]]:
        """Free what the windows skip, then give every group slots for `k` more tokens; return the
        copy-on-write (src, dst) pairs."""
        n, bs, rid, pool = seq.num_tokens, self.block_size, seq.request_id, self.pool
        if self.quiet(seq, k):
            self.pending[seq.seq_id] += 1
            self.quiet_total += 1
            seq.num_tokens = n + 1
            return []
        self.settle(seq.seq_id)
        self.remove_skipped(seq, n)
        copies = []
        rem = n % bs
        tables = self.tables[seq.seq_id]
        if not rem:  # at a block boundary every group takes the same fresh blocks
            if k > 0:
                fresh = self.take_each(_cdiv(k, bs), rid, seq.seq_id, block_fills(k, bs))
                for table, new in zip(tables, fresh, strict=True):
                    table.extend(new)
        else:
            for g, table in enumerate(tables):
                last = table[-1]
                if pool.ref[last] > 1:  # never write a shared block in place
                    new = self.take(g, 1, rid, seq.seq_id, [rem])[0]
                    self.release([last])
                    table[-1] = new
                    copies.append((last, new))
                    pool.stats.cow_copies += 1
                fill = min(k, bs - rem)
                self.fill(table[-1], fill)
                left = k - fill
                if left > 0:
                    table.extend(self.take(g, _cdiv(left, bs), rid, seq.seq_id, block_fills(left, bs)))
        seq.num_tokens = n + k
        if seq.token_ids is not None:
            self.publish_range(seq, n // bs, seq.num_tokens // bs)
        self.count_internal(seq)
        self.mark_exclusive(seq.seq_id)
        return copies

    def count_internal(self, seq: Sequence) -> None:
        """Once `seq` holds its final block, the slots past its final length are internal waste, in every
        group's layers (counted once)."""
        final, bs = seq.final_len, self.block_size
        if final is not None and _cdiv(seq.num_tokens, bs) * bs >= final and seq.seq_id not in self.internal:
            waste = (_cdiv(final, bs) * bs - final) * sum(s.layers for s in self.specs)
            self.internal[seq.seq_id] = waste
            self.num_internal_slots += waste

    def release_device(self, seq: Sequence) -> None:
        """Drop the sequence's device blocks in every group, last block first."""
        self.settle(seq.seq_id)
        del self.seqs[seq.seq_id], self.pending[seq.seq_id], self.exclusive[seq.seq_id]
        starts = self.starts.pop(seq.seq_id)
        del self.remove_at[seq.seq_id]
        for g, table in enumerate(self.tables.pop(seq.seq_id)):
            self.release_run(table[starts[g]:], False)
        self.num_internal_slots -= self.internal.pop(seq.seq_id, 0)
        seq.block_table = []

    def forget(self, seq: Sequence) -> None:
        """Drop the content keys kept for a sequence that holds nothing any more."""
        self.chains.pop(seq.seq_id, None)

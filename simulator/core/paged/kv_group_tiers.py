"""KV tiers below the GPU for a model with several KV cache groups (the GroupedBlockManager, kv_groups.py).

A tier entry is one block's token range, keyed by the chained hash of its content (the GPU pool keys each
group's page of it by that hash tagged with the group), and holds the pages of the groups that still had
them when they came down: a full-attention group's page always, a sliding group's only while its window
kept it. Pages come down as in tiers.py: when the GPU evicts them (`lazy`) or when their last holder lets
them go (`eager`: a finishing sequence, or a window handing back what it skipped); a page of a range the
CPU tier holds joins its entry; the CPU tier's evictions (whole entries) go down to the disk
tier, the disk tier's are dropped; an entry lives in one tier (a page stored for a range the disk holds
brings that entry up). Capacity counts pages: a tier of N GPU blocks holds N pages, whichever groups.

A prompt's hit extends past the GPU's (the prefix every group hits) to the longest end that every group
can serve from the GPU or a tier: a full-attention group every block before the end, a sliding group the
last `ceil((window - 1) / block_size)` blocks before it, as `group_hit` rules for GPU hits (the end is a
whole number of tier blocks). Each page served from a tier is loaded into a fresh GPU block, its bytes
charged to the step over the tier's bandwidth; each block of the extension counts its tokens to the
deepest tier it loaded a page from (to the GPU when all its needed pages were there). Eviction is LRU,
LFU or S3-FIFO, entries weighing as many pages as they hold (LRU on the entries' OrderedDict, the others
through group_policy.py). Stores are not charged, as in tiers.py.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable

from simulator.core.paged.group_policy import PolicyEntries
from simulator.core.paged.kv_group_tables import block_fills
from simulator.core.paged.tier import (
    TierSpec,
    TierStats,
    check_tiers,
    pairs_into,
    swap_counter,
    take_load_seconds,
    tier_summary,
)
from simulator.core.sequence import Sequence


def mask_groups(mask: int) -> list[int]:
    """The groups whose pages an entry's group mask says it holds (bit g: group g)."""
    return [g for g in range(mask.bit_length()) if mask >> g & 1]


class GroupTier:
    """A tier's entries (range hash -> [content, extra key, group mask]; under LRU oldest first), pages
    and counters."""

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.keys: OrderedDict[int, list] | PolicyEntries = OrderedDict() if spec.policy == "lru" \
            else PolicyEntries(self)
        self.used = 0  # pages held
        self.capacity = spec.num_blocks
        self.stats = TierStats()
        self.pending = 0  # pages loaded from this tier since the step time last took them
        self.below: list[GroupTier] = []


class GroupTiers:
    """The CPU and disk tiers behind a GroupedBlockManager's pool (either may be absent)."""

    def __init__(self, specs: list[TierSpec], store: str, tables, page_bytes: int, bytes_per_token: int,
                 swap_used: Callable[[], int] = lambda: 0) -> None:
        check_tiers(specs, store)
        self.tiers = [GroupTier(s) for s in specs]
        for i, tier in enumerate(self.tiers):
            tier.below = self.tiers[i + 1:]
        self.tables = tables
        self.store_mode = store
        self.eager = store == "eager"
        self.block_size = tables.block_size
        self.tokens_per_page = page_bytes / bytes_per_token  # a page's bytes, as the load model counts them
        self.swap_used = swap_used
        self.per_tier = specs[0].blocks_per_tier_block if specs else 1
        self.cpu = next((t for t in self.tiers if t.spec.name == "cpu"), None)
        self.ranges: dict[int, int] = {}  # group-tagged hash of a published page -> its range hash
        self.queue: list[tuple[int, tuple]] = []  # (tagged hash, (group, key)) of pages handed down
        self.evicted: list[tuple[int, tuple]] = []  # storing eagerly: pages the GPU evicted since
        self.log = None  # a kv_group_tier_log.GroupTierLog when a driver keeps the pages' data (the engine)

    # ----------------------------------------------------------------- queries
    def entry(self, h: int, content: object, extra: object) -> tuple[int, GroupTier | None, int]:
        """(tier index, tier, group mask) of the entry for range `h` with this content (mask 0: none)."""
        for i, tier in enumerate(self.tiers):
            e = tier.keys.get(h)
            if e is not None and e[0] == content and e[1] == extra:
                return i, tier, e[2]
        return -1, None, 0

    def source(self, g: int, link: tuple[tuple, int], found: tuple) -> int | GroupTier | None:
        """Where group `g`'s page of block `link` can come from: its GPU block, a tier, or nowhere."""
        bid = self.tables.cached(g, link)
        if bid is not None:
            return bid
        return found[1] if found[2] >> g & 1 else None

    def extension(self, seq: Sequence, hit: int, chain: list) -> int:
        """The longest hit past the GPU's `hit` blocks that every group can serve (`hit`: none)."""
        t, bs = self.tables, self.block_size
        top = (seq.length - 1) // bs
        if not self.tiers or hit >= top or len(t.extend(seq, chain, top)) <= hit:
            return hit
        full = [g for g, s in enumerate(t.specs) if not s.need]
        sliding = [(g, s.need) for g, s in enumerate(t.specs) if s.need]
        extra = seq.extra_key
        runs = []  # per sliding group: served pages in a row before the block looked at
        for g, need in sliding:
            run = 0
            for i in range(hit - 1, max(-1, hit - 1 - need), -1):
                link = chain[i]
                if self.source(g, link, self.entry(link[1], link[0][1], extra)) is None:
                    break
                run += 1
            runs.append(run)
        best = hit
        for i in range(hit, min(top, len(chain))):
            link = chain[i]
            found = self.entry(link[1], link[0][1], extra)
            if any(self.source(g, link, found) is None for g in full):
                break
            for j, (g, _) in enumerate(sliding):
                runs[j] = runs[j] + 1 if self.source(g, link, found) is not None else 0
            end = i + 1
            if end % self.per_tier == 0 and all(run >= min(need, end)
                                                for run, (_, need) in zip(runs, sliding, strict=True)):
                best = end
        return best

    # ----------------------------------------------------------------- mutations
    def allocate(self, seq: Sequence, rid: int, budget: int, hit: int, chunked: bool = False) -> int | None:
        """GroupTables.allocate_one for a prompt whose hit the tiers extend (None: they do not; the
        tables allocate it): every token's blocks, or (`chunked`) those up to `budget` tokens past the
        extended hit. GPU pages are held first, so the fresh blocks taken after cannot evict them."""
        t, bs = self.tables, self.block_size
        if not t.enabled or (seq.token_ids is None and not seq.prefix_keys):
            return None
        self.flush()
        chain: list = []
        end = self.extension(seq, hit, chain)
        if end == hit:
            return None
        n, sid, stats = seq.length, seq.seq_id, t.pool.stats
        stats.prefix_queries += (n - 1) // bs
        stats.prefix_query_tokens += n
        stats.prefix_hits += hit
        stats.prefix_hit_tokens += hit * bs
        extra = seq.extra_key
        found = [self.entry(link[1], link[0][1], extra) for link in chain[:end]]
        starts = [t.first_held(g, end) for g in range(t.num_groups)]
        rows = [[self.source(g, chain[i], found[i]) for i in range(starts[g], end)]
                for g in range(t.num_groups)]
        for row in rows:
            for src in row:
                if type(src) is int:
                    t.incref(src, rid, sid)
        deepest = [-1] * end  # per block: the deepest tier a page of it came from
        slots = min(n, end * bs + budget) if chunked else n
        total = -(-slots // bs)
        tables = []
        for g, row in enumerate(rows):
            loads = [i for i, src in enumerate(row, starts[g]) if type(src) is not int]
            fills = [bs] * len(loads) + (block_fills(slots - end * bs, bs) if total > end else [])
            new = iter(t.take(g, len(fills), rid, sid, fills))
            table: list = [None] * starts[g]
            for i, src in enumerate(row, starts[g]):
                if type(src) is int:
                    table.append(src)
                    continue
                table.append(next(new))
                src.pending += 1
                src.stats.hit_blocks += 1
                src.keys.move_to_end(chain[i][1])
                if self.log is not None:
                    self.log.load(src, chain[i][1], g, table[-1])
                deepest[i] = max(deepest[i], found[i][0])
            table.extend(new)
            tables.append(table)
        # The GPU's own hit ends at `hit`: every block after it is the tiers' hit, a block whose pages all
        # stayed on the GPU too (a sliding group needs pages only near the end, which a tier supplied); it
        # counts for the deepest tier the extension loaded from.
        fallback = max(deepest[hit:end], default=-1)
        for i in range(hit, end):
            tier = deepest[i] if deepest[i] >= 0 else fallback
            if tier < 0:
                stats.prefix_hits += 1
                stats.prefix_hit_tokens += bs
            else:
                self.tiers[tier].stats.hit_tokens += bs
        t.hold(seq, tables, starts, slots, end * bs)
        t.chains[sid] = chain
        t.publish_range(seq, hit, min(n, end * bs + budget) // bs)
        return end * bs

    def flush(self) -> None:
        """Store the pages handed down since the last call, in order; forget the range of each page the
        GPU no longer publishes."""
        queue, ranges = self.queue, self.ranges
        if queue:
            batch = [(ranges[gh], g, key[1], key[2]) for gh, (g, key) in queue]
            if not self.eager:
                self._forget(queue)
            queue.clear()  # (the pool appends to this very list)
            if self.tiers:
                for h, g, content, extra in batch:
                    self._store(h, content, extra, 1 << g)
                    if self.log is not None:
                        self.log.stored(h, g)
        if self.evicted:
            self._forget(self.evicted)
            self.evicted.clear()

    def _forget(self, pairs: list[tuple[int, tuple]]) -> None:
        cached, ranges = self.tables.pool.cached, self.ranges
        for gh, _ in pairs:
            if gh not in cached:  # not published again since
                ranges.pop(gh, None)

    def _store(self, h: int, content: object, extra: object, mask: int) -> None:
        top = self.tiers[0]
        e = top.keys.get(h)
        if e is not None and e[0] == content and e[1] == extra:
            new = mask & ~e[2]
            if new:
                e[2] |= new
                top.used += new.bit_count()
                top.stats.stored_blocks += new.bit_count()
            top.keys.move_to_end(h)
        else:
            if e is not None:  # a colliding range: the newer content wins
                top.used -= top.keys.pop(h)[2].bit_count()
            for lower in top.below:  # an entry lives in one tier: the lower one's pages come up with it
                le = lower.keys.pop(h, None)
                if le is not None:
                    lower.used -= le[2].bit_count()
                    if le[0] == content and le[1] == extra:
                        mask |= le[2]
            top.keys[h] = [content, extra, mask]
            top.used += mask.bit_count()
            top.stats.stored_blocks += mask.bit_count()
        self._trim(top)

    def _trim(self, tier: GroupTier) -> None:
        """Evict `tier`'s entries (in its policy's order) until its pages fit; they go one tier down (or
        are dropped)."""
        if tier is self.cpu:
            tier.capacity = max(0, tier.spec.num_blocks - self.swap_used())
        keys = tier.keys
        while tier.used > tier.capacity:
            h, e = keys.popitem(last=False)
            pages = e[2].bit_count()
            tier.used -= pages
            tier.stats.evicted_blocks += pages
            if tier.below:
                lower = tier.below[0]
                lower.keys[h] = e
                lower.used += pages
                lower.stats.stored_blocks += pages
                self._trim(lower)

    def fit(self) -> None:
        """Shrink or grow the CPU tier to the budget that swapped-out blocks leave it."""
        self.flush()
        if self.cpu is not None:
            self._trim(self.cpu)

    def take_load_seconds(self, load_time: Callable[[float, float, float], float]) -> float:
        """Seconds the pages loaded since the last call take, from the latency model's `load_time`
        (tokens, bandwidth, latency), a page counted as the tokens of its bytes."""
        self.flush()
        return take_load_seconds(self.tiers, self.tokens_per_page, load_time)

    def summary(self, query_tokens: int, gpu_hit_tokens: int) -> dict:
        """Prompt tokens by source (computed, GPU hit, each tier's hit) and each tier's counters (pages)."""
        self.flush()
        return tier_summary(self.tiers, self.store_mode, query_tokens, gpu_hit_tokens)


def attach_groups(bm, tiers: GroupTiers) -> None:
    """Put `tiers` behind a GroupedBlockManager's pool: they take the pages it lets go (evicted, or
    released when storing eagerly) and extend prompts' hits; swapping uses the CPU tier's budget."""
    # The tables reach the tiers through a proxy (the manager holds them): a cycle would keep a run's pool
    # and tiers alive until the cyclic collector runs, instead of freeing them with the run.
    bm.tiers = tiers
    bm.tables.tiers = weakref.proxy(tiers)
    tiers.swap_used = swap_counter(bm.swap)
    if tiers.eager:
        bm.pool.on_release = pairs_into(tiers.queue)
        bm.pool.on_evict = pairs_into(tiers.evicted)
    else:
        bm.pool.on_evict = pairs_into(tiers.queue)

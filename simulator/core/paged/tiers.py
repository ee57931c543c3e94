"""KV tiers below the GPU: a CPU tier and a disk tier that keep prefix blocks the GPU pool let go.

As vLLM's offloading connector (and LMCache, SGLang's HiCache), a tier holds the content of published
blocks under their chained content hash. Blocks enter the CPU tier when the GPU evicts them (`lazy`) or
when the sequence holding them releases them (`eager`, on finish or preemption); the CPU tier's evictions
go down to the disk tier, the disk tier's are dropped. A block is in at most one of the two tiers (a
block stored into the CPU tier leaves the disk tier). When a prompt's leading run of GPU prefix hits ends,
the run goes on in the tiers: each following block found in the CPU or the disk tier is loaded into a new
GPU block instead of being computed; the step that loads it pays each tier's latency plus the bytes over
its bandwidth (`load_seconds`, charged by simulator/loop/step.py).

A tier's block may hold several GPU blocks (its block size a multiple of the GPU's, as the connector's
`block_size`): a tier hit then counts whole tier blocks, aligned from the prompt's start. Content is kept
per GPU block either way, so the capacity is the tier's bytes over the GPU block's bytes.

Swap preemption uses the CPU tier's budget: the blocks swapped out are taken from it, and the cache keeps
what is left (`fit`).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from itertools import groupby, islice, repeat
from operator import itemgetter

from simulator.core.paged.prefix_cache import ROOT_HASH
from simulator.core.paged.tier import (
    BLOCK_HASH,
    Tier,
    TierSpec,
    check_tiers,
    take_load_seconds,
    tier_summary,
)

_TIER, _FOUND_HASH = itemgetter(0), itemgetter(1)  # of `match`'s (tier, hash, key)


class Tiers:
    """The CPU tier and the disk tier behind one GPU block pool (either may be absent)."""

    def __init__(self, specs: list[TierSpec], store: str, block_size: int, bytes_per_token: int,
                 swap_used: Callable[[], int] = lambda: 0) -> None:
        check_tiers(specs, store)
        self.tiers = [Tier(s) for s in specs]
        for i, tier in enumerate(self.tiers):
            tier.below = self.tiers[i + 1:]
        self.store_mode = store
        self.eager = store == "eager"
        self.block_size = block_size
        self.block_bytes = block_size * bytes_per_token
        self.swap_used = swap_used
        self.queue: list[tuple[int, tuple]] = []  # (hash, key) of blocks handed down, not yet stored
        self.cpu = next((t for t in self.tiers if t.spec.name == "cpu"), None)
        self.top = self.tiers[0] if self.tiers else None
        self.log = None  # a tier_log.TierLog when a driver keeps the blocks' data (the engine)

    # ----------------------------------------------------------------- queries
    def find(self, h: int, content: object, extra: object) -> Tier | None:
        """The tier holding the block of hash `h` with this content, if any. The hash chains the whole
        prefix; comparing the block's own content too guards against collisions without walking the chain
        of parent keys (thousands deep for a long prompt)."""
        for tier in self.tiers:
            held = tier.keys.get(h)
            if held is not None and held[1] == content and held[2] == extra:
                return tier
        return None

    def match(self, seq, start: int, parent_hash: int,
              hash_fn: Callable[[object], int]) -> list[tuple[Tier, int, tuple]]:
        """The blocks from index `start` of `seq` found in the tiers, as a leading run of (tier, hash,
        key), cut to whole tier blocks; nothing is loaded yet."""
        self.flush()
        found: list[tuple[Tier, int, tuple]] = []
        bs, tiers, extra = self.block_size, self.tiers, seq.extra_key
        end = (seq.length - 1) // bs
        # A simulated prompt's content keys are its prefix keys: `block_content`, inlined, past them none.
        prefix = seq.prefix_keys if seq.token_ids is None else None
        if prefix is not None:
            end = min(end, len(prefix))
        for i in range(start, end):
            content = prefix[i] if prefix is not None else seq.block_content(i, bs)
            if content is None:
                break
            h = hash_fn((parent_hash, content, extra))
            for tier in tiers:  # `find`, inlined: this runs for every block a prompt could load
                held = tier.keys.get(h)
                if held is not None and held[1] == content and held[2] == extra:
                    break
            else:
                break
            found.append((tier, h, held))
            parent_hash = h
        # A tier block is hit only as a whole: drop the blocks past the last complete one of each tier.
        while found:
            tier = found[-1][0]
            k = tier.spec.blocks_per_tier_block
            end = start + len(found)
            if end % k == 0:
                break
            del found[-(end % k):]
        return found

    # ----------------------------------------------------------------- mutations
    def load(self, found: list[tuple[Tier, int, tuple]]) -> None:
        """Count the blocks of `match` as loaded into the GPU (they stay in their tier, touched)."""
        if self.log is not None:
            self.log.loading(found)
        for tier, run in groupby(found, key=_TIER):  # runs of one tier: touched in order, counted at once
            hashes = list(map(_FOUND_HASH, run))
            if tier.lru:
                deque(map(tier.keys.move_to_end, hashes), maxlen=0)
            else:
                for h in hashes:
                    tier.cache.admit(h)
            tier.pending += len(hashes)
            tier.stats.hit_blocks += len(hashes)
            tier.stats.hit_tokens += len(hashes) * self.block_size

    def store(self, h: int, key: tuple) -> None:
        """Keep a block's content in the top tier (queued: applied, in order, before the next query).

        A store costs no step time: vLLM's offloading connector copies blocks out on its own CUDA stream,
        overlapping compute, and PCIe is full duplex, so GPU -> CPU copies take no bandwidth from the
        CPU -> GPU loads that are charged; the disk tier is written from CPU memory, off the GPU's path."""
        self.queue.append((h, key))

    def flush(self) -> None:
        """Apply the queued stores: the top tier takes them, what it evicts goes one tier down."""
        if self.queue and self.top is not None:
            # A tier keeps the pool's own key tuple, not a copy of its (content, extra key): allocating a
            # tuple per block dominated the cost of storing. The parent keys it chains stay alive with it,
            # which costs no collector pass in the loop (simulate runs with the cyclic collector off) and
            # one pass elsewhere (tuples of untracked items leave the collector's lists).
            queue = self.queue
            batch = queue[:]
            queue.clear()
            self._store_many(batch, self.top)

    def _store_many(self, pairs: list[tuple[int, tuple]], tier: Tier) -> None:
        """Store `pairs` in `tier` with what one pair at a time would give (the batch is only faster)."""
        if len(pairs) > 1 and (not tier.lru or self._order_matters(pairs, tier)):
            for pair in pairs:
                self._store_many([pair], tier)
            return
        if tier is self.cpu and tier.cache.capacity != tier.spec.num_blocks:
            self._fit()  # swapped blocks came back since the budget last shrank: the cache may grow
        log = self.log
        if log is not None:
            log.entering(tier, pairs)
        for other in tier.below:  # a block lives in one tier at a time
            held = other.keys
            if not held:
                continue
            if other.lru:
                # One C-level pop per hash (absent ones pass): an LRU tier's OrderedDict keeps the same
                # order whichever key leaves first, and a discard counts nothing.
                deque(map(held.pop, map(BLOCK_HASH, pairs), repeat(None)), maxlen=0)
            else:
                for h in [h for h, _ in pairs if h in held]:
                    other.discard(h)
        evicted = tier.put_batch(pairs) if tier.lru else tier.put_many(pairs)
        if evicted:
            self._spill(tier, evicted)
        if log is not None:
            log.entered(tier)

    @staticmethod
    def _order_matters(pairs: list[tuple[int, tuple]], tier: Tier) -> bool:
        """Whether storing the batch at once could differ from one pair at a time: a hash that repeats (one
        at a time, it may spill down between its turns and be taken back up); a block the tier holds among
        the oldest that make room (one at a time, it spills down before its turn and comes back up); or a
        block of the batch that a lower tier holds and that could leave it before its own turn (one at a
        time, the blocks stored before it spill down and evict that tier's oldest, at most one per pair,
        where a batch takes its blocks out of the lower tiers first; other policies evict in no order a
        position can bound)."""
        hashes = set(map(BLOCK_HASH, pairs))
        if tier.batch_differs(hashes, len(pairs)):
            return True
        for other in tier.below:
            if not other.keys:
                continue
            if not other.lru:
                if not hashes.isdisjoint(other.keys):
                    return True
            elif not hashes.isdisjoint(islice(other.keys, len(pairs))):
                return True
        return False

    def _spill(self, tier: Tier, evicted: list[tuple[int, tuple]]) -> None:
        """Hand `tier`'s evicted blocks to the tier below it (or drop them)."""
        tier.stats.evicted_blocks += len(evicted)
        if self.log is not None:
            self.log.spilling(tier, evicted)
        if tier.below:
            self._store_many(evicted, tier.below[0])

    def fit(self) -> None:
        """Shrink or grow the CPU tier's cache to the budget that swapped-out blocks leave it."""
        self.flush()
        self._fit()

    def _fit(self) -> None:
        cpu = self.cpu
        if cpu is None:
            return
        room = max(0, cpu.spec.num_blocks - self.swap_used())
        if cpu.cache.capacity != room:
            evicted = cpu.resize(room)
            if evicted:
                self._spill(cpu, evicted)

    def take_load_seconds(self, load_time: Callable[[int, float, float], float]) -> float:
        """Seconds the blocks loaded since the last call take, from the latency model's `load_time`
        (tokens, bandwidth, latency) of each tier that loaded any."""
        self.flush()
        return take_load_seconds(self.tiers, self.block_size, load_time)

    def summary(self, query_tokens: int, gpu_hit_tokens: int) -> dict:
        """Prompt tokens by source (computed, GPU hit, each tier's hit) and each tier's counters."""
        self.flush()
        return tier_summary(self.tiers, self.store_mode, query_tokens, gpu_hit_tokens)



def attach(bm, tiers: Tiers) -> None:
    """Put `tiers` behind a BlockManager's pool: they take the published blocks it lets go (evicted, or
    released when storing eagerly) and extend prompts' prefix hits; swapping uses the CPU tier's budget."""
    bm.tiers = tiers
    swap = bm.swap
    tiers.swap_used = lambda: swap.num_blocks - len(swap.free)
    if tiers.eager:
        bm.pool.on_release = tiers.queue.append
    else:
        bm.pool.on_evict = tiers.queue.append


def tier_hits(bm, seq, hits: list[int]) -> list:
    """The blocks after a sequence's GPU hits that the tiers hold (a leading run), counted as loaded."""
    if not bm.enable_prefix_caching:
        return []
    pool = bm.pool
    parent = hits[-1] if hits else None
    found = bm.tiers.match(seq, len(hits), ROOT_HASH if parent is None else pool.hash[parent],
                           bm.prefix_cache.hash_fn)
    bm.tiers.load(found)
    return found

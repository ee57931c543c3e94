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

from collections.abc import Callable
from itertools import groupby
from operator import itemgetter

from simulator.core.paged.prefix_cache import ROOT_HASH
from simulator.core.paged.tier import (
    PolicyTiers,
    TierSpec,
    check_tiers,
    queue_into,
    swap_counter,
    take_load_seconds,
    tier_summary,
)
from simulator.core.paged.tier_lru import NumberedLRU

_TIER, _FOUND_HASH, _FOUND_KEY = itemgetter(0), itemgetter(1), itemgetter(2)  # of `match`'s (tier, hash, key)


class Tiers:
    """The CPU tier and the disk tier behind one GPU block pool (either may be absent)."""

    def __init__(self, specs: list[TierSpec], store: str, block_size: int, bytes_per_token: int,
                 swap_used: Callable[[], int] = lambda: 0) -> None:
        check_tiers(specs, store)
        # An all-LRU stack (the default policy) is kept as numbered entries (tier_lru.py), others block by
        # block (tier.PolicyTiers: the rules the numbered stack is tested against).
        lru = bool(specs) and all(s.policy == "lru" for s in specs)
        self.stack: NumberedLRU | PolicyTiers = NumberedLRU(specs) if lru else PolicyTiers(specs)
        self.tiers = self.stack.tiers
        self.store_mode = store
        self.eager = store == "eager"
        self.block_size = block_size
        self.block_bytes = block_size * bytes_per_token
        self.swap_used = swap_used
        # hashes and keys of the blocks handed down (`hand`, the pool's hook), not yet stored
        self.queued_hashes: list[int] = []
        self.queued_keys: list[tuple] = []
        self.hand = queue_into(self.queued_hashes, self.queued_keys)
        self.cpu = next((t for t in self.tiers if t.spec.name == "cpu"), None)
        self.top = self.tiers[0] if self.tiers else None

    @property
    def log(self):
        """The tier_log.TierLog a driver that keeps the blocks' data attached (the engine), or None."""
        return self.stack.log

    @log.setter
    def log(self, log) -> None:
        self.stack.log = log

    # ----------------------------------------------------------------- queries
    def match(self, seq, start: int, parent_hash: int, hash_fn: Callable[[object], int]) -> list[tuple]:
        """The blocks from index `start` of `seq` found in the tiers, as a leading run of (tier, hash,
        key), cut to whole tier blocks; nothing is loaded yet."""
        self.flush()
        found: list[tuple] = []
        bs, extra, lookup = self.block_size, seq.extra_key, self.stack.lookup
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
            # The hash chains the whole prefix; comparing the block's own content too guards against
            # collisions without walking the chain of parent keys (thousands deep for a long prompt).
            held = lookup(h, content)
            if held is None or held[1][1] != content or held[1][2] != extra:
                break
            found.append((held[0], h, held[1]))
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
    def load(self, found: list[tuple]) -> None:
        """Count the blocks of `match` as loaded into the GPU (they stay in their tier, touched)."""
        if self.log is not None:
            self.log.loading(found)
        for tier, run in groupby(found, key=_TIER):  # runs of one tier: touched in order, counted at once
            run = list(run)
            hashes = list(map(_FOUND_HASH, run))
            self.stack.touch(self.tiers.index(tier), hashes, list(map(_FOUND_KEY, run)))
            tier.pending += len(hashes)
            tier.stats.hit_blocks += len(hashes)
            tier.stats.hit_tokens += len(hashes) * self.block_size

    def flush(self) -> None:
        """Apply the stores queued since the last call (the pool hands blocks to `hand`): the top tier takes
        them in order, what it evicts goes one tier down.

        A store costs no step time: vLLM's offloading connector copies blocks out on its own CUDA stream,
        overlapping compute, and PCIe is full duplex, so GPU -> CPU copies take no bandwidth from the
        CPU -> GPU loads that are charged; the disk tier is written from CPU memory, off the GPU's path."""
        if self.queued_hashes and self.top is not None:
            # A tier keeps the pool's own key tuple, not a copy of its (content, extra key): allocating a
            # tuple per block dominated the cost of storing. The parent keys it chains stay alive with it,
            # which costs no collector pass in the loop (simulate runs with the cyclic collector off) and
            # one pass elsewhere (tuples of untracked items leave the collector's lists).
            hashes, keys = self.queued_hashes[:], self.queued_keys[:]
            self.queued_hashes.clear()  # (the hook extends these very lists)
            self.queued_keys.clear()
            if self.cpu is not None and self.cpu.capacity != self.cpu.spec.num_blocks:
                self._fit()  # swapped blocks came back since the budget last shrank: the cache may grow
            self.stack.store(hashes, keys)

    def fit(self) -> None:
        """Shrink or grow the CPU tier's cache to the budget that swapped-out blocks leave it."""
        self.flush()
        self._fit()

    def _fit(self) -> None:
        cpu = self.cpu
        if cpu is None:
            return
        room = max(0, cpu.spec.num_blocks - self.swap_used())
        if cpu.capacity != room:
            self.stack.resize(self.tiers.index(cpu), room)

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
    tiers.swap_used = swap_counter(bm.swap)
    if tiers.eager:
        bm.pool.on_release = tiers.hand
    else:
        bm.pool.on_evict = tiers.hand


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

"""KV tiers below the GPU, block by block: a tier's spec and counters, a tier that keeps its keys by content
hash under a pagelab.eviction policy (`Tier`), the stack of such tiers (`PolicyTiers`, any policy), and
the functions a stack of tiers reports through (also kv_group_tiers.py's). A stack that is all LRU is
kept by tier_lru.NumberedLRU instead, which follows the same rules at the cost of ranges of blocks.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from operator import itemgetter

from pagelab.eviction import EvictionPolicy, make_policy
from simulator.core.errors import ConfigError

STORE_MODES = ("lazy", "eager")
# A tier sees every block the GPU lets go (millions in a long trace): batch operations run these getters
# of a (hash, key) pair through map() so the per-block work stays in C.
BLOCK_HASH, BLOCK_KEY = itemgetter(0), itemgetter(1)


@dataclass(frozen=True)
class TierSpec:
    """One tier: how many GPU blocks it holds, its block in GPU blocks, its policy, how fast it loads."""

    name: str  # cpu | disk
    num_blocks: int  # capacity in GPU blocks
    blocks_per_tier_block: int = 1
    policy: str = "lru"
    bandwidth: float = 25e9  # bytes/s, tier -> GPU
    latency_s: float = 1e-5  # per load that touches the tier in a step


@dataclass
class TierStats:
    """Counters of one tier, in GPU blocks and tokens."""

    stored_blocks: int = 0
    hit_blocks: int = 0  # pages loaded from the tier, re-admitted requests' included
    hit_tokens: int = 0  # prompt tokens loaded from the tier instead of computed
    preempted_hit_tokens: int = 0  # the same for re-admitted requests (not in `hit_tokens`)
    evicted_blocks: int = 0  # left the tier for want of room (to the tier below, or dropped)
    load_seconds: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        """The counters as a plain dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Tier:
    """A tier kept block by block: its keys by content hash and a pagelab.eviction policy over them (the
    tiers of a stack that is all LRU live in tier_lru.py instead, numbered)."""

    lru = False

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.keys: dict[int, tuple] = {}  # hash -> the pool's key
        self.cache: EvictionPolicy = make_policy(spec.policy, spec.num_blocks)
        self.stats = TierStats()
        self.pending = 0  # blocks loaded from this tier since the step time last took them
        self.below: list = []  # the tiers under this one, nearest first

    @property
    def used(self) -> int:
        """Blocks held."""
        return len(self.keys)

    @property
    def capacity(self) -> int:
        """Blocks it may hold now."""
        return self.cache.capacity

    def holds(self, h: int, key: tuple) -> bool:
        """Whether this tier holds the block with hash `h` (and the pool's key `key`)."""
        return h in self.keys

    def put(self, h: int, key: tuple) -> list[tuple[int, tuple]]:
        """Store (or refresh) a block; the (hash, key) pairs evicted to make room."""
        keys = self.keys
        if h not in keys:
            self.stats.stored_blocks += 1
        keys[h] = key
        return [(v, keys.pop(v)) for v in self.cache.admit(h)]

    def touch(self, h: int) -> None:
        """A block of this tier was used again."""
        self.cache.admit(h)

    def discard(self, h: int) -> None:
        """Drop a block without counting an eviction."""
        del self.keys[h]
        self.cache.remove(h)

    def resize(self, capacity: int) -> list[tuple[int, tuple]]:
        """Take a new capacity; the (hash, key) pairs evicted to fit it."""
        return [(v, self.keys.pop(v)) for v in self.cache.resize(capacity)]


class PolicyTiers:
    """A stack of tiers kept block by block, any policy: each stored block leaves the lower tiers (a block
    lives in one tier), its tier takes it, and what that evicts goes one tier down before the next block
    comes. tier_lru.NumberedLRU keeps the same rules for LRU at the cost of ranges, not blocks."""

    def __init__(self, specs: list[TierSpec]) -> None:
        self.tiers = [Tier(s) for s in specs]
        for i, tier in enumerate(self.tiers):
            tier.below = self.tiers[i + 1:]
        self.log = None  # a tier_log.TierLog when a driver keeps the blocks' data

    def lookup(self, h: int, content: object) -> tuple | None:
        """(tier, key) of the block stored under hash `h`, if any tier holds it (`content`, its content
        key, is what tier_lru.NumberedLRU indexes by)."""
        for tier in self.tiers:
            key = tier.keys.get(h)
            if key is not None:
                return tier, key
        return None

    def store(self, hashes: list[int], keys: list[tuple], i: int = 0) -> None:
        """Store blocks (`hashes` and `keys`) into tier `i`, in order, one at a time."""
        tier, log = self.tiers[i], self.log
        for h, key in zip(hashes, keys, strict=True):
            if log is not None:
                log.entering(tier, [(h, key)])
            for other in tier.below:
                if h in other.keys:
                    other.discard(h)
            evicted = tier.put(h, key)
            if evicted:
                self._spill(i, evicted)
            if log is not None:
                log.entered(tier)

    def touch(self, i: int, hashes: list[int], keys: list[tuple]) -> None:
        """Blocks of tier `i` were used again, in this order (`keys` as for tier_lru.NumberedLRU)."""
        for h in hashes:
            self.tiers[i].touch(h)

    def resize(self, i: int, capacity: int) -> None:
        """Give tier `i` a new capacity; what it evicts goes one tier down."""
        evicted = self.tiers[i].resize(capacity)
        if evicted:
            self._spill(i, evicted)

    def _spill(self, i: int, evicted: list[tuple[int, tuple]]) -> None:
        tier = self.tiers[i]
        tier.stats.evicted_blocks += len(evicted)
        if self.log is not None:
            self.log.spilling(tier, evicted)
        if tier.below:
            self.store(list(map(BLOCK_HASH, evicted)), list(map(BLOCK_KEY, evicted)), i + 1)


def queue_into(hashes: list[int], keys: list[tuple]) -> Callable[[list[int], list[tuple]], None]:
    """A pool hook (BlockPool.on_evict / on_release) queueing what it is handed onto `hashes` and `keys`. It
    holds the two lists only: a hook bound to the tiers would make a cycle with the pool, keeping a run's
    pool and tiers alive until the cyclic collector runs."""

    def hand(handed_hashes: list[int], handed_keys: list[tuple]) -> None:
        hashes.extend(handed_hashes)
        keys.extend(handed_keys)

    return hand


def pairs_into(out: list) -> Callable[[list[int], list[tuple]], None]:
    """A pool hook queueing what it is handed onto `out` as (hash, key) pairs (holding `out` only)."""

    def hand(hashes: list[int], keys: list[tuple]) -> None:
        out.extend(zip(hashes, keys, strict=True))

    return hand


def check_tiers(specs: list[TierSpec], store: str) -> None:
    """Refuse a store mode or a tier whose capacity, block, bandwidth or latency cannot be."""
    if store not in STORE_MODES:
        raise ConfigError(f"offload store mode must be one of {', '.join(STORE_MODES)}, got {store!r}")
    for spec in specs:
        if spec.num_blocks < 0 or spec.blocks_per_tier_block < 1:
            raise ConfigError(f"{spec.name} tier: capacity must be >= 0 blocks and its block >= 1 GPU "
                              f"block (got {spec.num_blocks}, {spec.blocks_per_tier_block})")
        if not (spec.bandwidth > 0 and spec.latency_s >= 0):
            raise ConfigError(f"{spec.name} tier: bandwidth must be > 0 and latency >= 0")



def swap_counter(swap) -> Callable[[], int]:
    """Blocks a swap space (swap.SwapSpace, kv_group_swap.GroupSwap) holds now, as the CPU tier's budget
    reads them. The closure keeps the swap space's free list, not the swap space, which may lead back to
    the tiers (the grouped one holds the tables that hold them): a cycle would keep a run's pool and
    tiers alive after it ends."""
    free, num_blocks = swap.free, swap.num_blocks
    return lambda: num_blocks - len(free)


def take_load_seconds(tiers: list, tokens_per_unit: float, load_time: Callable) -> float:
    """Seconds the units (blocks or pages) each tier loaded since the last call take, reset to none."""
    total = 0.0
    for tier in tiers:
        if tier.pending:
            dt = load_time(tier.pending * tokens_per_unit, tier.spec.bandwidth, tier.spec.latency_s)
            tier.stats.load_seconds += dt
            total += dt
            tier.pending = 0
    return total


def tier_summary(tiers: list, store_mode: str, query_tokens: int, gpu_hit_tokens: int) -> dict:
    """Prompt tokens by source (computed, GPU hit, each tier's hit) and each tier's counters."""
    out: dict = {"tokens_by_source": {"computed": query_tokens - gpu_hit_tokens
                                      - sum(t.stats.hit_tokens for t in tiers),
                                      "gpu_hit": gpu_hit_tokens}}
    for tier in tiers:
        out["tokens_by_source"][f"{tier.spec.name}_hit"] = tier.stats.hit_tokens
        out[tier.spec.name] = {"capacity_blocks": tier.spec.num_blocks, "policy": tier.spec.policy,
                               "blocks": tier.used, **tier.stats.as_dict()}
    out["store"] = store_mode
    return out


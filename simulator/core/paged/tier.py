"""One KV tier below the GPU (tiers.py stacks them behind a pool): its spec, counters and keys by content
hash, with the eviction policy over them (LRU on the keys' own order by default, or a pagelab.eviction
policy), and the functions a stack of tiers reports through (also kv_group_tiers.py's).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields
from itertools import islice, repeat
from operator import itemgetter

from pagelab.eviction import EvictionPolicy, make_policy
from simulator.core.errors import ConfigError

STORE_MODES = ("lazy", "eager")
# A tier sees every block the GPU lets go (millions in a long trace): batch operations run this getter of
# a (hash, key) pair through map() so the per-block work stays in C.
BLOCK_HASH = itemgetter(0)


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
    hit_blocks: int = 0
    hit_tokens: int = 0  # prompt tokens loaded from the tier instead of computed
    evicted_blocks: int = 0  # left the tier for want of room (to the tier below, or dropped)
    load_seconds: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        """The counters as a plain dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _KeyLRU:
    """LRU over a tier's own OrderedDict of keys (oldest first): the default policy without a second
    structure to keep in step, since every block stored into a tier below the GPU passes here."""

    name = "lru"

    def __init__(self, keys: OrderedDict, capacity: int) -> None:
        self.keys, self.capacity = keys, capacity

    @property
    def used(self) -> int:
        """Blocks held."""
        return len(self.keys)

    @property
    def size(self) -> OrderedDict:
        """The held blocks (each of size one)."""
        return self.keys


class Tier:
    """A tier's state: its keys by content hash, the eviction policy over them, counters."""

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.lru = spec.policy == "lru"
        self.keys: dict[int, tuple] = OrderedDict() if self.lru else {}  # hash -> the pool's key
        self.cache: EvictionPolicy | _KeyLRU = _KeyLRU(self.keys, spec.num_blocks) if self.lru \
            else make_policy(spec.policy, spec.num_blocks)
        self.stats = TierStats()
        self.pending = 0  # blocks loaded from this tier since the step time last took them
        self.below: list[Tier] = []  # the tiers under this one, nearest first

    @property
    def used(self) -> int:
        """Blocks held."""
        return len(self.keys)

    def put(self, h: int, key: tuple) -> list[tuple[int, tuple]]:
        """Store (or refresh) a block; the (hash, key) pairs evicted to make room."""
        keys = self.keys
        if h in keys:
            self.touch(h)
        else:
            self.stats.stored_blocks += 1
        keys[h] = key
        if not self.lru:
            return [(v, keys.pop(v)) for v in self.cache.admit(h)]
        cap = self.cache.capacity
        out = []
        while len(keys) > cap:
            out.append(keys.popitem(last=False))
        return out

    def put_many(self, pairs: list[tuple[int, tuple]]) -> list[tuple[int, tuple]]:
        """`put` each pair in order; every pair evicted on the way, as one `put` at a time gives them (for
        LRU at C speed, `put_batch`, when `batch_differs` finds that gives the same)."""
        if not self.lru or self.batch_differs(set(map(BLOCK_HASH, pairs)), len(pairs)):
            return [e for h, key in pairs for e in self.put(h, key)]
        return self.put_batch(pairs)

    def batch_differs(self, hashes: set, num_pairs: int) -> bool:
        """Whether storing a batch at once (`put_batch`) could differ from one `put` at a time: a hash that
        repeats (it may leave before its second turn), or a block held among the oldest that make room
        (one at a time, it leaves before its turn and comes back as a new store). Only the oldest can
        leave: walking them against the batch costs far less than looking each hash up in a tier of a
        million (how many make room is bounded by taking none of the batch as held)."""
        if len(hashes) != num_pairs:
            return True
        over = len(self.keys) + num_pairs - self.cache.capacity
        return over > 0 and not hashes.isdisjoint(islice(self.keys, over))

    def put_batch(self, pairs: list[tuple[int, tuple]]) -> list[tuple[int, tuple]]:
        """Store an LRU batch that `batch_differs` cleared, at C speed; the (hash, key) pairs evicted."""
        keys = self.keys
        before = len(keys)
        keys.update(pairs)  # all new (the common case): appended in order
        if len(keys) - before != len(pairs):  # some were held: each goes to the end in order
            for h, _ in pairs:
                keys.move_to_end(h)
        self.stats.stored_blocks += len(keys) - before
        over = len(keys) - self.cache.capacity
        return list(map(keys.popitem, repeat(False, over))) if over > 0 else []

    def touch(self, h: int) -> None:
        """A block of this tier was used again."""
        if self.lru:
            self.keys.move_to_end(h)
        else:
            self.cache.admit(h)

    def discard(self, h: int) -> None:
        """Drop a block without counting an eviction."""
        del self.keys[h]
        if not self.lru:
            self.cache.remove(h)

    def resize(self, capacity: int) -> list[tuple[int, tuple]]:
        """Take a new capacity; the (hash, key) pairs evicted to fit it."""
        if not self.lru:
            return [(v, self.keys.pop(v)) for v in self.cache.resize(capacity)]
        self.cache.capacity = capacity
        out = []
        while len(self.keys) > capacity:
            out.append(self.keys.popitem(last=False))
        return out


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


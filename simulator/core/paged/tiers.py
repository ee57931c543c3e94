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
from dataclasses import dataclass, field, fields

from pagelab.eviction import EvictionPolicy, make_policy
from simulator.core.errors import ConfigError

STORE_MODES = ("lazy", "eager")


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


@dataclass
class Tier:
    """A tier's state: the eviction policy over content hashes, the keys stored under them."""

    spec: TierSpec
    cache: EvictionPolicy
    keys: dict[int, tuple] = field(default_factory=dict)  # content hash -> the block's full key
    stats: TierStats = field(default_factory=TierStats)
    pending: int = 0  # blocks loaded from this tier since the step time last took them


class Tiers:
    """The CPU tier and the disk tier behind one GPU block pool (either may be absent)."""

    def __init__(self, specs: list[TierSpec], store: str, block_size: int, bytes_per_token: int,
                 swap_used: Callable[[], int] = lambda: 0) -> None:
        if store not in STORE_MODES:
            raise ConfigError(f"offload store mode must be one of {', '.join(STORE_MODES)}, got {store!r}")
        for spec in specs:
            if spec.num_blocks < 0 or spec.blocks_per_tier_block < 1:
                raise ConfigError(f"{spec.name} tier: capacity must be >= 0 blocks and its block >= 1 GPU "
                                  f"block (got {spec.num_blocks}, {spec.blocks_per_tier_block})")
            if not (spec.bandwidth > 0 and spec.latency_s >= 0):
                raise ConfigError(f"{spec.name} tier: bandwidth must be > 0 and latency >= 0")
        self.tiers = [Tier(s, make_policy(s.policy, s.num_blocks)) for s in specs]
        self.store_mode = store
        self.eager = store == "eager"
        self.block_size = block_size
        self.block_bytes = block_size * bytes_per_token
        self.swap_used = swap_used
        self.cpu = next((t for t in self.tiers if t.spec.name == "cpu"), None)
        self.top = self.tiers[0] if self.tiers else None

    # ----------------------------------------------------------------- queries
    def find(self, h: int, content: object, extra: object) -> Tier | None:
        """The tier holding the block of hash `h` with this content, if any. The hash chains the whole
        prefix; comparing the block's own content too guards against collisions without walking the chain
        of parent keys (thousands deep for a long prompt)."""
        for tier in self.tiers:
            key = tier.keys.get(h)
            if key is not None and key[1] == content and key[2] == extra:
                return tier
        return None

    def match(self, seq, start: int, parent_hash: int | None,
              hash_fn: Callable[[object], int]) -> list[tuple[Tier, int, tuple]]:
        """The blocks from index `start` of `seq` found in the tiers, as a leading run of (tier, hash,
        key), cut to whole tier blocks; nothing is loaded yet."""
        found: list[tuple[Tier, int, tuple]] = []
        bs = self.block_size
        for i in range(start, (seq.length - 1) // bs):
            content = seq.block_content(i, bs)
            if content is None:
                break
            h = hash_fn((parent_hash, content, seq.extra_key))
            tier = self.find(h, content, seq.extra_key)
            if tier is None:
                break
            key = tier.keys[h]
            found.append((tier, h, key))
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
        for tier, h, _ in found:
            tier.cache.admit(h)
            tier.pending += 1
            tier.stats.hit_blocks += 1
            tier.stats.hit_tokens += self.block_size

    def store(self, h: int, key: tuple, tier: Tier | None = None) -> None:
        """Keep a block's content in `tier` (default: the top tier); what it evicts goes one tier down."""
        tier = tier or self.top
        if tier is None:
            return
        if tier is self.cpu:
            self.fit()
        below = self.tiers.index(tier) + 1
        for other in self.tiers[below:]:  # a block lives in one tier at a time
            if h in other.keys:
                other.cache.remove(h)
                del other.keys[h]
        if h not in tier.keys:
            tier.stats.stored_blocks += 1
        tier.keys[h] = key
        self._spill(tier, tier.cache.admit(h), below)

    def _spill(self, tier: Tier, evicted: list[int], below: int) -> None:
        """Hand `tier`'s evicted blocks to the tier below it (or drop them)."""
        if not evicted:
            return
        tier.stats.evicted_blocks += len(evicted)
        nxt = self.tiers[below] if below < len(self.tiers) else None
        for victim in evicted:
            key = tier.keys.pop(victim)
            if nxt is not None:
                self.store(victim, key, nxt)

    def fit(self) -> None:
        """Shrink or grow the CPU tier's cache to the budget that swapped-out blocks leave it."""
        cpu = self.cpu
        if cpu is None:
            return
        room = max(0, cpu.spec.num_blocks - self.swap_used())
        if cpu.cache.capacity != room:
            self._spill(cpu, cpu.cache.resize(room), self.tiers.index(cpu) + 1)

    def take_load_seconds(self, load_time: Callable[[int, float, float], float]) -> float:
        """Seconds the blocks loaded since the last call take, from the latency model's `load_time`
        (tokens, bandwidth, latency) of each tier that loaded any."""
        total = 0.0
        for tier in self.tiers:
            if tier.pending:
                dt = load_time(tier.pending * self.block_size, tier.spec.bandwidth, tier.spec.latency_s)
                tier.stats.load_seconds += dt
                total += dt
                tier.pending = 0
        return total

    def summary(self, query_tokens: int, gpu_hit_tokens: int) -> dict:
        """Prompt tokens by source (computed, GPU hit, each tier's hit) and each tier's counters."""
        out: dict = {"tokens_by_source": {"computed": query_tokens - gpu_hit_tokens
                                          - sum(t.stats.hit_tokens for t in self.tiers),
                                          "gpu_hit": gpu_hit_tokens}}
        for tier in self.tiers:
            out["tokens_by_source"][f"{tier.spec.name}_hit"] = tier.stats.hit_tokens
            out[tier.spec.name] = {"capacity_blocks": tier.spec.num_blocks, "policy": tier.spec.policy,
                                   "blocks": len(tier.keys), **tier.stats.as_dict()}
        out["store"] = self.store_mode
        return out


def attach(bm, tiers: Tiers) -> None:
    """Put `tiers` behind a BlockManager's pool: they take the published blocks it lets go (evicted, or
    released when storing eagerly) and extend prompts' prefix hits; swapping uses the CPU tier's budget."""
    bm.tiers = tiers
    swap = bm.swap
    tiers.swap_used = lambda: swap.num_blocks - len(swap.free)
    if tiers.eager:
        bm.pool.on_release = tiers.store
    else:
        bm.pool.on_evict = tiers.store


def tier_hits(bm, seq, hits: list[int]) -> list:
    """The blocks after a sequence's GPU hits that the tiers hold (a leading run), counted as loaded."""
    if not bm.enable_prefix_caching:
        return []
    pool = bm.pool
    parent = hits[-1] if hits else None
    found = bm.tiers.match(seq, len(hits), None if parent is None else pool.hash[parent],
                           bm.prefix_cache.hash_fn)
    bm.tiers.load(found)
    return found

"""The KV tiers a simulation configures: SimConfig's kv_offloading_* fields turned into tiers.Tiers."""
from __future__ import annotations

import math

from pagelab.eviction import POLICIES
from simulator.core.errors import ConfigError
from simulator.core.paged.kv_group_tiers import GroupTiers
from simulator.core.paged.tier import STORE_MODES, TierSpec
from simulator.core.paged.tiers import Tiers
from simulator.presets import GIB, get_gpu

TIER_FIELDS = ("kv_offloading_size", "kv_offloading_disk_size", "kv_offloading_block_size",
               "kv_offloading_policy", "kv_offloading_store", "cpu_offload_bandwidth_gbps",
               "disk_offload_bandwidth_gbps")
CPU_LATENCY_S = 1e-5  # one pinned-memory copy launched on a side stream
DISK_LATENCY_S = 1e-4  # one NVMe read


def tier_problems(config) -> list[str]:
    """What is wrong with the tier fields of a configuration (a tier's option is checked even where no
    tier is asked for: a typo should not wait for the run that adds one)."""
    out = []
    for name in ("kv_offloading_size", "kv_offloading_disk_size"):
        value = getattr(config, name)
        if value is not None and not (value >= 0 and math.isfinite(value)):
            out.append(f"{name} must be a finite number >= 0 GiB, got {value}")
    size = config.kv_offloading_block_size
    if size is not None and (size < config.block_size or size % config.block_size):
        out.append(f"kv_offloading_block_size must be a multiple of block_size {config.block_size}, "
                   f"got {size}")
    if config.kv_offloading_policy not in POLICIES:
        out.append(f"kv_offloading_policy must be one of {', '.join(POLICIES)}, "
                   f"got {config.kv_offloading_policy!r}")
    if config.kv_offloading_store not in STORE_MODES:
        out.append(f"kv_offloading_store must be one of {', '.join(STORE_MODES)}, "
                   f"got {config.kv_offloading_store!r}")
    for name in ("cpu_offload_bandwidth_gbps", "disk_offload_bandwidth_gbps"):
        value = getattr(config, name)
        if value is not None and not value > 0:
            out.append(f"{name} must be > 0 GB/s, got {value}")
    if config.has_tiers and config.allocator != "paged":
        out.append(f"KV tiers need the paged allocator, got {config.allocator!r}")
    if config.has_tiers and not config.enable_prefix_caching:
        out.append("KV tiers hold prefix blocks: they need prefix caching (enable_prefix_caching, "
                   "--prefix-caching), which is off")
    return out


def build_tiers(config) -> Tiers:
    """The configured tiers, sized in GPU blocks of the configuration's model and dtype."""
    specs = tier_specs(config, config.block_size, config.block_size * config.bytes_per_token)
    return Tiers(specs, config.kv_offloading_store, config.block_size, config.bytes_per_token)


def build_group_tiers(config, bm) -> GroupTiers:
    """The configured tiers behind a pool of several KV cache groups, sized in its blocks (one page each)."""
    layout = bm.layout
    if (config.kv_offloading_block_size or layout.block_size) % layout.block_size:
        raise ConfigError(f"kv_offloading_block_size must be a multiple of the pool's block of "
                          f"{layout.block_size} tokens, got {config.kv_offloading_block_size}")
    specs = tier_specs(config, layout.block_size, layout.block_bytes)
    return GroupTiers(specs, config.kv_offloading_store, bm.tables, layout.block_bytes,
                      config.bytes_per_token)


def tier_specs(config, block_size: int, block_bytes: int) -> list[TierSpec]:
    """The CPU and disk tiers configured, in GPU blocks of `block_bytes`."""
    per_tier = (config.kv_offloading_block_size or block_size) // block_size
    cpu_bw = config.cpu_offload_bandwidth_gbps
    specs = []
    if config.kv_offloading_size is not None:
        specs.append(TierSpec("cpu", int(config.kv_offloading_size * GIB // block_bytes), per_tier,
                              config.kv_offloading_policy,
                              get_gpu(config.gpu).pcie_bandwidth if cpu_bw is None else cpu_bw * 1e9,
                              CPU_LATENCY_S))
    if config.kv_offloading_disk_size is not None:
        specs.append(TierSpec("disk", int(config.kv_offloading_disk_size * GIB // block_bytes), per_tier,
                              config.kv_offloading_policy, config.disk_offload_bandwidth_gbps * 1e9,
                              DISK_LATENCY_S))
    return specs

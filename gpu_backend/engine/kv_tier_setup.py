"""The engine's KV tiers from its configuration: the simulator's tier options, sizing and checks, with
real data behind them (gpu_backend/kv_tiers.py; kv_group_tier_data.py for several KV cache groups)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from gpu_backend.engine.params import EngineInputError
from gpu_backend.kv_cache import KVCache
from gpu_backend.kv_group_tier_data import GroupTierData
from gpu_backend.kv_tiers import TierData
from simulator.core.errors import ConfigError
from simulator.core.paged.block_manager import BlockManager
from simulator.core.paged.kv_group_tier_log import GroupTierLog, attach_group_log
from simulator.core.paged.kv_group_tiers import attach_groups
from simulator.core.paged.kv_groups import GroupedBlockManager
from simulator.core.paged.tier_log import TierLog, attach_log
from simulator.core.paged.tiers import attach
from simulator.tier_config import TIER_FIELDS, build_group_tiers, build_tiers

# CUDA device name fragment -> the GPU preset whose PCIe bandwidth the CPU tier's load time uses by default.
GPU_PRESET_BY_NAME = {"H200": "h200", "H100": "h100-80gb", "A100": "a100-80gb"}


def gpu_preset(device: torch.device) -> str:
    """The GPU preset closest to `device` (for the tiers' default CPU bandwidth): "cpu" without CUDA."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    return next((p for frag, p in GPU_PRESET_BY_NAME.items() if frag in name), "a100-80gb")


def build_tier_data(config, allocator, cache: KVCache, bytes_per_token: int) -> TierData | None:
    """The configured tiers behind a paged `allocator` with their data; None without tiers. A size that
    holds no block, or a disk directory that cannot take the file, is an EngineInputError."""
    if not config.has_tiers:
        return None
    if type(allocator) not in (BlockManager, GroupedBlockManager):
        raise EngineInputError(f"KV tiers need the paged allocator, got {type(allocator).__name__}")
    try:
        return _build(config, allocator, cache, bytes_per_token)
    except ConfigError as exc:
        raise EngineInputError(str(exc)) from None


def _build(config, allocator, cache: KVCache, bytes_per_token: int) -> TierData:
    view = SimpleNamespace(**{name: getattr(config, name) for name in TIER_FIELDS},
                           block_size=config.block_size, bytes_per_token=bytes_per_token,
                           gpu=gpu_preset(cache.device))
    grouped = type(allocator) is GroupedBlockManager
    # A grouped pool's tier slot holds a page: one block of each of the pool's group_size tensors.
    tiers = build_group_tiers(view, allocator) if grouped else build_tiers(view)
    block_bytes = allocator.layout.block_bytes if grouped else config.block_size * bytes_per_token
    for tier in tiers.tiers:
        if tier.spec.num_blocks < 1:
            field = "kv_offloading_size" if tier.spec.name == "cpu" else "kv_offloading_disk_size"
            raise ConfigError(f"{field} {getattr(config, field)} GiB holds no KV block of "
                              f"{block_bytes} bytes")
    if grouped:
        attach_groups(allocator, tiers)
        group_log = GroupTierLog(tiers)
        attach_group_log(allocator, group_log)
        return GroupTierData(cache, tiers, group_log, config.kv_offloading_disk_path)
    attach(allocator, tiers)
    log = TierLog()
    attach_log(allocator, log)
    return TierData(cache, tiers, log, config.kv_offloading_disk_path)

"""Whole-block moves inside a pool (copy-on-write) and between pools (swap), with torch index ops."""
from __future__ import annotations

import torch

from gpu_backend.ops.checks import KernelInputError, block_mapping_tensor


def _check_ids(ids: torch.Tensor, num_blocks: int, what: str) -> None:
    """Block ids must address existing blocks."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise KernelInputError(f"{what} block id out of range [0, {num_blocks}): "
                               f"min {int(ids.min())}, max {int(ids.max())}")


def copy_blocks(k_caches: list, v_caches: list, block_mapping) -> None:
    """Copy-on-write: for every (src, dst) pair copy block src to block dst in every layer's K and V."""
    if len(k_caches) != len(v_caches):
        raise KernelInputError(f"copy_blocks got {len(k_caches)} K layers but {len(v_caches)} V layers")
    if not k_caches:
        return
    mapping = block_mapping_tensor(block_mapping, device=k_caches[0].device)
    if mapping.shape[0] == 0:
        return
    src, dst = mapping[:, 0], mapping[:, 1]
    _check_ids(mapping, k_caches[0].shape[0], "copy_blocks")
    if torch.unique(dst).numel() != dst.numel():
        raise KernelInputError("copy_blocks: a destination block appears twice in the mapping")
    for cache in (*k_caches, *v_caches):
        # index_select materializes all sources before any write, so src/dst overlaps are well defined.
        cache.index_copy_(0, dst, cache.index_select(0, src))


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping) -> None:
    """Copy blocks src -> dst between two pools that may live on different devices (device <-> CPU)."""
    if src_cache.shape[1:] != dst_cache.shape[1:] or src_cache.dtype != dst_cache.dtype:
        raise KernelInputError(
            f"swap_blocks pools differ: {tuple(src_cache.shape)} {src_cache.dtype} vs "
            f"{tuple(dst_cache.shape)} {dst_cache.dtype}")
    mapping = block_mapping_tensor(block_mapping)
    if mapping.shape[0] == 0:
        return
    _check_ids(mapping[:, 0], src_cache.shape[0], "swap_blocks source")
    _check_ids(mapping[:, 1], dst_cache.shape[0], "swap_blocks destination")
    src_ids = mapping[:, 0].to(src_cache.device)
    dst_ids = mapping[:, 1].to(dst_cache.device)
    staged = src_cache.index_select(0, src_ids)  # gathered on the source device
    to_device = src_cache.device.type == "cpu" and dst_cache.device.type != "cpu"
    if to_device and src_cache.is_pinned():
        # Host -> device from pinned memory runs as one asynchronous DMA ordered before index_copy_.
        staged = staged.pin_memory().to(dst_cache.device, non_blocking=True)
    else:
        # Device -> host stays blocking: the CPU index_copy_ below must see finished data.
        staged = staged.to(dst_cache.device)
    dst_cache.index_copy_(0, dst_ids, staged)

"""The KV pool of the engine: per-layer K and V tensors [num_blocks, block_size, num_kv_heads, head_dim]."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_backend.ops import copy_blocks, swap_blocks
from simulator.core.errors import ConfigError


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a torch dtype."""
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """KV bytes one token occupies across all layers: 2 (K and V) * layers * kv heads * head_dim * dtype."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes(dtype)


def num_blocks_for_bytes(kv_bytes: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype) -> int:
    """How many whole blocks fit in kv_bytes of memory."""
    return kv_bytes // (block_size * bytes_per_token(num_layers, num_kv_heads, head_dim, dtype))


class KVCache:
    """Per-layer paged K/V pools; block moves go through gpu_backend.ops.

    `layer_slots[l]` is the tensor layer l reads and writes (default: one tensor per layer). Several KV
    cache groups share the pool as vLLM v1 lays them out: a block belongs to one group at a time, so the
    i-th layer of every group can use tensor i, and the pool is group_size tensors instead of num_layers.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device="cpu", pin_memory: bool = False,
                 layer_slots: Sequence[int] | None = None):
        fields = (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                  ("num_kv_heads", num_kv_heads), ("head_dim", head_dim))
        for field, value in fields:
            if int(value) <= 0:
                raise ConfigError(f"KVCache {field} must be positive, got {value}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        # Pinning needs a CUDA runtime; without one a CPU pool is simply pageable.
        self.pinned = bool(pin_memory) and self.device.type == "cpu" and torch.cuda.is_available()
        slots = tuple(range(num_layers)) if layer_slots is None else tuple(int(s) for s in layer_slots)
        if len(slots) != num_layers or set(slots) != set(range(max(slots) + 1)):
            raise ConfigError(f"KVCache layer_slots must give each of {num_layers} layers a tensor, using "
                              f"every tensor 0..n-1, got {list(slots)}")
        self.layer_slots = slots
        self.num_tensors = max(slots) + 1
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_pools = [self._alloc(shape) for _ in range(self.num_tensors)]
        self.v_pools = [self._alloc(shape) for _ in range(self.num_tensors)]
        self.k = [self.k_pools[s] for s in slots]
        self.v = [self.v_pools[s] for s in slots]

    def _alloc(self, shape) -> torch.Tensor:
        """One zero-filled pool tensor (zeros keep stale-memory garbage out of debugging sessions)."""
        return torch.zeros(shape, dtype=self.dtype, device=self.device, pin_memory=self.pinned)

    @property
    def num_slots(self) -> int:
        """Token slots per layer."""
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        """Size of the whole pool (every tensor, K and V) in bytes."""
        per_token = bytes_per_token(self.num_tensors, self.num_kv_heads, self.head_dim, self.dtype)
        return self.num_slots * per_token

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer."""
        return self.k[index], self.v[index]

    def copy_blocks(self, mapping) -> None:
        """Copy-on-write: copy block src to dst for every (src, dst) pair in every layer."""
        copy_blocks(self.k_pools, self.v_pools, mapping)

    def _check_peer(self, other: KVCache) -> None:
        """Swap peers must have the same per-block geometry and dtype."""
        mine = (self.layer_slots, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)
        theirs = (other.layer_slots, other.block_size, other.num_kv_heads, other.head_dim, other.dtype)
        if mine != theirs:
            raise ConfigError(f"KVCache swap peers differ: (layer_slots, block_size, kv_heads, head_dim, "
                              f"dtype) {mine} vs {theirs}")

    def swap_out(self, other: KVCache, mapping) -> None:
        """Copy blocks of this pool to `other` (the CPU pool); mapping is (self_block, other_block)."""
        self._check_peer(other)
        for i in range(self.num_tensors):
            swap_blocks(self.k_pools[i], other.k_pools[i], mapping)
            swap_blocks(self.v_pools[i], other.v_pools[i], mapping)

    def swap_in(self, other: KVCache, mapping) -> None:
        """Copy blocks of `other` into this pool; mapping is (other_block, self_block)."""
        self._check_peer(other)
        for i in range(self.num_tensors):
            swap_blocks(other.k_pools[i], self.k_pools[i], mapping)
            swap_blocks(other.v_pools[i], self.v_pools[i], mapping)

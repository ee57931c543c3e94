"""The KV pool of the engine: per-layer K and V tensors [num_blocks, block_size, num_kv_heads, head_dim]."""
from __future__ import annotations

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
    """Per-layer paged K/V pools; block moves go through gpu_backend.ops."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device="cpu", pin_memory: bool = False):
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
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [self._alloc(shape) for _ in range(num_layers)]
        self.v = [self._alloc(shape) for _ in range(num_layers)]

    def _alloc(self, shape) -> torch.Tensor:
        """One zero-filled pool tensor (zeros keep stale-memory garbage out of debugging sessions)."""
        return torch.zeros(shape, dtype=self.dtype, device=self.device, pin_memory=self.pinned)

    @property
    def num_slots(self) -> int:
        """Token slots per layer."""
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        """Size of the whole pool (all layers, K and V) in bytes."""
        return self.num_slots * bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer."""
        return self.k[index], self.v[index]

    def copy_blocks(self, mapping) -> None:
        """Copy-on-write: copy block src to dst for every (src, dst) pair in every layer."""
        copy_blocks(self.k, self.v, mapping)

    def _check_peer(self, other: KVCache) -> None:
        """Swap peers must have the same per-block geometry and dtype."""
        mine = (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)
        theirs = (other.num_layers, other.block_size, other.num_kv_heads, other.head_dim, other.dtype)
        if mine != theirs:
            raise ConfigError(f"KVCache swap peers differ: (layers, block_size, kv_heads, head_dim, dtype) "
                              f"{mine} vs {theirs}")

    def swap_out(self, other: KVCache, mapping) -> None:
        """Copy blocks of this pool to `other` (the CPU pool); mapping is (self_block, other_block)."""
        self._check_peer(other)
        for layer in range(self.num_layers):
            swap_blocks(self.k[layer], other.k[layer], mapping)
            swap_blocks(self.v[layer], other.v[layer], mapping)

    def swap_in(self, other: KVCache, mapping) -> None:
        """Copy blocks of `other` into this pool; mapping is (other_block, self_block)."""
        self._check_peer(other)
        for layer in range(self.num_layers):
            swap_blocks(other.k[layer], self.k[layer], mapping)
            swap_blocks(other.v[layer], self.v[layer], mapping)

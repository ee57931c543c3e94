"""The engine's KV memory: the device pool, the CPU swap pool, and how allocator instructions map onto them.

Paged: a KVCache of `num_blocks` blocks; a sequence's block table is the BlockManager's (with several KV
cache groups, the GroupedBlockManager's table of each group: engine/group_tables.py).
Contiguous: the linear slot space of the ContiguousAllocator is a KVCache with block_size 1, and a
sequence is described by its region, `(start,)`, with its length in context_lens: the kernels read
slots [start, start + length) in tiles, so no per-token table is built or read. The same kernel family
serves both allocators (a constexpr switch chooses table lookup or start + position), so a speed or
memory difference between them comes from the allocator, not from a different kernel.
Copy and swap instructions are (src, dst) block pairs when paged and (src_start, dst_start, num_slots)
triples when contiguous; both become block pairs of the pool here.
"""
from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as SeqLike

import torch

from gpu_backend.kv_cache import KVCache
from gpu_backend.model import CausalLM
from simulator.core.sequence import Sequence


def expand_instructions(instructions: Iterable[tuple[int, ...]]) -> list[tuple[int, int]]:
    """Block pairs for a list of (src, dst) pairs or (src_start, dst_start, num_slots) triples."""
    pairs: list[tuple[int, int]] = []
    for ins in instructions:
        if len(ins) == 2:
            pairs.append((ins[0], ins[1]))
        else:
            src, dst, count = ins
            pairs.extend(zip(range(src, src + count), range(dst, dst + count), strict=True))
    return pairs


class CacheEngine:
    """Device KV pool plus a CPU swap pool (grown as blocks are swapped out), for one allocator layout."""

    def __init__(self, model: CausalLM, contiguous: bool, block_size: int, num_blocks: int,
                 num_cpu_blocks: int, layer_slots: SeqLike[int] | None = None):
        cfg = model.config
        self.contiguous = contiguous
        self.block_size = 1 if contiguous else block_size  # the pool's block size
        self.num_cpu_blocks = num_cpu_blocks
        self._geometry = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, model.dtype)
        self.layer_slots = layer_slots  # KV cache groups: layers sharing a tensor (kv_cache.py)
        self.device_cache = KVCache(cfg.num_hidden_layers, num_blocks, self.block_size,
                                    cfg.num_key_value_heads, cfg.head_dim, dtype=model.dtype,
                                    device=model.device, layer_slots=layer_slots)
        self.cpu_cache: KVCache | None = None
        self.tiers = None  # the KV tiers' data (kv_tiers.TierData), when the engine has tiers

    def settle_tiers(self) -> None:
        """Perform the KV tiers' pending moves: call before anything writes into the device pool (a block
        the pool evicted may be re-allocated in the same step, and loaded blocks are read by the forward)."""
        if self.tiers is not None:
            self.tiers.run()

    @property
    def bytes(self) -> int:
        """Bytes of the device pool."""
        return self.device_cache.bytes

    @property
    def cpu_bytes(self) -> int:
        """Bytes of the CPU swap pool as allocated so far (0 until the first swap-out)."""
        return 0 if self.cpu_cache is None else self.cpu_cache.bytes

    def block_table(self, seq: Sequence) -> SeqLike[int]:
        """The pool blocks holding `seq`'s tokens in logical order; contiguous: `(region start,)`."""
        if self.contiguous:
            return (seq.region[0],)  # (region start,): the length travels as the context length
        return seq.block_table

    def shared_range_copies(self, src: Sequence, dst: Sequence, start: int,
                            stop: int) -> list[tuple[int, int]]:
        """Pairs copying token positions [start, stop) of `src` to `dst` when they are stored apart.

        A group's n samples share one prompt: paged, they share its blocks; contiguous, each sample has
        its own region, so the prompt computed into the first region is copied into the others.
        """
        if not self.contiguous or src is dst:
            return []
        a, b = src.region[0], dst.region[0]
        return list(zip(range(a + start, a + stop), range(b + start, b + stop), strict=True))

    def copy(self, instructions: Iterable[tuple[int, ...]]) -> None:
        """Copy-on-write / fork copies inside the device pool."""
        self.settle_tiers()
        pairs = expand_instructions(instructions)
        if pairs:
            self.device_cache.copy_blocks(pairs)

    def swap_out(self, instructions: Iterable[tuple[int, ...]]) -> None:
        """Device -> CPU copies (device block, CPU block)."""
        self.settle_tiers()
        pairs = expand_instructions(instructions)
        if pairs:
            self.device_cache.swap_out(self._cpu(1 + max(dst for _, dst in pairs)), pairs)

    def swap_in(self, instructions: Iterable[tuple[int, ...]]) -> None:
        """CPU -> device copies (CPU block, device block)."""
        self.settle_tiers()
        pairs = expand_instructions(instructions)
        if pairs:
            self.device_cache.swap_in(self._cpu(1 + max(src for src, _ in pairs)), pairs)

    def _cpu(self, need: int) -> KVCache:
        """The CPU pool, grown to hold blocks 0..need-1. The swap space may be GiBs (4 by default, a CPU
        tier's budget beside one) and most runs never swap: the pool starts at the first swap-out and
        doubles as needed, up to `num_cpu_blocks`; the paged allocators hand out their lowest free CPU
        blocks first, so the pool stays near the most blocks ever swapped out at once."""
        have = 0 if self.cpu_cache is None else self.cpu_cache.num_blocks
        if need > have:
            layers, kv_heads, head_dim, dtype = self._geometry
            grown = KVCache(layers, min(self.num_cpu_blocks, max(need, 2 * have)), self.block_size, kv_heads,
                            head_dim, dtype=dtype, device="cpu", pin_memory=torch.cuda.is_available(),
                            layer_slots=self.layer_slots)
            if self.cpu_cache is not None:
                old = self.cpu_cache
                for new_pool, old_pool in zip(grown.k_pools + grown.v_pools, old.k_pools + old.v_pools,
                                              strict=True):
                    new_pool[:have].copy_(old_pool)
            self.cpu_cache = grown
        return self.cpu_cache

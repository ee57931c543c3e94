"""Prefix caching for the BlockManager: content keys of full blocks, lookups, publishing, reset.

A mixin of `BlockManager` (block_manager.py), which owns the state: `_key[bid]` (parent key, content, extra
key) and `_hash[bid]` of full blocks, and `_cached`, content hash -> the one block published under it.

As in vLLM v1, a block is published only once the step that computes its last token is scheduled
(`allocate` with the step's token budget, then `cache_blocks` for each later prefill chunk, `append_slots`
for decode tokens): a group preempted in the middle of a chunked prefill leaves only computed blocks behind.
Deliberate differences from vLLM are listed in docs/memory-core.md.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from simulator.core.errors import AllocationError
from simulator.core.sequence import Sequence, SequenceGroup, shares_allocation

if TYPE_CHECKING:
    from collections import OrderedDict

    from simulator.core.paged.block_stats import BlockManagerStats


class PrefixCacheMixin:
    """Content-addressed reuse of full, computed blocks (see the module docstring for the state)."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    stats: BlockManagerStats
    _hash_fn: Callable[[object], int]
    _ref: list[int]
    _filled: list[int]
    _key: list
    _hash: list
    _cached: dict[int, int]
    _free: list[int]
    _free_cached: OrderedDict[int, None]
    _seqs: dict[int, Sequence]

    def _lookup(self, seq: Sequence) -> list[int]:
        """Device blocks holding this sequence's leading full blocks (never its last token)."""
        if not self.enable_prefix_caching or (seq.token_ids is None and not seq.prefix_keys):
            return []  # nothing to match (a simulated prompt without prefix keys)
        bs = self.block_size
        hits: list[int] = []
        parent_key: tuple | None = None
        parent_hash: int | None = None
        for i in range((seq.length - 1) // bs):
            content = seq.block_content(i, bs)
            if content is None:
                break
            h = self._hash_fn((parent_hash, content, seq.extra_key))
            bid = self._cached.get(h)
            # Compare the whole key, not only the hash, so a collision can never alias two prefixes.
            if bid is None or self._key[bid] != (parent_key, content, seq.extra_key):
                break
            hits.append(bid)
            parent_key, parent_hash = self._key[bid], h
        return hits

    def _register_full(self, seq: Sequence, index: int, bid: int) -> None:
        """Give full block `index` of `seq` its chained content key and publish it in the cache."""
        if not self.enable_prefix_caching or self._key[bid] is not None:
            return
        content = seq.block_content(index, self.block_size)
        if content is None:
            return
        if index == 0:
            parent_key = parent_hash = None
        else:
            parent = seq.block_table[index - 1]
            parent_key, parent_hash = self._key[parent], self._hash[parent]
            if parent_key is None:
                return  # an unkeyed parent breaks the chain; nothing after it can be matched
        h = self._hash_fn((parent_hash, content, seq.extra_key))
        self._plain = False
        self._key[bid] = (parent_key, content, seq.extra_key)
        self._hash[bid] = h
        self._cached.setdefault(h, bid)  # an identical or colliding block already published wins

    def cache_blocks(self, group: SequenceGroup, num_left: int) -> None:
        """Publish the full blocks of the group whose tokens are computed once its prefill has `num_left`
        prompt tokens left to compute (call when scheduling each chunk after the first)."""
        if not self.enable_prefix_caching:
            return
        seqs = [s for s in group.live_seqs() if s.seq_id in self._seqs]
        if len(seqs) > 1 and shares_allocation(seqs):
            seqs = seqs[:1]  # one table shared by all
        # Diverged sequences are prefilled one after the other, so the tokens left belong to the last ones.
        bs = self.block_size
        for s in reversed(seqs):
            uncomputed = min(num_left, s.length - s.num_cached_tokens)
            num_left -= uncomputed
            for i in range(s.num_cached_tokens // bs, (s.length - uncomputed) // bs):
                self._register_full(s, i, s.block_table[i])

    def reset_prefix_cache(self) -> int:
        """Forget every cached block; return how many were dropped. Refused, as in vLLM, while any block is
        in use: its holder would keep content the cache no longer knows about, so hits would be lost."""
        used = self.num_blocks - len(self._free) - len(self._free_cached)
        if used:
            raise AllocationError(f"cannot reset the prefix cache: {used} blocks are still in use "
                                  f"(free or finish every sequence first)")
        dropped = len(self._free_cached)
        self._cached.clear()
        self._free_cached.clear()
        self._key = [None] * self.num_blocks
        self._hash = [None] * self.num_blocks
        self._filled = [0] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))  # as fresh: lowest id first
        return dropped

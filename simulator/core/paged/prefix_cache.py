"""Prefix caching for the BlockManager: chained content keys of full blocks, lookups and publishing.

The block pool holds what is cached (`key[bid]` = (parent key, content, extra key) and `hash[bid]` of a
published block, and `cached`, content hash -> the one block published under it); this collaborator
computes the chained keys, finds a sequence's cached prefix and publishes computed blocks.

As in vLLM v1, a block is published only once the step that computes its last token is scheduled
(`allocate` with the step's token budget, then `cache_blocks` for each later prefill chunk, `append_slot`
for decode tokens): a group preempted in the middle of a chunked prefill leaves only computed blocks behind.
Deliberate differences from vLLM are listed in docs/concepts.md.
"""
from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter

from simulator.core.errors import AllocationError
from simulator.core.paged.block_pool import BlockPool
from simulator.core.sequence import Sequence

# The parent hash of a prompt's first block. Not None: before Python 3.12 None hashes by its address, so
# every chained hash (and the events table's prefix_key) would change from one process to the next.
ROOT_HASH = 0
LINK_KEY, LINK_HASH = itemgetter(0), itemgetter(1)  # of a chain link, (key, hash)


def chain_links(seq: Sequence, start: int, stop: int, parent: tuple[tuple | None, int],
                hash_fn: Callable[[object], int], block_size: int) -> list[tuple[tuple, int]]:
    """The chained (key, hash) of full blocks `start` to `stop` - 1 of `seq`, following on from block
    `start` - 1's `parent` (key, hash) (the first block's: (None, ROOT_HASH)); it ends where the content
    does."""
    key, h = parent
    prefix = seq.prefix_keys if seq.token_ids is None else None
    if prefix is not None:  # a simulated prompt's content keys, `block_content` inlined
        stop = min(stop, len(prefix))
    extra = seq.extra_key
    out = []
    for i in range(start, stop):
        content = prefix[i] if prefix is not None else seq.block_content(i, block_size)
        if content is None:
            break
        h = hash_fn((h, content, extra))
        key = (key, content, extra)
        out.append((key, h))
    return out


def same_key(a: tuple | None, b: tuple | None) -> bool:
    """Whether two chained content keys are equal. `==` on them recurses once per parent until it meets an
    object both share, past the interpreter's recursion limit for two chains built apart (a 16k-token
    prompt is a thousand blocks deep): this walks the parents instead."""
    while a is not b:
        if a is None or b is None or a[1] != b[1] or a[2] != b[2]:
            return False
        a, b = a[0], b[0]
    return True


class PrefixCache:
    """Content-addressed reuse of full, computed blocks of one pool (off: every call finds nothing)."""

    def __init__(self, pool: BlockPool, enabled: bool = True, hash_fn: Callable[[object], int] = hash):
        self.pool = pool
        self.enabled = enabled
        self.hash_fn = hash_fn

    def lookup(self, seq: Sequence) -> list[int]:
        """Device blocks holding this sequence's leading full blocks (never its last token)."""
        if not self.enabled or (seq.token_ids is None and not seq.prefix_keys):
            return []  # nothing to match (a simulated prompt without prefix keys)
        pool, hash_fn = self.pool, self.hash_fn
        bs, cached, keys = pool.block_size, pool.cached, pool.key
        hits: list[int] = []
        parent_key: tuple | None = None
        parent_hash = ROOT_HASH
        for i in range((seq.length - 1) // bs):
            content = seq.block_content(i, bs)
            if content is None:
                break
            h = hash_fn((parent_hash, content, seq.extra_key))
            bid = cached.get(h)
            # Compare the whole key, not only the hash, so a collision can never alias two prefixes.
            if bid is None or keys[bid] != (parent_key, content, seq.extra_key):
                break
            hits.append(bid)
            parent_key, parent_hash = keys[bid], h
        return hits

    def publish(self, seq: Sequence, index: int, bid: int) -> None:
        """Give full block `index` of `seq` (block `bid`) its chained content key and publish it."""
        pool = self.pool
        if not self.enabled or pool.key[bid] is not None:
            return
        content = seq.block_content(index, pool.block_size)
        if content is None:
            return
        if index == 0:
            parent_key, parent_hash = None, ROOT_HASH
        else:
            parent = seq.block_table[index - 1]
            parent_key, parent_hash = pool.key[parent], pool.hash[parent]
            if parent_key is None:
                return  # an unkeyed parent breaks the chain; nothing after it can be matched
        h = self.hash_fn((parent_hash, content, seq.extra_key))
        pool.plain = False
        pool.key[bid] = (parent_key, content, seq.extra_key)
        pool.hash[bid] = h
        pool.cached.setdefault(h, bid)  # an identical or colliding block already published wins

    def chain(self, seq: Sequence, start: int, stop: int) -> list[tuple[tuple, int]]:
        """The chained (key, hash) that `publish` would give blocks `start` to `stop` - 1 of `seq`, none of
        them published yet, following on from block `start` - 1's key; it ends where the content does."""
        pool = self.pool
        parent = (None, ROOT_HASH)
        if start:
            bid = seq.block_table[start - 1]
            parent = pool.key[bid], pool.hash[bid]
            if parent[0] is None:
                return []  # an unkeyed parent breaks the chain
        return chain_links(seq, start, stop, parent, self.hash_fn, pool.block_size)

    def publish_computed(self, seqs: list[Sequence], num_left: int) -> None:
        """Publish the full blocks of `seqs` (one group's held sequences; equal ones share one table)
        whose tokens are computed once `num_left` prompt tokens are left to compute."""
        if not self.enabled:
            return
        # Diverged sequences are prefilled one after the other, so the tokens left belong to the last ones.
        bs = self.pool.block_size
        for s in reversed(seqs):
            uncomputed = min(num_left, s.length - s.num_cached_tokens)
            num_left -= uncomputed
            for i in range(s.num_cached_tokens // bs, (s.length - uncomputed) // bs):
                self.publish(s, i, s.block_table[i])

    def reset(self) -> int:
        """Forget every cached block; return how many were dropped. Refused, as in vLLM, while any block is
        in use: its holder would keep content the cache no longer knows about, so hits would be lost."""
        pool = self.pool
        used = pool.num_blocks - pool.num_free
        if used:
            raise AllocationError(f"cannot reset the prefix cache: {used} blocks are still in use "
                                  f"(free or finish every sequence first)")
        dropped = len(pool.free_cached)
        n = pool.num_blocks
        pool.cached.clear()
        pool.free_cached.clear()
        pool.key = [None] * n
        pool.hash = [None] * n
        pool.filled = [0] * n
        pool.free = list(range(n - 1, -1, -1))  # as fresh: lowest id first
        return dropped

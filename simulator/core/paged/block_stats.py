"""Counters of the paged allocator."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class BlockManagerStats:
    """Counters a run reports; only mutating methods touch them."""

    prefix_queries: int = 0  # full prompt blocks looked up in the prefix cache
    prefix_hits: int = 0  # of those, found
    prefix_query_tokens: int = 0  # prompt tokens of the sequences looked up (vLLM v1's `queries`)
    prefix_hit_tokens: int = 0  # of those, found in the cache (vLLM v1's `hits`)
    evictions: int = 0  # cached blocks reused for other content
    cow_copies: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    allocated_blocks: int = 0  # blocks taken from the free pools

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

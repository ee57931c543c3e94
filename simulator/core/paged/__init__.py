"""vLLM's paged allocator: a BlockManager that has a BlockPool (free list, ref counts, prefix cache)."""
from simulator.core.paged.block_manager import BlockManager
from simulator.core.paged.block_stats import BlockManagerStats

__all__ = ["BlockManager", "BlockManagerStats"]

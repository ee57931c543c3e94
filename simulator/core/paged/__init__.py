"""vLLM's paged allocator: a BlockManager that has a BlockPool, a PrefixCache and a SwapSpace."""
from simulator.core.paged.block_manager import BlockManager
from simulator.core.paged.block_pool import BlockManagerStats

__all__ = ["BlockManager", "BlockManagerStats"]

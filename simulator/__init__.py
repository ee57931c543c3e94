"""pagelab simulator: the KV-cache memory core, scheduling and trace-driven simulation.

Imports no torch, triton or matplotlib: the simulator stays light and fast.
"""
from simulator.allocator import AllocStatus, KVAllocator, MemoryBreakdown, RegionRecorder
from simulator.block_manager import BlockManager
from simulator.block_stats import BlockManagerStats
from simulator.contiguous import ContiguousAllocator
from simulator.errors import AllocationError, ConfigError, InvariantError
from simulator.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = [
    "AllocStatus", "AllocationError", "BlockManager", "BlockManagerStats", "ConfigError",
    "ContiguousAllocator", "InvariantError", "KVAllocator", "MemoryBreakdown", "RegionRecorder",
    "Sequence", "SequenceGroup", "SequenceStatus",
]

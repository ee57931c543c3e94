"""pagelab simulator: the shared KV-cache memory core (simulator.core) and the trace-driven simulation.

Imports no torch, triton or matplotlib: the simulator stays light and fast.
"""
from simulator.core import (
    AllocationError,
    AllocStatus,
    BlockManager,
    BlockManagerStats,
    ConfigError,
    ContiguousAllocator,
    InvariantError,
    KVAllocator,
    MemoryBreakdown,
    RegionRecorder,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)

__all__ = [
    "AllocStatus", "AllocationError", "BlockManager", "BlockManagerStats", "ConfigError",
    "ContiguousAllocator", "InvariantError", "KVAllocator", "MemoryBreakdown", "RegionRecorder",
    "Scheduler", "SchedulerConfig", "Sequence", "SequenceGroup", "SequenceStatus",
]

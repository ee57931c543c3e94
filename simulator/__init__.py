"""pagelab simulator: the shared KV-cache memory core (simulator.core) and the trace-driven simulation.

simulator.loop runs a simulation (`simulate`), simulator.output keeps or writes its tables,
simulator.timing says how long a step takes, simulator.sweep runs many. Importing this package loads the
core only: no numpy, pandas, torch or matplotlib.
"""
from simulator.core import (
    MEMORY_STATES,
    AllocationError,
    AllocStatus,
    BlockManager,
    BlockManagerStats,
    ConfigError,
    ContiguousAllocator,
    EventLog,
    InvariantError,
    KVAllocator,
    MemoryBreakdown,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceGroup,
    SequenceStatus,
    check_invariants,
)

__all__ = [
    "MEMORY_STATES", "AllocStatus", "AllocationError", "BlockManager", "BlockManagerStats", "ConfigError",
    "ContiguousAllocator", "EventLog", "InvariantError", "KVAllocator", "MemoryBreakdown", "Scheduler",
    "SchedulerConfig", "Sequence", "SequenceGroup", "SequenceStatus", "check_invariants",
]

"""The memory core the simulator and the GPU engine share: sequences, allocators, the scheduler.

`paged/` is vLLM's BlockManager (a pool of fixed-size blocks, prefix caching, fork, copy-on-write, swap);
`contiguous/` is the Orca-style baseline (one reserved region per sequence in a linear slot space). Both
implement `KVAllocator` (allocator.py), which is all the `Scheduler` (scheduler.py) talks to; the
scheduler's decode batch (decode.py) takes plain decode steps in O(what changes). Nothing here imports
numpy, pandas or the simulation loop.
"""
from simulator.core.allocator import MEMORY_STATES, AllocStatus, EventLog, KVAllocator, MemoryBreakdown
from simulator.core.contiguous import ContiguousAllocator
from simulator.core.errors import AllocationError, ConfigError, InvariantError
from simulator.core.invariants import check_invariants
from simulator.core.paged import BlockManager, BlockManagerStats
from simulator.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from simulator.core.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = [
    "MEMORY_STATES", "AllocStatus", "AllocationError", "BlockManager", "BlockManagerStats", "ConfigError",
    "ContiguousAllocator", "EventLog", "InvariantError", "KVAllocator", "MemoryBreakdown", "Scheduler",
    "SchedulerConfig", "SchedulerOutput", "Sequence", "SequenceGroup", "SequenceStatus", "check_invariants",
]

"""The memory core the simulator and the GPU engine share: sequences, allocators, the scheduler.

`paged/` is vLLM's BlockManager (a pool of fixed-size blocks, prefix caching, fork, copy-on-write, swap);
`contiguous/` is the Orca-style baseline (one reserved region per sequence in a linear slot space). Both
implement `KVAllocator` (allocator.py), which is all the `Scheduler` (scheduler.py) talks to; the
scheduler's decode batch (decode.py) takes plain decode steps in O(what changes). Nothing here imports
numpy, pandas or the simulation loop. The names below load their module when first used.
"""
from importlib import import_module

_WHERE = {
    **dict.fromkeys(("MEMORY_STATES", "AllocStatus", "EventLog", "KVAllocator", "MemoryBreakdown"),
                    "simulator.core.allocator"),
    "ContiguousAllocator": "simulator.core.contiguous.allocator",
    **dict.fromkeys(("AllocationError", "ConfigError", "InvariantError"), "simulator.core.errors"),
    "check_invariants": "simulator.core.invariants",
    **dict.fromkeys(("BlockManager",), "simulator.core.paged.block_manager"),
    "BlockManagerStats": "simulator.core.paged.block_pool",
    **dict.fromkeys(("Scheduler", "SchedulerConfig", "SchedulerOutput"), "simulator.core.scheduler"),
    **dict.fromkeys(("Sequence", "SequenceGroup", "SequenceStatus"), "simulator.core.sequence"),
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'simulator.core' has no attribute {name!r}")

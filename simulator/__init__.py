"""pagelab simulator: the shared KV-cache memory core (simulator.core) and the trace-driven simulation.

simulator.loop runs a simulation (`simulate`), simulator.output keeps or writes its tables,
simulator.timing says how long a step takes, simulator.sweep runs many. The core's names are re-exported
here and load the core when first used: importing one submodule loads only what it imports.
"""
import simulator.core as _core

__all__ = list(_core.__all__)


def __getattr__(name: str):
    if name in __all__:
        return getattr(_core, name)
    raise AttributeError(f"module 'simulator' has no attribute {name!r}")

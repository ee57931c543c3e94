"""The simulation loop: `simulate(trace, config, output)` and the driver it shares with the engine replay."""
from simulator.loop.simulate import RunResult, drive, simulate

__all__ = ["RunResult", "drive", "simulate"]

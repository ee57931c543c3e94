"""Orca-style contiguous reservations (max / pow2 / oracle) placed by buddy or first-fit."""
from simulator.core.contiguous.allocator import ContiguousAllocator
from simulator.core.contiguous.placement import PLACEMENTS, BuddyPlacement, FirstFitPlacement, next_pow2

__all__ = ["PLACEMENTS", "BuddyPlacement", "ContiguousAllocator", "FirstFitPlacement", "next_pow2"]

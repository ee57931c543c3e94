"""Typed errors of the memory core and simulator."""
from pagelab.errors import PagelabError


class ConfigError(PagelabError, ValueError):
    """An impossible or inconsistent configuration (block size, capacity, preset name...)."""

    names_fields = True


class AllocationError(PagelabError, RuntimeError):
    """A misuse of an allocator: allocating past capacity, freeing twice, appending to a finished sequence."""


class InvariantError(AssertionError):
    """The debug invariant checker found corrupted allocator state (a bug, never user input)."""

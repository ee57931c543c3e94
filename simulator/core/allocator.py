"""The allocator interface both KV-cache allocators implement, and the memory taxonomy they report."""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass

from simulator.core.sequence import Sequence, SequenceGroup


class AllocStatus(enum.Enum):
    """Answer of `can_allocate`: fits now, fits once memory frees up, or can never fit."""

    OK = "ok"
    LATER = "later"
    NEVER = "never"


@dataclass(frozen=True)
class MemoryBreakdown:
    """The five states of every KV slot at one instant (DESIGN.md taxonomy), in slots.

    token_states + reservation + internal_fragmentation + external_fragmentation + free == capacity.
    `cached_free` is the part of `free` held only by the prefix cache (evictable at once).
    """

    capacity: int
    token_states: int
    reservation: int
    internal_fragmentation: int
    external_fragmentation: int
    free: int
    cached_free: int
    allocated: int  # slots held by some sequence (whole blocks / whole regions)

    STATES = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free")

    def fractions(self) -> dict[str, float]:
        """Each state as a fraction of capacity (they sum to 1)."""
        c = self.capacity
        return {name: getattr(self, name) / c for name in self.STATES}

    @property
    def token_occupancy(self) -> float:
        """Fraction of slots holding the KV of a token."""
        return self.token_states / self.capacity

    @property
    def block_occupancy(self) -> float:
        """Fraction of slots inside blocks/regions that some sequence holds (what 'KV usage' shows)."""
        return self.allocated / self.capacity


class RegionRecorder:
    """Receives tenure events of pool regions (for block maps); positions and sizes are in slots.

    The simulator installs one that timestamps events; this default ignores them.
    """

    def acquire(self, start: int, size: int, request_id: int) -> None:
        """A region went from unused to held by `request_id`."""

    def share(self, start: int, ref_count: int) -> None:
        """A held region's ref count rose above 1."""

    def release(self, start: int, filled: int) -> None:
        """A region stopped being held while `filled` of its slots held tokens."""


class KVAllocator(abc.ABC):
    """What the scheduler and the engine need from a KV-cache allocator.

    Query methods (`can_*`, `breakdown`, `num_free_*`) never change state. Mutating methods return the
    copies the engine must perform on the device: `(src, dst)` block pairs for the paged allocator,
    `(src_start, dst_start, num_slots)` region triples for the contiguous one.
    """

    name: str
    block_size: int
    capacity_tokens: int

    @abc.abstractmethod
    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """Whether the group's live sequences can get slots for all their tokens now."""

    def can_ever_allocate(self, group: SequenceGroup) -> bool:
        """Whether `can_allocate` would answer OK or LATER (not NEVER); allocators whose NEVER depends only
        on the group's lengths answer without looking at their free memory."""
        return self.can_allocate(group) is not AllocStatus.NEVER

    @abc.abstractmethod
    def allocate(self, group: SequenceGroup, num_new_tokens: int | None = None) -> int:
        """Give every live sequence of the group slots for its tokens; return prefix-cached tokens.

        `num_new_tokens`: tokens past the cached prefix this step computes (None: all); an allocator with
        a prefix cache publishes only the blocks they complete."""

    @abc.abstractmethod
    def cache_blocks(self, group: SequenceGroup, num_left: int) -> None:
        """Publish the group's blocks computed once `num_left` of its prompt tokens are left to compute."""

    @abc.abstractmethod
    def can_append(self, seq: Sequence, num_tokens: int = 1) -> bool:
        """Whether `seq` can grow by `num_tokens` slots now."""

    @abc.abstractmethod
    def can_append_seqs(self, seqs: list[Sequence], num_tokens: int = 1) -> bool:
        """Whether all `seqs` can grow by `num_tokens` each at once."""

    @abc.abstractmethod
    def append_slots(self, seq: Sequence, num_tokens: int = 1) -> list[tuple[int, ...]]:
        """Grow `seq` by `num_tokens` tokens (each gets a slot); return copy-on-write copies."""

    def append_slot(self, seq: Sequence) -> list[tuple[int, ...]]:
        """Grow `seq` by one token; return copy-on-write copies."""
        return self.append_slots(seq, 1)

    @abc.abstractmethod
    def can_fork(self, parent: Sequence) -> bool:
        """Whether a child of `parent` can be created now."""

    @abc.abstractmethod
    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, ...]]:
        """Make `child` hold the same tokens as `parent`; return the copies needed (none when paged)."""

    @abc.abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release everything `seq` holds, on the device or in the CPU pool."""

    @abc.abstractmethod
    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the CPU pool can take the group's KV now."""

    @abc.abstractmethod
    def swap_out(self, group: SequenceGroup) -> list[tuple[int, ...]]:
        """Move the group's KV to the CPU pool; return device -> CPU copies."""

    @abc.abstractmethod
    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        """OK, LATER, or NEVER: whether the device pool can take the group's KV back (and give each
        sequence the slot of its next token)."""

    @abc.abstractmethod
    def swap_in(self, group: SequenceGroup) -> list[tuple[int, ...]]:
        """Move the group's KV back from the CPU pool; return CPU -> device copies."""

    @abc.abstractmethod
    def breakdown(self, head: SequenceGroup | None = None) -> MemoryBreakdown:
        """The memory taxonomy now; `head` is the request at the head of the waiting queue."""

    @abc.abstractmethod
    def check_invariants(self) -> None:
        """Recompute the state from scratch and raise InvariantError on any mismatch."""

    # Bulk decode hooks. The simulator's fast mode (simulator/decode_batch.py) advances many plain decodes
    # at once: it counts their tokens itself and writes them back only when a sequence needs exact state.
    # The engine never calls these; it appends one slot per token with `append_slots`.
    @abc.abstractmethod
    def add_decode_tokens(self, num_tokens: int) -> None:
        """Count `num_tokens` more tokens held by decoding sequences whose counts are settled later."""

    @abc.abstractmethod
    def set_num_tokens(self, seq: Sequence, num_tokens: int) -> None:
        """Settle a lazily advanced sequence: its token count (and the fill of its last slot holder)."""

    def append_decode_blocks(self, seqs: list[Sequence], times: list[float] | None = None) -> None:
        """Give each of `seqs`, in order, the fresh block its next token needs (paged allocators only:
        a contiguous region is reserved whole at admission, so decoding never takes memory)."""
        raise NotImplementedError(f"{type(self).__name__} takes no blocks while decoding")

    @property
    @abc.abstractmethod
    def num_used_slots(self) -> int:
        """Slots held by sequences on the device (whole blocks / whole regions)."""

"""What every KV-cache allocator shares: its interface, the memory taxonomy it reports, its event log."""
from __future__ import annotations

import abc
import enum
from collections.abc import Sequence as SeqLike
from typing import NamedTuple

from pagelab.run_format import MEMORY_STATES
from simulator.core.sequence import Sequence, SequenceGroup

__all__ = ["MEMORY_STATES", "AllocStatus", "EventLog", "HybridBreakdown", "KVAllocator", "MemoryBreakdown",
           "RawEvents"]


class AllocStatus(enum.Enum):
    """Answer of `can_allocate`: fits now, fits once memory frees up, or can never fit."""

    OK = "ok"
    LATER = "later"
    NEVER = "never"


class MemoryBreakdown(NamedTuple):
    """The state of every KV slot at one instant, in slots (a tuple: cheap to make every step).

    token_states + reservation + internal_fragmentation + external_fragmentation + free == capacity.
    `cached_free` is the part of `free` held only by the prefix cache (evictable at once); `allocated`
    counts the slots inside blocks or regions some sequence holds.
    """

    capacity: int
    token_states: int
    reservation: int
    internal_fragmentation: int
    external_fragmentation: int
    free: int
    cached_free: int
    allocated: int

    def fractions(self) -> dict[str, float]:
        """Each state as a fraction of capacity (they sum to 1)."""
        c = self.capacity
        return {name: getattr(self, name) / c for name in MEMORY_STATES}

    @property
    def token_occupancy(self) -> float:
        """Fraction of slots holding the KV of a token."""
        return self.token_states / self.capacity

    @property
    def block_occupancy(self) -> float:
        """Fraction of slots inside blocks/regions that some sequence holds (what 'KV usage' shows)."""
        return self.allocated / self.capacity


class HybridBreakdown(NamedTuple):
    """A MemoryBreakdown of a pool split into KV cache groups, with two parts of its states (in slots):
    `padding`, of internal_fragmentation, the layer slots of held blocks that padding layers leave unused,
    and `window_cached`, of cached_free, the blocks a sliding window handed back that the prefix cache
    keeps. A tuple of its own: one-group allocators build, and their memory rows unpack, eight fields.
    """

    capacity: int
    token_states: int
    reservation: int
    internal_fragmentation: int
    external_fragmentation: int
    free: int
    cached_free: int
    allocated: int
    padding: int
    window_cached: int

    fractions = MemoryBreakdown.fractions
    token_occupancy = MemoryBreakdown.token_occupancy
    block_occupancy = MemoryBreakdown.block_occupancy


class KVAllocator(abc.ABC):
    """What the scheduler and the engine need from a KV-cache allocator (the vLLM paper's vocabulary).

    Queries (`can_*`, `breakdown`) never change state. Mutations return the copies the engine must
    perform on the device: `(src, dst)` block pairs for the paged allocator, `(src_start, dst_start,
    num_slots)` region triples for the contiguous one. `events` is the allocator's EventLog when the run
    records pool tenures (None otherwise).
    """

    name: str
    block_size: int
    capacity_tokens: int  # tokens the pool holds (vLLM's "GPU KV cache size")
    capacity_slots: int  # token slots the pool's blocks span: more than its tokens when groups share blocks
    events: EventLog | None = None
    shares_prompt = False  # whether the diverged sequences of a group share their prompt's full blocks

    @abc.abstractmethod
    def can_allocate(self, group: SequenceGroup, num_new_tokens: int | None = None) -> AllocStatus:
        """Whether the group's live sequences can get slots for their tokens now (an allocator that
        allocates a prompt chunk by chunk: for the first `num_new_tokens` past the cached prefix)."""

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
    def can_append(self, seqs: list[Sequence], num_tokens: int = 1) -> bool:
        """Whether every sequence of `seqs` can grow by `num_tokens` slots now, all at once."""

    @abc.abstractmethod
    def append_slot(self, seq: Sequence, num_tokens: int = 1) -> list[tuple[int, ...]]:
        """Grow `seq` by `num_tokens` tokens (each gets a slot); return copy-on-write copies."""

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


ACQUIRE, RELEASE, SHARE = 0, 1, 2  # event kinds
PER_EVENT_RID, PER_EVENT_TIME = 1, 2  # flags of an acquisition run that lists one value per block


class RawEvents:
    """One batch of allocation events, as flat lists (the output pairs them into tenures with numpy).

    Every event names a key (a block id, or a region's first slot for unit 1); `e_*` hold the keys in
    the order the events happened and, per run (one log call), its length, kind and unit. Acquisition runs
    carry a region size, a request id, the acquiring sequence's id and a time (or, flagged in `a_flags`,
    one of each per event in `a_rids` and `a_sids` / `a_times`); release runs a time and one filled count
    per event (and, flagged in `r_flags`, one prefix-cache content key per event in `r_keys`); shares a
    new ref count each.
    Lists, not typed arrays: `list.extend` copies pointers, where `array.extend` converts every element.
    """

    __slots__ = ("e_keys", "e_n", "e_kind", "e_unit", "a_size", "a_rid", "a_sid", "a_t", "a_flags",
                 "a_rids", "a_sids", "a_times", "r_t", "r_filled", "r_flags", "r_keys", "s_ref")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, [])


class EventLog:
    """The allocation events of one pool since it was last drained (`take`), stamped with `now`.

    The allocator logs whole runs of blocks per call (one C-level `extend` each); the run's output drains
    the log every so many acquisitions and pairs the events into tenures (simulator/output/tenures.py).
    Acquisitions are numbered in order from 0 (`num_acquired` counts them).
    """

    def __init__(self) -> None:
        self.now = 0.0  # the run's clock (its driver sets it)
        self.num_acquired = 0
        self.first_unread = 0  # number of the first acquisition in the batch not yet taken
        self._start_batch()
        # Reference-count changes of held blocks (first slot, time, new count): a table of their own,
        # written by the run's own process (`take_ref_changes`); they need no pairing.
        self.rc_start: list[int] = []
        self.rc_t: list[float] = []
        self.rc_ref: list[int] = []

    def _start_batch(self) -> None:
        self._raw = raw = RawEvents()
        self._e_keys, self._e_n, self._e_kind, self._e_unit = raw.e_keys, raw.e_n, raw.e_kind, raw.e_unit
        self._a_size, self._a_rid, self._a_t, self._a_flags = raw.a_size, raw.a_rid, raw.a_t, raw.a_flags
        self._a_sid, self._a_sids = raw.a_sid, raw.a_sids
        self._a_rids, self._a_times = raw.a_rids, raw.a_times
        self._r_t, self._r_filled, self._s_ref = raw.r_t, raw.r_filled, raw.s_ref
        self._r_flags, self._r_keys = raw.r_flags, raw.r_keys

    def take(self) -> tuple[RawEvents, int]:
        """The events logged since the last call, and the number of their first acquisition."""
        raw, first = self._raw, self.first_unread
        self._start_batch()
        self.first_unread = self.num_acquired
        return raw, first

    def acquire_blocks(self, block_ids: SeqLike[int], block_size: int, request_id: int | SeqLike[int],
                       seq_id: int | SeqLike[int], times: SeqLike[float] | None = None) -> None:
        """Blocks were taken, by one sequence (`seq_id`, of request `request_id`) or one per block (both
        listed), now or at `times` (one per block)."""
        n = len(block_ids)
        if not n:
            return
        self._e_keys.extend(block_ids)
        self._e_n.append(n)
        self._e_kind.append(ACQUIRE)
        self._e_unit.append(block_size)
        self._a_size.append(block_size)
        if isinstance(request_id, int):
            self._a_rid.append(request_id)
            self._a_sid.append(seq_id)
            flags = 0
        else:
            self._a_rid.append(0)
            self._a_sid.append(0)
            self._a_rids.extend(request_id)
            self._a_sids.extend(seq_id)
            flags = PER_EVENT_RID
        if times is None:
            self._a_t.append(self.now)
        else:
            self._a_t.append(0.0)
            self._a_times.extend(times)
            flags |= PER_EVENT_TIME
        self._a_flags.append(flags)
        self.num_acquired += n

    def release_blocks(self, block_ids: SeqLike[int], block_size: int, filled: SeqLike[int],
                       prefix_keys: SeqLike[int] | None = None) -> None:
        """Blocks were given back now, holding `filled` tokens each; `prefix_keys` gives each one's content
        key in the prefix cache (0: none) when any has one."""
        n = len(block_ids)
        if not n:
            return
        self._e_keys.extend(block_ids)
        self._e_n.append(n)
        self._e_kind.append(RELEASE)
        self._e_unit.append(block_size)
        self._r_t.append(self.now)
        self._r_filled.extend(filled)
        if prefix_keys is None:
            self._r_flags.append(0)
        else:
            self._r_flags.append(1)
            self._r_keys.extend(prefix_keys)

    def share_block(self, block_id: int, block_size: int, ref_count: int) -> None:
        """A block (a region, with block size 1) gained another owner."""
        self._e_keys.append(block_id)
        self._e_n.append(1)
        self._e_kind.append(SHARE)
        self._e_unit.append(block_size)
        self._s_ref.append(ref_count)
        self.ref_change(block_id, block_size, ref_count)

    def ref_change(self, block_id: int, block_size: int, ref_count: int) -> None:
        """A held block's (a region's, block size 1) owner count became `ref_count` (>= 1) now."""
        self.rc_start.append(block_id * block_size)
        self.rc_t.append(self.now)
        self.rc_ref.append(ref_count)

    def take_ref_changes(self) -> tuple[list[int], list[float], list[int]]:
        """The reference-count changes logged since the last call: first slots, times, new counts."""
        out = (self.rc_start, self.rc_t, self.rc_ref)
        self.rc_start, self.rc_t, self.rc_ref = [], [], []
        return out

    def acquire_region(self, start: int, size: int, request_id: int, seq_id: int) -> None:
        """A region of `size` slots starting at slot `start` was taken by sequence `seq_id`."""
        self._e_keys.append(start)
        self._e_n.append(1)
        self._e_kind.append(ACQUIRE)
        self._e_unit.append(1)
        self._a_size.append(size)
        self._a_rid.append(request_id)
        self._a_sid.append(seq_id)
        self._a_t.append(self.now)
        self._a_flags.append(0)
        self.num_acquired += 1

    def release_region(self, start: int, filled: int) -> None:
        """The region starting at slot `start` was given back holding `filled` tokens."""
        self._e_keys.append(start)
        self._e_n.append(1)
        self._e_kind.append(RELEASE)
        self._e_unit.append(1)
        self._r_t.append(self.now)
        self._r_filled.append(filled)
        self._r_flags.append(0)

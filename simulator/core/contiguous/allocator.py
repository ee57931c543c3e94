"""Contiguous KV allocation (Orca-style): one reserved region per sequence in a linear slot space."""
from __future__ import annotations

from simulator.core.allocator import AllocStatus, EventLog, KVAllocator, MemoryBreakdown
from simulator.core.contiguous.placement import PLACEMENTS, FirstFitPlacement, next_pow2
from simulator.core.errors import AllocationError, ConfigError
from simulator.core.sequence import Sequence, SequenceGroup, SequenceStatus

POLICIES = ("max", "pow2", "oracle")


class ContiguousAllocator(KVAllocator):
    """Reserve `max_model_len` (max), the prompt plus the next power of two of the output (pow2), or
    exactly the final length (oracle) for every sequence, never more than `max_model_len`, placed by
    binary buddy (default) or first-fit.

    Buddy rounds a region up to a power of two; the rounding (beyond the reservation) belongs to no
    sequence's future and is reported with external fragmentation ("external fragmentation & other",
    as in the vLLM paper's Fig. 2), so only `pow2` and `max` show internal fragmentation.
    """

    block_size = 1

    def __init__(self, capacity_tokens: int, policy: str = "max", placement: str = "buddy", *,
                 max_model_len: int = 2048, cpu_capacity_tokens: int = 0, debug: bool = False,
                 record_events: bool = False):
        if policy not in POLICIES:
            raise ConfigError(f"unknown reservation policy {policy!r}; choose from {', '.join(POLICIES)}")
        if placement not in PLACEMENTS:
            raise ConfigError(f"unknown placement {placement!r}; choose from {', '.join(PLACEMENTS)}")
        if max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {max_model_len}")
        self.name = f"contiguous-{policy}"
        self.policy = policy
        self.placement_name = placement
        self.capacity_tokens = self.capacity_slots = capacity_tokens
        self.cpu_capacity_tokens = cpu_capacity_tokens
        self.max_model_len = max_model_len
        self.debug = debug
        self.events = EventLog() if record_events else None
        self._placement = PLACEMENTS[placement](capacity_tokens)
        self._cpu = FirstFitPlacement(cpu_capacity_tokens) if cpu_capacity_tokens > 0 else None
        self._seqs: dict[int, Sequence] = {}
        self._placed: dict[int, int] = {}  # seq_id -> slots taken by its region (>= reservation)
        self._cpu_seqs: dict[int, tuple[int, int]] = {}  # seq_id -> (cpu start, slots)
        self.tokens_held = 0  # slots holding tokens (the decode batch adds its lazily counted ones)
        self._reserved = 0
        self._fill_target = 0  # sum of min(final_len, reservation): slots sequences will fill
        self._placed_total = 0
        self.num_preemptions = 0

    # ----------------------------------------------------------------- queries
    def reservation(self, seq: Sequence) -> int:
        """Slots the policy reserves for `seq`."""
        if self.policy == "max":
            return self.max_model_len
        if seq.final_len is None:
            raise ConfigError(f"policy {self.policy!r} needs each sequence's final length "
                              f"(sequence {seq.seq_id} has none)")
        if self.policy == "oracle":
            return min(seq.final_len, self.max_model_len)
        # The vLLM paper's Orca (Pow2): over-reserve the output part by at most 2x ("a true output of
        # 25 reserves 32 positions"), but never past the model's maximum length: no output can outgrow
        # max_model_len - prompt, and Orca (Max), "the space up to the maximum sequence length", is the
        # most generous policy. Without the cap a 1,100 + 600 token request would ask for a 4,096-slot buddy
        # block. Buddy placement then rounds the whole region to a power of two.
        return min(self.max_model_len, seq.prompt_len + next_pow2(max(1, seq.final_len - seq.prompt_len)))

    def can_allocate(self, group: SequenceGroup, num_new_tokens: int | None = None) -> AllocStatus:
        """OK, LATER, or NEVER: a region per live sequence, each holding its reservation."""
        seqs = group.live_seqs()
        r = self.reservation(seqs[0])
        if r < seqs[0].length or (seqs[0].final_len or 0) > r:
            return AllocStatus.NEVER  # the sequence would outgrow its region
        if r > self._placement.max_size or self._placement.empty_room(r) < len(seqs):
            return AllocStatus.NEVER
        return AllocStatus.OK if self._placement.can_fit(r, len(seqs)) else AllocStatus.LATER

    def cache_blocks(self, group: SequenceGroup, num_left: int) -> None:
        """No prefix cache here: nothing to publish."""

    def can_append(self, seqs: list[Sequence], num_tokens: int = 1) -> bool:
        """Whether every sequence's region still has `num_tokens` empty slots (reserved up front)."""
        return all(s.region is not None and s.num_tokens + num_tokens <= min(s.region[1], s._limit)
                   for s in seqs)

    def can_fork(self, parent: Sequence) -> bool:
        """Whether a region for a copy of `parent` fits now."""
        return self._placement.can_fit(parent.region[1] if parent.region else self.reservation(parent))

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the CPU pool holds every live sequence's tokens, placed as `swap_out` places them."""
        return self._cpu is not None and self._cpu.can_fit_all([n for _, n in self._swap_order(group)])

    def _swap_order(self, group: SequenceGroup) -> list[tuple[Sequence, int]]:
        """The live sequences and the CPU slots each takes, largest first (first-fit packs those best)."""
        live = [(s, max(1, s.num_tokens)) for s in group.seqs if s.seq_id in self._seqs]
        return sorted(live, key=lambda sn: -sn[1])

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        """OK, LATER, or NEVER: whether every swapped sequence gets its region back."""
        seqs = [s for s in group.seqs if s.seq_id in self._cpu_seqs]
        if not seqs:
            return AllocStatus.OK
        r = self.reservation(seqs[0])
        if r > self._placement.max_size or self._placement.empty_room(r) < len(seqs):
            return AllocStatus.NEVER
        return AllocStatus.OK if self._placement.can_fit(r, len(seqs)) else AllocStatus.LATER

    def breakdown(self, head: SequenceGroup | None = None) -> MemoryBreakdown:
        """Taxonomy now; free space too small for the head request's region is external fragmentation."""
        free_total = self._placement.total_free
        live = head.live_seqs() if head is not None else None
        if live:
            r = self.reservation(live[0])
            usable = self._placement.usable_free(r) if r <= self._placement.max_size else 0
        elif self.policy == "max":  # every request reserves the same grain, queue or no queue
            usable = self._placement.usable_free(self.max_model_len)
        else:
            usable = free_total
        slack = self._placed_total - self._reserved
        return MemoryBreakdown(self.capacity_tokens, self.tokens_held, self._fill_target - self.tokens_held,
                               self._reserved - self._fill_target, slack + free_total - usable, usable, 0,
                               self._placed_total)

    # ----------------------------------------------------------------- mutations
    def _place(self, seq: Sequence, size: int) -> int:
        start = self._placement.alloc(size)
        placed = self._placement.placed_size(size)
        seq.region = (start, size)
        self._seqs[seq.seq_id] = seq
        self._placed[seq.seq_id] = placed
        self.tokens_held += seq.num_tokens
        self._reserved += size
        self._fill_target += min(seq.final_len or size, size)
        self._placed_total += placed
        if self.events is not None:
            self.events.acquire_region(start, placed, seq.request_id, seq.seq_id)
        return start

    def _unplace(self, seq: Sequence) -> None:
        start, size = seq.region
        self._placement.free(start)
        self.tokens_held -= seq.num_tokens
        self._reserved -= size
        self._fill_target -= min(seq.final_len or size, size)
        self._placed_total -= self._placed.pop(seq.seq_id)
        del self._seqs[seq.seq_id]
        seq.region = None
        if self.events is not None:
            self.events.release_region(start, seq.num_tokens)

    def allocate(self, group: SequenceGroup, num_new_tokens: int | None = None) -> int:
        """Place one region per live sequence (no sharing between them); return 0 cached tokens."""
        seqs = group.live_seqs()
        for s in seqs:
            if s.seq_id in self._seqs or s.seq_id in self._cpu_seqs:
                raise AllocationError(f"sequence {s.seq_id} already holds a region")
        status = self.can_allocate(group)
        if status is not AllocStatus.OK:
            raise AllocationError(f"request {group.request_id}: cannot place {len(seqs)} region(s) of "
                                  f"{self.reservation(seqs[0])} slots now ({status.value})")
        for s in seqs:
            s.num_tokens = s.length
            s.num_cached_tokens = 0
            self._place(s, self.reservation(s))
        self._check()
        return 0

    def append_slot(self, seq: Sequence, num_tokens: int = 1) -> list[tuple[int, ...]]:
        """Fill `num_tokens` more reserved slots; nothing is ever copied."""
        if seq.seq_id not in self._seqs or seq.status is SequenceStatus.FINISHED:
            raise AllocationError(f"cannot append to sequence {seq.seq_id}: it holds no region "
                                  f"({seq.status.value})")
        if num_tokens < 0:
            raise AllocationError(f"cannot append a negative number of tokens ({num_tokens})")
        if seq.num_tokens + num_tokens > seq.region[1]:
            raise AllocationError(f"sequence {seq.seq_id} would outgrow its {seq.region[1]}-slot region")
        if seq.num_tokens + num_tokens > seq._limit:
            raise AllocationError(f"sequence {seq.seq_id} would grow past its final length {seq.final_len}")
        seq.num_tokens += num_tokens
        self.tokens_held += num_tokens
        self._check()
        return []

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, ...]]:
        """Give `child` its own region and copy the parent's tokens into it."""
        if parent.seq_id not in self._seqs:
            raise AllocationError(f"cannot fork sequence {parent.seq_id}: it holds no region")
        if child.seq_id in self._seqs:
            raise AllocationError(f"cannot fork into sequence {child.seq_id}: it already holds a region")
        child.num_tokens = parent.num_tokens
        start = self._place(child, parent.region[1])
        self._check()
        return [(parent.region[0], start, parent.num_tokens)]

    def free(self, seq: Sequence) -> None:
        """Release the sequence's region (device or CPU)."""
        if seq.seq_id in self._seqs:
            self._unplace(seq)
        elif seq.seq_id in self._cpu_seqs:
            self._cpu.free(self._cpu_seqs.pop(seq.seq_id)[0])
        else:
            raise AllocationError(f"cannot free sequence {seq.seq_id}: it holds no region (freed twice?)")
        seq.num_tokens = 0
        self._check()

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, ...]]:
        """Copy each live sequence's tokens to the CPU pool and release its region."""
        if not self.can_swap_out(group):
            raise AllocationError(f"request {group.request_id}: CPU swap pool cannot hold it")
        cpu_starts = {s.seq_id: self._cpu.alloc(n) for s, n in self._swap_order(group)}
        copies = []
        for s in [s for s in group.seqs if s.seq_id in cpu_starts]:  # in the group's order
            copies.append((s.region[0], cpu_starts[s.seq_id], s.num_tokens))
            self._cpu_seqs[s.seq_id] = (cpu_starts[s.seq_id], s.num_tokens)
            self._unplace(s)
        self._check()
        return copies

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, ...]]:
        """Reserve fresh regions and copy the tokens back from the CPU pool."""
        if self.can_swap_in(group) is not AllocStatus.OK:
            raise AllocationError(f"request {group.request_id}: no room to swap back in")
        copies = []
        for s in [s for s in group.seqs if s.seq_id in self._cpu_seqs]:
            cpu_start, n = self._cpu_seqs.pop(s.seq_id)
            self._cpu.free(cpu_start)
            start = self._place(s, self.reservation(s))
            copies.append((cpu_start, start, n))
        self._check()
        return copies

    def _check(self) -> None:
        if self.debug:
            from simulator.core.invariants import check_contiguous

            check_contiguous(self)



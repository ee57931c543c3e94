"""Iteration-level (continuous) batching, shared by the simulator and the GPU engine.

Each call to `schedule()` decides one step: running groups first (each live sequence gets the slot
for its newest token; when memory runs out the most recently admitted group is preempted), then
swapped groups come back, then waiting groups are admitted first-come first-served. The caller runs
the step (simulated or on the device), records sampled tokens, and calls `finish_seq` for sequences
that are done.

When every running group is a plain decode, `decode_step` takes the same step in O(what changes): the
decode batch (decode.py, decode_groups.py for KV cache groups) hands out new blocks in bulk and counts
tokens lazily; `finish_groups` removes the groups it reports finished (or that a caller finished early,
once `DecodeBatch.remove` let them go). Fast mode and the engine (gpu_backend/engine/decode_step.py) do.
"""
from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from simulator.core.allocator import AllocStatus, KVAllocator
from simulator.core.decode import DecodeBatch
from simulator.core.decode_groups import GroupedDecodeBatch
from simulator.core.errors import ConfigError
from simulator.core.sequence import RunningGroups, Sequence, SequenceGroup, SequenceStatus, group_prefill

PREEMPTION_MODES = ("recompute", "swap")


class _Head:
    """What the lengths of the group at the head of the waiting queue decide (Scheduler.head_admission)."""

    __slots__ = ("group", "too_long", "prefill_tokens", "fits_ever")

    def __init__(self, group: SequenceGroup, too_long: bool, prefill_tokens: int) -> None:
        self.group, self.too_long, self.prefill_tokens = group, too_long, prefill_tokens
        self.fits_ever: bool | None = None  # the allocator's can_ever_allocate, once asked


class Admission(enum.Enum):
    """What admission does with the request at the head of the waiting queue."""

    ADMIT = "admit"
    WAIT = "wait"
    REJECT = "reject"


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits and policies."""

    max_num_seqs: int = 256
    # Default: max(max_model_len, 2048) + max_num_seqs, so the longest admissible prompt always fits next to
    # a full batch of decodes (vLLM's max(max_model_len, 2048) lets one long prompt block the queue until the
    # batch drains); 512 when chunking.
    max_num_batched_tokens: int | None = None
    max_model_len: int = 2048
    enable_chunked_prefill: bool = False
    preemption_mode: str = "recompute"

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"preemption mode must be one of {PREEMPTION_MODES}, "
                              f"got {self.preemption_mode!r}")
        if self.max_num_seqs < 1 or self.max_model_len < 1:
            raise ConfigError("max_num_seqs and max_model_len must be >= 1")
        budget = self.token_budget
        if budget < self.max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens ({budget}) must be >= max_num_seqs "
                              f"({self.max_num_seqs}) so every running sequence can decode")
        if not self.enable_chunked_prefill and budget < self.max_model_len:
            raise ConfigError(f"max_num_batched_tokens ({budget}) must be >= max_model_len "
                              f"({self.max_model_len}) unless chunked prefill is enabled")

    @property
    def token_budget(self) -> int:
        """Tokens one step may compute."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 512 if self.enable_chunked_prefill else max(self.max_model_len, 2048) + self.max_num_seqs


@dataclass
class ScheduledGroup:
    """A group's work in one step: a prefill chunk (`num_new_tokens` of its prompt) or one decode token
    per live sequence."""

    group: SequenceGroup
    num_new_tokens: int
    is_prefill: bool
    completes_prefill: bool  # the chunk reaches the end of the prompt, so tokens are sampled


@dataclass
class SchedulerOutput:
    """What to run this step, and the memory operations the engine must perform first."""

    scheduled: list[ScheduledGroup] = field(default_factory=list)
    admitted: list[SequenceGroup] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    rejected: list[SequenceGroup] = field(default_factory=list)
    swapped_in: list[SequenceGroup] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, ...]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, ...]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, ...]] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        """Nothing to compute this step."""
        return not self.scheduled


class Scheduler:
    """FCFS continuous batching over one allocator (paged or contiguous).

    With `output_len` (request id -> tokens it generates: known to a simulation, at most max_tokens in
    the engine), the scheduler also keeps a decode batch (`decode`) for `decode_step`.
    """

    def __init__(self, config: SchedulerConfig, allocator: KVAllocator,
                 output_len: Mapping[int, int] | None = None):
        self.config = config
        self.token_budget = config.token_budget  # tokens one step may compute
        self.allocator = allocator
        self.waiting: deque[SequenceGroup] = deque()
        self.running = RunningGroups()  # admission order: the last one is preempted first
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = 0
        self.prefill_left: dict[int, int] = {}  # request id -> prompt tokens left (prefill or recompute)
        # What the waiting head's lengths decide (too long for the model, prompt tokens, and whether
        # `can_ever_allocate` accepted it): a group does not grow while it waits, so they hold until it
        # leaves the queue (an overloaded run asks about the same head at every step otherwise).
        self._head: _Head | None = None
        self._fresh: tuple[SequenceGroup, int] | None = None  # the last admitted group and its length then
        batch = DecodeBatch if getattr(allocator, "layout", None) is None else GroupedDecodeBatch
        self.decode = None if output_len is None else batch(allocator, self.prefill_left, output_len)

    def add_request(self, group: SequenceGroup) -> None:
        """Queue a new request."""
        for s in group.seqs:
            s.status = SequenceStatus.WAITING
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running or swapped."""
        return bool(self.running or self.waiting or self.swapped)  # running first: its truth is a dict's

    def prefill_tokens(self, seqs: list[Sequence]) -> int:
        """Tokens a (re)admitted group computes, sharing its prompt's blocks as its allocator does."""
        alloc = self.allocator
        return group_prefill(seqs, alloc.block_size if alloc.shares_prompt else 0)

    def schedule(self) -> SchedulerOutput:
        """Decide the next step."""
        out = SchedulerOutput()
        budget = self.config.token_budget
        queue = deque(self.running)
        kept: list[SequenceGroup] = []
        while queue:
            group = queue.popleft()
            left = self.prefill_left.get(group.request_id, 0)
            seqs = group.live_seqs()
            if left:  # a chunked prefill in progress
                chunk = min(left, budget - out.num_batched_tokens)
                if chunk <= 0:
                    kept.append(group)
                    continue
                # An allocator that allocates by chunk (a window's groups) gave slots up to the last
                # chunk's end: this one takes its own first, preempting as a decode would.
                grow = seqs[0].length - left + chunk - seqs[0].num_tokens if len(seqs) == 1 else 0
                if grow > 0:
                    if not self._make_room(group, seqs, grow, queue, kept, out, prompt=True):
                        continue
                    out.blocks_to_copy.extend(self.allocator.append_slot(seqs[0], grow))
                out.scheduled.append(ScheduledGroup(group, chunk, True, chunk == left))
                out.num_batched_tokens += chunk
                # The blocks this chunk completes become prefix-cache hits only now that it runs.
                self.allocator.cache_blocks(group, left - chunk)
                kept.append(group)
                continue
            if self._make_room(group, seqs, 1, queue, kept, out):
                for s in seqs:
                    out.blocks_to_copy.extend(self.allocator.append_slot(s))
                out.scheduled.append(ScheduledGroup(group, len(seqs), False, False))
                out.num_batched_tokens += len(seqs)
                kept.append(group)
        self.running = RunningGroups(kept)
        if not out.preempted:
            self._swap_in(out, budget)
        if not out.preempted and not self.swapped:
            self._admit(out, budget)
        return out

    def _make_room(self, group: SequenceGroup, seqs: list, num_tokens: int, queue: deque,
                   kept: list, out: SchedulerOutput, prompt: bool = False) -> bool:
        """Preempt the latest running groups until every sequence of `group` can grow by `num_tokens`
        (a decode token, or a `prompt` chunk); False when `group` itself was preempted (or dropped)."""
        while not self.allocator.can_append(seqs, num_tokens):
            victim = queue.pop() if queue else group
            if victim is group and not kept and not self.swapped and \
                    (prompt or self._fresh == (group, seqs[0].length)):
                # Alone in the pool and still short of blocks: a prompt chunk, or just (re)admitted (n
                # samples whose tails outgrow it together); recomputed, it would come back here forever.
                # Drop it, as admission refuses a sequence that could never fit.
                self._drop(group, out)
                return False
            self._preempt(victim, out)
            if victim is group:
                return False
        return True

    # ----------------------------------------------------------------- the decode batch
    def decode_ready(self) -> bool:
        """Whether the decode batch holds the running groups (taking them over if all are plain decodes)."""
        batch = self.decode
        return batch is not None and (batch.active or batch.activate(self.running, len(self.swapped)))

    def decode_step(self) -> SchedulerOutput | None:
        """`schedule()` for a step in which every running group decodes (call after `decode_ready`): each
        sequence gets its slot in O(blocks taken), then swapped groups come back and waiting ones are
        admitted. `scheduled` lists only those; `num_batched_tokens` includes the decode tokens. None (the
        batch settled, nothing changed) when a sequence would find no block: `schedule()` decides then."""
        batch = self.decode
        b = batch.size
        if not b or not batch.advance_one():
            batch.deactivate()
            return None
        out = SchedulerOutput(num_batched_tokens=b)
        if self.swapped or self.waiting:
            self._swap_in(out, self.token_budget)
            if not self.swapped:
                self._admit(out, self.token_budget)
        return out

    def finish_groups(self, groups: list[SequenceGroup]) -> None:
        """Remove the given running groups, whose sequences have finished (any still live are finished
        here), without looking at every running group (what `remove_finished` does in O(running))."""
        for g in groups:
            for s in g.seqs:
                if s.status is not SequenceStatus.FINISHED:
                    self.finish_seq(s)
            self.running.remove(g)
            self.prefill_left.pop(g.request_id, None)

    def _swap_in(self, out: SchedulerOutput, budget: int) -> None:
        while self.swapped:
            group = self.swapped[0]
            seqs = group.live_seqs()
            # A group wider than the whole budget comes back into an otherwise empty step: running groups
            # decode every sequence whatever the budget, so it ran before it was swapped out.
            if len(self.running) >= self.config.max_num_seqs or (
                    out.num_batched_tokens + len(seqs) > budget and out.num_batched_tokens):
                return
            status = self.allocator.can_swap_in(group)
            if status is AllocStatus.NEVER:  # it outgrew the pool: it would wait forever (as vLLM: drop it)
                self.swapped.popleft()
                self._reject(group, out)
                continue
            if status is AllocStatus.LATER:
                return
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.allocator.swap_in(group))
            for s in seqs:
                s.status = SequenceStatus.RUNNING
                out.blocks_to_copy.extend(self.allocator.append_slot(s))
            out.swapped_in.append(group)
            out.scheduled.append(ScheduledGroup(group, len(seqs), False, False))
            out.num_batched_tokens += len(seqs)
            self.running.append(group)

    def head_admission(self, room: int) -> Admission:
        """What admission would do now with the request at the head of the queue, given `room` tokens
        left in this step's budget (a query: nothing changes but the memo of what the head's lengths decide).
        WAIT is stable while memory only shrinks and the running set does not change, which lets the
        simulator skip steps (spans, simulator/loop/step.py)."""
        group = self.waiting[0]
        head = self._head
        if head is None or head.group is not group:
            seqs = group.live_seqs()
            limit = self.config.max_model_len
            prefill = self.prefill_tokens(seqs)
            # Diverged sequences re-admitted without chunking compute their tokens in one step: more than a
            # step's budget could never be scheduled.
            too_long = seqs[0].length > limit or (seqs[0].final_len or 0) > limit or (
                prefill > self.token_budget and not self.config.enable_chunked_prefill)
            head = self._head = _Head(group, too_long, prefill)
        if head.too_long:
            return Admission.REJECT
        if len(self.running) >= self.config.max_num_seqs or room <= 0 or \
                (not self.config.enable_chunked_prefill and head.prefill_tokens > room):
            # No seat, or the whole prompt must fit in this step's token budget and does not: it waits
            # whatever memory is free now (only NEVER would reject it), the cheap question.
            return Admission.WAIT if self._can_ever_allocate(head) else Admission.REJECT
        status = self.allocator.can_allocate(group, room if self.config.enable_chunked_prefill else None)
        if status is AllocStatus.NEVER:
            return Admission.REJECT
        if status is AllocStatus.LATER:
            return Admission.WAIT
        return Admission.ADMIT

    def _can_ever_allocate(self, head: _Head) -> bool:
        """The allocator's `can_ever_allocate`, asked once while the group heads the queue."""
        if head.fits_ever is None:
            head.fits_ever = self.allocator.can_ever_allocate(head.group)
        return head.fits_ever

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        waiting = self.waiting
        while waiting:
            room = budget - out.num_batched_tokens
            decision = self.head_admission(room)
            if decision is Admission.WAIT:
                return
            group, head = waiting.popleft(), self._head  # head_admission just judged this group
            self._head = None
            if decision is Admission.REJECT:
                self._reject(group, out)
                continue
            seqs = group.live_seqs()
            need = head.prefill_tokens
            # Only the blocks this step computes are published (the budget caps the first chunk).
            hit = self.allocator.allocate(group, room)
            self._fresh = (group, seqs[0].length)  # no token decoded since (see schedule)
            if group.prefix_hit_tokens is None:
                group.prefix_hit_tokens = hit
            left = max(1, need - hit)
            chunk = min(left, room)
            for s in seqs:
                s.status = SequenceStatus.RUNNING
            self.prefill_left[group.request_id] = left
            out.admitted.append(group)
            out.scheduled.append(ScheduledGroup(group, chunk, True, chunk == left))
            out.num_batched_tokens += chunk
            self.running.append(group)

    def _reject(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        for s in group.seqs:
            if s.status is SequenceStatus.SWAPPED:
                self.allocator.free(s)
            s.status = SequenceStatus.FINISHED
        out.rejected.append(group)

    def _drop(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Reject a running group: its blocks go back to the pool."""
        for s in group.live_seqs():
            self.allocator.free(s)
        self._reject(group, out)

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Swap the group out if configured and possible, else free it for recomputation."""
        self.num_preemptions += 1
        out.preempted.append(group)
        mid_prefill = self.prefill_left.pop(group.request_id, None) is not None
        seqs = group.live_seqs()
        # A partly computed prompt is not worth swapping (and its progress would be lost): recompute it.
        if self.config.preemption_mode == "swap" and not mid_prefill and self.allocator.can_swap_out(group):
            out.blocks_to_swap_out.extend(self.allocator.swap_out(group))
            for s in seqs:
                s.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            return
        for s in seqs:
            self.allocator.free(s)
            s.status = SequenceStatus.WAITING
        self.waiting.appendleft(group)

    def commit(self, out: SchedulerOutput) -> None:
        """Account for the step having run: prefill chunks are now computed."""
        for sg in out.scheduled:
            if sg.is_prefill:
                rid = sg.group.request_id
                left = self.prefill_left[rid] - sg.num_new_tokens
                if left:
                    self.prefill_left[rid] = left
                else:
                    del self.prefill_left[rid]

    def finish_seq(self, seq: Sequence) -> None:
        """Free a finished sequence; drop its group from the running list once all are done."""
        self.allocator.free(seq)
        seq.status = SequenceStatus.FINISHED

    def remove_finished(self) -> list[SequenceGroup]:
        """Remove and return groups whose sequences have all finished."""
        done = [g for g in self.running if g.is_finished]
        if done:
            self.running = RunningGroups(g for g in self.running if not g.is_finished)
            for g in done:
                self.prefill_left.pop(g.request_id, None)
        return done

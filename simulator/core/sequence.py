"""Sequences and sequence groups: what the allocators and the scheduler manage."""
from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable
from collections.abc import Sequence as SeqLike


class SequenceStatus(enum.Enum):
    """Lifecycle of one decoding stream."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class Sequence:
    """One decoding stream.

    In the engine `token_ids` holds real tokens; in simulation it is None and the sequence is just counts
    plus `prefix_keys`, the content keys of its first full prompt blocks (at the allocator's block size).
    `length` is the logical length (prompt + generated tokens). `num_tokens` is the number of tokens that
    hold a KV slot: `allocate` gives slots to all `length` tokens, `append_slot` one more (as in vLLM, the
    token sampled in one step gets its slot when the next step schedules it). `final_len` is the most
    slots the sequence will ever hold (prompt + output - 1: the last sampled token is never stored).
    `extra_key` is what else a block's content depends on (a LoRA adapter, say): part of every prefix key.
    """

    __slots__ = ("seq_id", "request_id", "prompt_len", "final_len", "token_ids", "prefix_keys",
                 "extra_key", "num_tokens", "num_computed_tokens", "num_cached_tokens", "status",
                 "block_table",
                 "cpu_block_table", "region", "_internal_counted", "_limit", "num_generated")

    def __init__(self, seq_id: int, prompt_len: int, final_len: int | None = None, *,
                 request_id: int | None = None, token_ids: list[int] | None = None,
                 prefix_keys: SeqLike[Hashable] = (), extra_key: Hashable = 0):
        if token_ids is not None and len(token_ids) < prompt_len:
            from simulator.core.errors import AllocationError
            raise AllocationError(
                f"sequence {seq_id}: {len(token_ids)} token ids for a {prompt_len}-token prompt")
        if prompt_len < 1:
            from simulator.core.errors import AllocationError
            raise AllocationError(f"sequence {seq_id}: prompt_len must be >= 1, got {prompt_len}")
        if final_len is not None and final_len < prompt_len:
            from simulator.core.errors import AllocationError
            raise AllocationError(
                f"sequence {seq_id}: final_len {final_len} is shorter than prompt_len {prompt_len}")
        self.seq_id = seq_id
        self.request_id = seq_id if request_id is None else request_id
        self.prompt_len = prompt_len
        # The length the sequence will reach when it finishes (known from a trace, or max_tokens);
        # the taxonomy needs it to split empty slots into reservation and internal fragmentation.
        self.final_len = final_len
        self._limit = final_len if final_len is not None else 1 << 62  # allocators refuse growth past it
        self.token_ids = token_ids
        self.prefix_keys = tuple(prefix_keys)
        self.extra_key = extra_key
        self.num_generated = 0 if token_ids is None else len(token_ids) - prompt_len
        self.num_tokens = 0
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # tokens its last allocation did not compute: prefix-cache hits, or a
        # diverged group's shared prompt blocks (set by the allocator)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.cpu_block_table: list[int] = []
        self.region: tuple[int, int] | None = None  # contiguous allocator: (start, reserved slots)
        self._internal_counted = 0

    def block_content(self, index: int, block_size: int) -> Hashable | None:
        """Content key of full block `index`, or None when the content is unknown (simulated decode)."""
        if self.token_ids is not None:
            start = index * block_size
            return tuple(self.token_ids[start:start + block_size])
        if index < len(self.prefix_keys):
            return self.prefix_keys[index]
        return None

    def fork(self, seq_id: int) -> Sequence:
        """A copy that will share this sequence's blocks once the allocator forks it."""
        child = Sequence(seq_id, self.prompt_len, self.final_len, request_id=self.request_id,
                         token_ids=None if self.token_ids is None else list(self.token_ids),
                         prefix_keys=self.prefix_keys, extra_key=self.extra_key)
        child.num_generated = self.num_generated
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        return child

    @property
    def is_finished(self) -> bool:
        """Whether the sequence has finished."""
        return self.status is SequenceStatus.FINISHED

    @property
    def length(self) -> int:
        """Prompt plus generated tokens."""
        return self.prompt_len + self.num_generated

    def append_token(self, token_id: int | None = None) -> None:
        """Record one generated token (its KV slot comes with the next `append_slot`)."""
        self.num_generated += 1
        if self.token_ids is not None:
            self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id}, tokens={self.num_tokens}/"
                f"{self.final_len}, {self.status.value}, blocks={self.block_table})")


class SequenceGroup:
    """The sequences of one request: n parallel samples or a beam. They share prompt blocks."""

    __slots__ = ("request_id", "seqs", "arrival_s", "prompt_len", "n", "beam_width", "prefix_hit_tokens")

    def __init__(self, request_id: int, seqs: list[Sequence], arrival_s: float = 0.0,
                 n: int = 1, beam_width: int = 1):
        if not seqs:
            from simulator.core.errors import AllocationError
            raise AllocationError(f"request {request_id}: a sequence group needs at least one sequence")
        self.request_id = request_id
        self.seqs = seqs
        self.arrival_s = arrival_s
        self.prompt_len = seqs[0].prompt_len
        self.n = n
        self.beam_width = beam_width
        self.prefix_hit_tokens: int | None = None  # prompt tokens found cached at the first admission

    @property
    def readmitted(self) -> bool:
        """Admitted before, then preempted and recomputed (vLLM v1's `num_preemptions > 0` at a lookup)."""
        return self.prefix_hit_tokens is not None

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        """The group's sequences, optionally only those with `status`."""
        if status is None:
            return list(self.seqs)
        return [s for s in self.seqs if s.status is status]

    def live_seqs(self) -> list[Sequence]:
        """Sequences not yet finished (a list the caller must not change)."""
        seqs = self.seqs
        if len(seqs) == 1 and seqs[0].status is not SequenceStatus.FINISHED:
            return seqs  # the common single sequence: no copy
        return [s for s in seqs if s.status is not SequenceStatus.FINISHED]

    @property
    def is_finished(self) -> bool:
        """Whether every sequence of the group has finished."""
        return all(s.status is SequenceStatus.FINISHED for s in self.seqs)

    def __repr__(self) -> str:
        return f"SequenceGroup(req={self.request_id}, seqs={[s.seq_id for s in self.seqs]})"


def shares_allocation(seqs: list[Sequence]) -> bool:
    """Whether the sequences can share one allocation (the same tokens so far). Sequences whose tokens are
    not known (simulated samples and beams) have the same tokens only until they generate: their outputs
    differ."""
    first = seqs[0]
    if first.token_ids is None:
        return all(s.num_generated == 0 and s.length == first.length for s in seqs)
    return all(s.length == first.length and s.token_ids == first.token_ids for s in seqs)


def shared_prompt_blocks(seqs: list[Sequence], block_size: int) -> int:
    """Blocks that the diverged sequences of one group (re-admitted after a recompute) still hold in
    common: simulated ones share their prompt's full blocks, as samples run as separate requests share
    them through the prefix cache; none when `block_size` is 0 (an allocator that shares no memory) or
    the tokens are known (the prefix cache finds what is common)."""
    if not block_size or seqs[0].token_ids is not None:
        return 0
    return seqs[0].prompt_len // block_size


def group_prefill(seqs: list[Sequence], block_size: int) -> int:
    """Tokens a (re)admitted group computes: one shared prompt, or each diverged sequence past the prompt
    blocks they share (`shared_prompt_blocks`)."""
    if len(seqs) == 1 or shares_allocation(seqs):
        return seqs[0].length
    return sum(s.length for s in seqs) - shared_prompt_blocks(seqs, block_size) * block_size * (len(seqs) - 1)


class RunningGroups(dict):
    """Groups in admission order (the last one is preempted first); iterate, index, append, remove.

    An insertion-ordered dict keyed by the group (values None): a finished group sits anywhere in
    admission order, and leaves in O(1) where `list.remove` would scan half of a full batch every step.
    Length, truth, membership and iteration are the dict's own, so the scheduler's many checks of
    them cost no Python call.
    """

    __slots__ = ()

    def __init__(self, groups: Iterable[SequenceGroup] = ()) -> None:
        super().__init__(dict.fromkeys(groups))

    def __getitem__(self, index: int | slice) -> SequenceGroup | list[SequenceGroup]:
        """By position, as a list would (O(n): for inspection, not for the scheduler's loops)."""
        return list(self)[index]

    def __add__(self, other: Iterable[SequenceGroup]) -> list[SequenceGroup]:
        return [*self, *other]

    def __radd__(self, other: Iterable[SequenceGroup]) -> list[SequenceGroup]:
        return [*other, *self]

    def append(self, group: SequenceGroup) -> None:
        """Add a group at the end (the newest)."""
        if group in self:
            raise ValueError(f"request {group.request_id} is already running")
        self[group] = None

    def remove(self, group: SequenceGroup) -> None:
        """Drop a group wherever it is."""
        try:
            del self[group]
        except KeyError:
            raise ValueError(f"request {group.request_id} is not running") from None

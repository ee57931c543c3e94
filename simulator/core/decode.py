"""The running plain decodes, advanced in O(what changes) per step instead of O(running sequences).

While every running request is a plain decode (one live sequence, no beam, no prefill left, nothing
swapped), each step gives every sequence one more token. The Scheduler takes such a step with
`decode_step` (the simulator's fast mode does, and spans of steps with `advance`). Instead of touching
every sequence each step, the batch keeps a global count of decode steps ("phase" D) and, per sequence,
the offsets that turn it into the sequence's token and generated counts: num_tokens = D + o,
num_generated = D + g. Per step, only what changes is visited:

- block boundaries: a sequence needs a fresh block when num_tokens % block_size == 0 before its append,
  i.e. when D % block_size == (-o) % block_size, so sequences are bucketed by that residue (each bucket
  in running order, the order in which step mode's scheduler takes their blocks);
- completions: the phase at which num_generated reaches the request's output length;
- final blocks: the phase at which a sequence takes its last block (internal fragmentation appears).

The counts live only here until the batch settles a sequence (`settle`): before it finishes, and for all
of them before any exact step (`deactivate`). Sums the step-time and memory models need (tokens held,
context lengths) are kept as running totals.

The engine's sequences hold real tokens, so the block a decode append fills is published to the prefix
cache, as `append_slot` does (only sequences of `block_size` residue visited per step). Their output length
is a bound (`max_tokens`): the engine finishes a request that samples EOS earlier with `remove`. A request
whose id is absent from `output_len` never joins (the engine leaves out beams and parallel samples).
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping

from simulator.core.allocator import KVAllocator
from simulator.core.invariants import check_invariants
from simulator.core.paged.block_manager import BlockManager
from simulator.core.sequence import Sequence, SequenceGroup, SequenceStatus


class DecodeBatch:
    """The running plain decodes, with lazily advanced token counts and their known output lengths."""

    grouped = False  # one block table per sequence (decode_groups.py has the batch of KV cache groups)

    def __init__(self, alloc: KVAllocator, prefill_left: Mapping[int, int], output_len: Mapping[int, int]):
        self.alloc = alloc
        self.prefill_left = prefill_left  # the scheduler's: request id -> prompt tokens left to compute
        self.output_len = output_len  # request id -> tokens it generates
        self.paged = isinstance(alloc, BlockManager)
        self.block_size = alloc.block_size if self.paged else 1
        self.eager = alloc.debug  # settle every step and check the allocator's invariants
        # Blocks filled by decode appends are published when their content is known (engine sequences).
        self.publishes = self.paged and alloc.enable_prefix_caching
        self.active = False
        self.phase = 0
        self._reset()

    def _count_tokens(self, num_tokens: int) -> None:
        """Count `num_tokens` more tokens held by the batch's sequences (settled later, one by one)."""
        if self.paged:
            self.alloc.pool.total_filled += num_tokens
        else:
            self.alloc.tokens_held += num_tokens

    def _reset(self) -> None:
        self.size = 0
        self.offset_sum = 0  # sum of o: tokens held by the batch = size * phase + offset_sum
        self.offsets: dict[Sequence, tuple[int, int]] = {}
        self.buckets: list[list[Sequence]] = [[] for _ in range(self.block_size)]
        self.finish_at: dict[int, list[SequenceGroup]] = {}
        self.finish_heap: list[int] = []
        self.waste_at: dict[int, int] = {}  # phase -> internal-fragmentation slots that appear in it
        self.keyed = 0  # members whose tokens are known (their filled blocks are published)

    # ----------------------------------------------------------------- membership
    def activate(self, running: Iterable[SequenceGroup], num_swapped: int) -> bool:
        """Take over the running groups if all of them are plain decodes (else stay inactive)."""
        if num_swapped or self.prefill_left:
            return False
        for g in running:
            if not self._joinable(g):
                return False
        self.active = True
        for g in running:
            self._add(g)
        return True

    def _joinable(self, g: SequenceGroup) -> bool:
        if g.beam_width > 1 or len(g.seqs) != 1 or g.request_id in self.prefill_left:
            return False
        s = g.seqs[0]
        out = self.output_len.get(g.request_id)
        if s.status is not SequenceStatus.RUNNING or out is None or s.final_len is None:
            return False
        left = out - s.num_generated
        n = s.num_tokens
        # It must finish before it could outgrow its final length (or its contiguous region).
        if left < 1 or n + left > (s.final_len if self.paged else min(s.final_len, s.region[1])):
            return False
        # A shared partial last block is copied by the next append: an exact step does that.
        return not (self.paged and n % self.block_size and self.alloc.pool.ref[s.block_table[-1]] > 1)

    def _add(self, g: SequenceGroup) -> None:
        s = g.seqs[0]
        d = self.phase
        o = s.num_tokens - d
        self.offsets[s] = (o, s.num_generated - d)
        self.size += 1
        self.offset_sum += o
        if s.token_ids is not None:
            self.keyed += 1
        fin = d + self.output_len[g.request_id] - s.num_generated
        lst = self.finish_at.get(fin)
        if lst is None:
            self.finish_at[fin] = [g]
            heapq.heappush(self.finish_heap, fin)
        else:
            lst.append(g)
        if self.paged:
            bs = self.block_size
            self.buckets[-o % bs].append(s)
            num_final = -(-s.final_len // bs)
            if len(s.block_table) < num_final and not s._internal_counted:
                at = (num_final - 1) * bs - o  # the phase whose append takes the final block
                self.waste_at[at] = self.waste_at.get(at, 0) + num_final * bs - s.final_len

    def join(self, groups: list[SequenceGroup]) -> None:
        """Add groups that just finished their prefill (in running order), or give up on them all."""
        for g in groups:
            if not self._joinable(g):
                self.deactivate()
                return
        for g in groups:
            self._add(g)

    def settle(self, s: Sequence) -> None:
        """Write the sequence's current counts back to it (and to its last block)."""
        o, og = self.offsets[s]
        n = self.phase + o
        s.num_tokens = n
        if self.paged:  # the fill of its (unshared) last block
            table = s.block_table
            self.alloc.pool.filled[table[-1]] = n - (len(table) - 1) * self.block_size
        s.num_generated = self.phase + og

    def settle_all(self) -> None:
        """Write every sequence's counts back (the objects are then exact, the batch stays active)."""
        for s in self.offsets:
            self.settle(s)

    def deactivate(self) -> None:
        """Settle everything and stop: the objects are the truth again (for an exact step)."""
        if self.active:
            self.settle_all()
            self.active = False
            self._reset()

    # ----------------------------------------------------------------- advancing
    def steps_within(self, num_free_blocks: int) -> int:
        """How many decode steps from here need at most `num_free_blocks` new blocks."""
        b, bs = self.size, self.block_size
        cycles = num_free_blocks // b  # every block_size steps, every sequence takes one block
        left = num_free_blocks - cycles * b
        extra = 0
        for j in range(bs):
            n = len(self.buckets[(self.phase + j) % bs])
            if n > left:
                break
            left -= n
            extra += 1
        return cycles * bs + extra

    def advance_one(self) -> bool:
        """One decode step's appends, if the free blocks cover them (else False, and nothing happened)."""
        d = self.phase
        if self.paged:
            due = self.buckets[d % self.block_size]
            if due:
                alloc = self.alloc
                if len(due) > alloc.num_free_blocks:
                    return False
                append_blocks(alloc, due)
            if self.waste_at:
                self.waste_at.pop(d, None)
            if self.keyed and self.publishes:
                self._publish_filled(d + 1)
        self._count_tokens(self.size)
        self.phase = d + 1
        if self.eager:
            self.settle_all()
            check_invariants(self.alloc)
        return True

    def advance(self, k: int, times: list[float] | None = None) -> list[Sequence]:
        """Run `k` decode steps' appends (k > 1 only in spans, with each step's start time in `times`
        when events are recorded); return the sequences that took a block, in the order they took them."""
        d, bs, b = self.phase, self.block_size, self.size
        if k > 1 and self.keyed:
            raise ValueError("a span needs the tokens of every step: sequences with real tokens advance "
                             "one step at a time")
        due: list[Sequence] = []
        if self.paged:
            buckets = self.buckets
            if k == 1:
                due = buckets[d % bs]
                block_times = None
            else:
                cycle = [s for j in range(min(k, bs)) for s in buckets[(d + j) % bs]]
                due = cycle * (k // bs) if k >= bs else cycle
                if k > bs and k % bs:
                    due = due + [s for j in range(k % bs) for s in buckets[(d + j) % bs]]
                block_times = None
                if times is not None:
                    block_times = [t for j, t in enumerate(times) for _ in buckets[(d + j) % bs]]
            if due:
                append_blocks(self.alloc, due, block_times)
            waste = self.waste_at
            if waste:  # the phases just run are past: forget their entries
                past = range(d, d + k) if k <= len(waste) else [p for p in waste if d <= p < d + k]
                for p in past:
                    waste.pop(p, None)
            if self.keyed and self.publishes:
                self._publish_filled(d + 1)
        self._count_tokens(b * k)
        self.phase = d + k
        if self.eager:
            self.settle_all()
            check_invariants(self.alloc)
        return due

    def _publish_filled(self, phase: int) -> None:
        """Publish the block each member filled with the append that brings the batch to `phase` (those
        whose token count is then a multiple of the block size), as `append_slot` would."""
        bs, offsets = self.block_size, self.offsets
        publish = self.alloc.prefix_cache.publish
        for s in self.buckets[phase % bs]:
            if s.token_ids is not None:
                index = (phase + offsets[s][0]) // bs - 1
                publish(s, index, s.block_table[index])

    def remove(self, groups: list[SequenceGroup]) -> None:
        """Settle and drop members the caller finished before their output length (the engine's EOS); their
        predicted completion is forgotten. The caller then finishes them (`Scheduler.finish_groups`)."""
        bs = self.block_size
        for g in groups:
            s = g.seqs[0]
            self.settle(s)
            o, og = self.offsets.pop(s)
            self.size -= 1
            self.offset_sum -= o
            if s.token_ids is not None:
                self.keyed -= 1
            fin = self.output_len[g.request_id] - og  # the phase `_add` filed it under
            lst = self.finish_at[fin]
            lst.remove(g)
            if not lst:
                del self.finish_at[fin]
                self.finish_heap.remove(fin)
                heapq.heapify(self.finish_heap)
            if self.paged:
                self.buckets[-o % bs].remove(s)
                num_final = -(-s.final_len // bs)
                at = (num_final - 1) * bs - o
                if len(s.block_table) < num_final and at in self.waste_at:  # its final block not taken
                    left = self.waste_at[at] - (num_final * bs - s.final_len)
                    if left:
                        self.waste_at[at] = left
                    else:
                        del self.waste_at[at]

    def pop_finished(self) -> list[SequenceGroup]:
        """Groups whose last token came out in the step just run (in running order), settled and removed."""
        lst = self.finish_at.pop(self.phase, None)
        if lst is None:
            return []
        heapq.heappop(self.finish_heap)
        bs = self.block_size
        for g in lst:
            s = g.seqs[0]
            self.settle(s)
            o, _ = self.offsets.pop(s)
            self.size -= 1
            self.offset_sum -= o
            if s.token_ids is not None:
                self.keyed -= 1
            if self.paged:
                self.buckets[-o % bs].remove(s)
        return lst

    @property
    def tokens(self) -> int:
        """Tokens the batch's sequences hold now (the sum of their context lengths)."""
        return self.size * self.phase + self.offset_sum

    @property
    def next_finish(self) -> int:
        """Steps from here to the first completion (that step included)."""
        return self.finish_heap[0] - self.phase


def append_blocks(bm: BlockManager, seqs: list[Sequence], times: list[float] | None = None) -> None:
    """Give each of `seqs`, in order, the fresh block its next token needs (its last block is full), as
    `append_slot` does; a sequence may appear again for a later step. The batch counts the tokens itself."""
    pool = bm.pool
    if pool.events is not None:
        rids, sids = [s.request_id for s in seqs], [s.seq_id for s in seqs]
    else:
        rids = sids = 0
    new = pool.take(len(seqs), rids, sids, times)
    filled, bs = pool.filled, bm.block_size
    for s, bid in zip(seqs, new, strict=True):
        table = s.block_table
        filled[table[-1]] = bs
        filled[bid] = 1
        table.append(bid)
        # `_limit` is the final length, or 2^62 when unknown: one attribute read on the common path.
        if len(table) * bs >= s._limit and not s._internal_counted:
            bm.count_internal(s)

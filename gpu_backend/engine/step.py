"""Turning one SchedulerOutput into the packed forward inputs, and logits rows back into per-sequence rows.

Conventions of the shared scheduler (see simulator/core/scheduler.py) this relies on:
- a decoding sequence already got the slot of its newest token, so it computes exactly that token, at
  position `num_tokens - 1`;
- a prefill chunk of a group whose sequences share one allocation covers positions
  [length - left, length - left + chunk) of the first sequence (`left` = `prefill_left` before commit),
  prefix-cache hits already excluded;
- sequences that diverged (a sampled or beam group re-admitted after a recompute preemption) are
  allocated one by one by the BlockManager, each with its own prefix-cache hit; the engine prefills
  each of them (see `_plan_diverged_prefill`).
`seq.num_computed_tokens` (which the simulator never reads) holds how many of a sequence's tokens have
their K/V in the pool.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gpu_backend.cache_engine import CacheEngine
from gpu_backend.engine.input_batch import SequenceInput
from gpu_backend.engine.params import RequestOutput
from simulator.core.allocator import MemoryBreakdown
from simulator.core.scheduler import ScheduledGroup, SchedulerOutput
from simulator.core.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class StepResult:
    """What one engine step did (the replay records it; `generate` only collects `finished`).

    `out` is the scheduler's decision; a step of the decode batch (decode_step.py) schedules only what it
    admits (`out.scheduled`), its decodes are counted in `out.num_batched_tokens` and `q_lens`.
    """

    out: SchedulerOutput
    counts: tuple[int, int, int]  # running, waiting, swapped requests right after scheduling
    breakdown: MemoryBreakdown | None  # memory taxonomy right after scheduling (when tracked)
    finished: list[RequestOutput] = field(default_factory=list)
    first_token: list[int] = field(default_factory=list)  # requests that sampled their first token
    later_token: list[int] = field(default_factory=list)  # ... a later one (outside the decode batch)
    num_batch_tokens: int = 0  # tokens the decode batch's rows sampled, each one step after the last
    num_computed_tokens: int = 0  # tokens in the forward (the scheduler's budget may count fewer)
    # Per sequence input of the forward: tokens computed and context attended over (the step-latency
    # model's inputs, docs/calibration.md; the replay writes them into its steps table).
    q_lens: list[int] | np.ndarray = field(default_factory=list)
    context_lens: list[int] | np.ndarray = field(default_factory=list)

    @property
    def ran(self) -> bool:
        """Whether the step ran a forward (an empty schedule runs none)."""
        return self.num_computed_tokens > 0


def live_seqs(group: SequenceGroup) -> list[Sequence]:
    """The group's unfinished sequences, in order."""
    return [s for s in group.seqs if s.status is not SequenceStatus.FINISHED]


def is_shared(seqs: list[Sequence]) -> bool:
    """Whether the sequences hold identical tokens (one prefill serves all of them)."""
    first = seqs[0]
    return all(s.length == first.length and s.token_ids == first.token_ids for s in seqs)


@dataclass
class StepPlan:
    """The forward inputs of one step and what to do with its logits.

    `sampling` lists, for each group that samples this step, its live sequences and the logits row of
    each (rows >= the forward's row count index `pending` rows kept from earlier steps).
    """

    inputs: list[SequenceInput] = field(default_factory=list)
    sampling: list[tuple[ScheduledGroup, list[Sequence], list[int]]] = field(default_factory=list)
    advance: list[tuple[Sequence, int]] = field(default_factory=list)
    slot_copies: list[tuple[int, int]] = field(default_factory=list)
    keep_rows: list[tuple[int, int]] = field(default_factory=list)  # (seq_id, forward row) for later
    pending: list[torch.Tensor] = field(default_factory=list)
    num_rows: int = 0


def start_prefills(out: SchedulerOutput, prefill_left: dict[int, int]) -> None:
    """Set `num_computed_tokens` of every sequence admitted this step (call before `commit`).

    Sequences that diverged were allocated one by one: each starts after its own prefix-cache hit.
    """
    for group in out.admitted:
        seqs = live_seqs(group)
        if is_shared(seqs):
            left = prefill_left[group.request_id]
            for s in seqs:
                s.num_computed_tokens = s.length - left
            continue
        for s in seqs:
            s.num_computed_tokens = s.num_cached_tokens


def plan_step(out: SchedulerOutput, prefill_left: dict[int, int], cache: CacheEngine,
              pending: dict[int, torch.Tensor]) -> StepPlan:
    """The packed inputs for `out` (before `commit`); `pending` holds logits of finished diverged prefills."""
    plan = StepPlan()
    inputs, advance, block_table = plan.inputs, plan.advance, cache.block_table
    for sg in out.scheduled:
        group = sg.group
        # A one-sequence group that is scheduled is live: skip the filter (the common decode case).
        seqs = group.seqs if len(group.seqs) == 1 else live_seqs(group)
        if not sg.is_prefill:
            rows = []
            for s in seqs:
                last = s.num_tokens - 1
                if s.num_computed_tokens != last or s.num_tokens != s.length:
                    raise RuntimeError(
                        f"sequence {s.seq_id} is scheduled to decode with {s.length} tokens, {s.num_tokens} "
                        f"slots and {s.num_computed_tokens} computed (was a chunked prefill swapped out?)")
                rows.append(plan.num_rows)  # a decode token always asks for logits
                plan.num_rows += 1
                inputs.append(SequenceInput((s.token_ids[-1],), last, block_table(s), 1, s.seq_id))
                advance.append((s, 1))
            plan.sampling.append((sg, seqs, rows))
        elif is_shared(seqs):
            _plan_shared_prefill(plan, sg, seqs, prefill_left[sg.group.request_id], cache)
        else:
            _plan_diverged_prefill(plan, sg, seqs, cache, pending)
    return plan


def _add(plan: StepPlan, seq_input: SequenceInput) -> int:
    """Append an input; return its logits row (or -1 when it asks for none)."""
    plan.inputs.append(seq_input)
    if not seq_input.num_logits:
        return -1
    plan.num_rows += 1
    return plan.num_rows - 1


def _plan_shared_prefill(plan: StepPlan, sg: ScheduledGroup, seqs: list[Sequence], left: int,
                         cache: CacheEngine) -> None:
    first = seqs[0]
    start = first.length - left
    if first.num_computed_tokens != start:
        raise RuntimeError(f"request {sg.group.request_id}: the scheduler resumes its prefill at token "
                           f"{start} but {first.num_computed_tokens} are computed")
    stop = start + sg.num_new_tokens
    row = _add(plan, SequenceInput(first.token_ids[start:stop], start, cache.block_table(first),
                                   int(sg.completes_prefill), first.seq_id))
    for s in seqs:
        plan.advance.append((s, stop - start))
        plan.slot_copies.extend(cache.shared_range_copies(first, s, start, stop))
    if sg.completes_prefill:
        plan.sampling.append((sg, seqs, [row] * len(seqs)))


def _plan_diverged_prefill(plan: StepPlan, sg: ScheduledGroup, seqs: list[Sequence], cache: CacheEngine,
                           pending: dict[int, torch.Tensor]) -> None:
    # The scheduler budgets such a group as one prompt (its sequences have equal lengths), but each
    # sequence needs its own K/V: chunks are spread over the sequences in order, and the chunk that
    # completes the prefill computes whatever is still missing.
    budget = sg.num_new_tokens
    rows: dict[int, int] = {}
    for s in seqs:
        todo = s.length - s.num_computed_tokens
        take = todo if sg.completes_prefill else min(todo, budget)
        if take <= 0:
            continue
        budget -= take
        start = s.num_computed_tokens
        done = take == todo
        row = _add(plan, SequenceInput(s.token_ids[start:start + take], start, cache.block_table(s),
                                       int(done), s.seq_id))
        plan.advance.append((s, take))
        if done:
            rows[s.seq_id] = row
            if not sg.completes_prefill:
                plan.keep_rows.append((s.seq_id, row))
    if not sg.completes_prefill:
        return
    final = []
    for s in seqs:
        if s.seq_id in rows:
            final.append(rows[s.seq_id])
        else:  # finished in an earlier chunk: its logits were kept; indices past the forward's rows
            final.append(-2 - len(plan.pending))
            plan.pending.append(pending.pop(s.seq_id))
    plan.sampling.append((sg, seqs, final))


def resolve_rows(plan: StepPlan, rows: list[int]) -> list[int]:
    """Map plan rows (pending ones are encoded as -2 - k) onto rows of cat(logits, pending)."""
    if not plan.pending:
        return rows
    return [r if r >= 0 else plan.num_rows + (-2 - r) for r in rows]

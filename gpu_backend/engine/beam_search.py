"""Score-based beam search over the shared allocator; the frees and forks are the shared core's.

A beam group keeps `width` live sequences. Each step every distinct beam proposes its 2*width best
continuations; the `width` best of all candidates (score = sum of log-probs) become the next beams.
A beam with no surviving child is freed; a beam with c children keeps one and forks c - 1 that share its
blocks (the next `append_slot` copies the partial last block on write): `simulator.core.beam`, the step
the simulator's fork/prune model takes too. A candidate ending in EOS (unless ignore_eos) becomes a
finished hypothesis when it ranks among the first `width` candidates. Because adding a token never
raises a sum of log-probs, the search stops as soon as `width` finished hypotheses all score at least the
best live beam.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from simulator.core.allocator import KVAllocator
from simulator.core.beam import prune_and_fork
from simulator.core.sequence import Sequence, SequenceGroup

Hypothesis = tuple[float, list[int]]  # (sum of log-probs, generated tokens)


@dataclass
class BeamState:
    """Scores of the live beams (by seq id) and the finished hypotheses of one request."""

    width: int
    prompt_len: int
    scores: dict[int, float] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)

    def generated(self, seq: Sequence) -> list[int]:
        """Tokens a beam has generated so far."""
        return list(seq.token_ids[self.prompt_len:])


def _candidates(state: BeamState, parents: list[Sequence], logprobs: torch.Tensor,
                eos: set[int]) -> list[tuple[float, int, int]]:
    """The best continuations: (score, parent index, token), best first, at most `width` of them."""
    base = torch.tensor([state.scores.get(p.seq_id, 0.0) for p in parents], dtype=logprobs.dtype)
    total = (logprobs + base[:, None]).view(-1)
    k = min(2 * state.width, total.numel())
    values, flat = total.topk(k)
    vocab = logprobs.shape[1]
    chosen = []
    for rank, (score, index) in enumerate(zip(values.tolist(), flat.tolist(), strict=True)):
        parent, token = divmod(index, vocab)
        if token in eos:
            if rank < state.width:
                state.finished.append((score, state.generated(parents[parent]) + [token]))
            continue
        chosen.append((score, parent, token))
        if len(chosen) == state.width:
            break
    return chosen


def beam_step(group: SequenceGroup, seqs: list[Sequence], logprobs: torch.Tensor, state: BeamState, *,
              shared: bool, max_tokens: int, eos: set[int], allocator: KVAllocator,
              finish: Callable[[Sequence], None], new_seq_id: Callable[[], int],
              on_copies: Callable[[list], None]) -> list[Hypothesis] | None:
    """Advance the beams of `group` by one token; return the best `width` hypotheses once it is done.

    `seqs` are the live beams and `logprobs` [len(seqs), vocab] their next-token log-probs; when
    `shared`, all beams hold the same tokens (right after the prefill) and only the first is expanded.
    Done means: `max_tokens` reached, or no live beam can beat `width` finished hypotheses. The caller
    finishes the live beams of a done group; pruned beams are finished here through `finish`.
    """
    parents = seqs[:1] if shared else seqs
    chosen = _candidates(state, parents, logprobs[: len(parents)].float(), eos)
    state.finished.sort(key=lambda h: -h[0])
    del state.finished[state.width:]
    if seqs[0].num_generated + 1 >= max_tokens or not chosen:
        final = state.finished + [(s, state.generated(parents[p]) + [t]) for s, p, t in chosen]
        return sorted(final, key=lambda h: -h[0])[: state.width]
    if len(state.finished) >= state.width and state.finished[-1][0] >= chosen[0][0]:
        return list(state.finished)
    _apply(group, seqs, chosen, state, shared, allocator, finish, new_seq_id, on_copies)
    return None


def _apply(group: SequenceGroup, seqs: list[Sequence], chosen: list[tuple[float, int, int]],
           state: BeamState, shared: bool, allocator: KVAllocator,
           finish: Callable[[Sequence], None], new_seq_id: Callable[[], int],
           on_copies: Callable[[list], None]) -> None:
    """Free beams without children, fork the ones with several, then append every beam's new token."""
    kids: dict[int, list[tuple[float, int]]] = {}  # beam index -> its children's (score, token)
    for i, (s, p, t) in enumerate(chosen):
        # Identical beams (`shared`): child i continues beam i, nothing is forked.
        kids.setdefault(i if shared else p, []).append((s, t))
    owners = [(seqs[i], kids[i]) for i in sorted(kids)]

    def prune(seq: Sequence) -> None:
        state.scores.pop(seq.seq_id, None)
        finish(seq)

    forked = prune_and_fork(group, seqs, [len(kids.get(i, ())) for i in range(len(seqs))],
                            allocator=allocator, finish=prune, new_seq_id=new_seq_id, on_copies=on_copies)
    extra = [child for _, children in owners for child in children[1:]]
    for child, (score, token) in zip(forked, extra, strict=True):
        child.append_token(token)
        state.scores[child.seq_id] = score
    for seq, children in owners:
        score, token = children[0]
        seq.append_token(token)
        state.scores[seq.seq_id] = score

"""A seeded fork/prune model of beam search, so its block sharing can be measured without a model.

After every decode step of a beam group of width k, the next step's k beams are drawn from the current
ones: each beam's share of the continuations comes from a Dirichlet(alpha) draw, and the k children
are assigned to parents by a multinomial draw. Parents with no child are freed (pruned); a parent with
c children keeps one and forks c - 1 (sharing every block; the next append copies the partial last
block on write). Small alpha: few beams survive each step, so the beams share long prefixes (high
sharing); large alpha: most beams survive (little sharing). vLLM's beam search frees and forks in the
same way; only the choice of survivors is random here instead of score-based.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from simulator.core.allocator import KVAllocator
from simulator.core.sequence import SequenceGroup, SequenceStatus


def beam_step(group: SequenceGroup, allocator: KVAllocator, rng: np.random.Generator,
              new_seq_id: Callable[[], int], alpha: float) -> None:
    """Replace the group's live beams by k children of them, freeing pruned ones and forking the rest."""
    beams = [s for s in group.seqs if s.status is not SequenceStatus.FINISHED]
    k = len(beams)
    if k < 2:
        return
    children = rng.multinomial(k, rng.dirichlet(np.full(k, alpha)))
    keep = [b for b, c in zip(beams, children, strict=True) if c > 0]
    for b, c in zip(beams, children, strict=True):
        if c == 0:
            allocator.free(b)
            b.status = SequenceStatus.FINISHED
    new = []
    for b, c in zip(beams, children, strict=True):
        for _ in range(int(c) - 1):
            child = b.fork(new_seq_id())
            allocator.fork(b, child)
            new.append(child)
    group.seqs = keep + new

"""One beam-search step over the allocator: free the beams that got no child, fork the others.

The simulator's seeded fork/prune model (simulator/loop/step.py) and the engine's score-based search
(gpu_backend/engine/beam_search.py) differ only in how they pick each beam's number of children; what is
freed, what is shared and in which order is decided here, once. As in vLLM, a beam with c children keeps
itself as the first and forks c - 1 children that share all its blocks (the next append copies the
partial last block on write), so a paged pool holds the common history of the beams once.
"""
from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Counts

from simulator.core.allocator import KVAllocator
from simulator.core.sequence import Sequence, SequenceGroup


def prune_and_fork(group: SequenceGroup, beams: list[Sequence], num_children: Counts[int], *,
                   allocator: KVAllocator, finish: Callable[[Sequence], None],
                   new_seq_id: Callable[[], int],
                   on_copies: Callable[[list], None] | None = None) -> list[Sequence]:
    """Give `beams[i]` `num_children[i]` children and return the forked ones, parent by parent.

    Beams with no child go through `finish` (which frees them), in beam order; then each beam with c
    children forks c - 1 in beam order, `on_copies` receiving the copies each fork needs (none in a paged
    pool). The group's sequences become the kept beams, then the forked children.
    """
    if len(beams) != len(num_children):
        raise ValueError(f"{len(beams)} beams but {len(num_children)} child counts")
    if any(count < 0 for count in num_children):
        raise ValueError(f"a beam cannot have a negative number of children: {list(num_children)}")
    for beam, count in zip(beams, num_children, strict=True):
        if count == 0:
            finish(beam)
    forked = []
    for beam, count in zip(beams, num_children, strict=True):
        for _ in range(count - 1):
            child = beam.fork(new_seq_id())
            copies = allocator.fork(beam, child)
            if on_copies is not None:
                on_copies(copies)
            forked.append(child)
    group.seqs = [beam for beam, count in zip(beams, num_children, strict=True) if count > 0] + forked
    return forked

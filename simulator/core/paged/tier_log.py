"""The data moves the KV tiers decide, for a driver that keeps real KV data in them (the engine).

tiers.Tiers keeps keys only; the simulator needs no more. A driver that holds each tier block's KV data
attaches a TierLog (`attach_log`): the tiers then record, in the order they decide them, which GPU block
each stored block is copied from, which tier slot moves down to the tier below, which slots are dropped,
and which GPU block each loaded block is copied to. The driver drains the log (`take`) before anything
writes into the GPU pool: a block the pool evicts is often re-allocated to new content in the same step.

Ops, in order:
- ("put", tier, hash, src): the block enters `tier`; its data comes from GPU block `src` (an int) or from
  the tier named `src` (a str), which gives the block up (a spill: the CPU tier's eviction to the disk).
- ("drop", tier, hash): the block leaves `tier` with nowhere to go.
- ["load", tier, hash, dst]: the block is read from `tier` into GPU block `dst`. It is logged when the tiers
  count the hit, before the GPU blocks are taken (`dst` is set then, by `place`); taking them may evict
  GPU blocks whose stores push this one out of its tier later in the same log, so a driver reads the
  slot at the load's place in the log and writes the GPU block after every store of the batch has read
  its own.
- ("placed", loads): the load ops' GPU blocks are taken. A store logged before this from one of those
  blocks stores what the block held before (it was evicted to be taken); one logged after it stores
  the loaded data.
"""
from __future__ import annotations


class TierLog:
    """The ordered data moves of one Tiers (see the module docstring for the ops)."""

    def __init__(self) -> None:
        self.ops: list = []
        # hash -> where its data is while it passes down the tiers: a GPU block (int) or a tier name.
        self.source: dict[int, int | str] = {}
        # (tier, hashes of the batch, those new to the tier) of each store batch under way
        self.frames: list[tuple[object, list[int], set[int]]] = []
        self.unplaced: list[list] = []  # load ops waiting for their GPU block

    def take(self) -> list:
        """The ops logged since the last call (the log is then empty)."""
        ops, self.ops = self.ops, []
        return ops

    # ------------------------------------------------------------ hooks of Tiers
    def entering(self, tier, pairs: list[tuple[int, tuple]]) -> None:
        """`pairs` are about to be stored into `tier`: the tiers below give up the ones they hold."""
        for other in tier.below:
            self.ops.extend(("drop", other.spec.name, h) for h, key in pairs if other.holds(h, key))
        self.frames.append((tier, [h for h, _ in pairs], {h for h, key in pairs if not tier.holds(h, key)}))

    def spilling(self, tier, evicted: list[tuple[int, tuple]]) -> None:
        """`tier` evicted `evicted`: held ones move down with their slot (or are dropped at the bottom);
        ones of the batch being stored that never got in pass on from where their data is."""
        fresh = self.frames[-1][2] if self.frames and self.frames[-1][0] is tier else ()
        name, bottom = tier.spec.name, not tier.below
        for h, _ in evicted:
            if h in fresh:
                fresh.discard(h)
                if bottom:
                    src = self.source.pop(h, None)
                    if isinstance(src, str):
                        self.ops.append(("drop", src, h))
            elif bottom:
                self.ops.append(("drop", name, h))
            else:
                self.source[h] = name

    def entered(self, tier) -> None:
        """The batch stored into `tier` is settled: its new blocks that stayed take their data."""
        _, batch, fresh = self.frames.pop()
        name, source = tier.spec.name, self.source
        for h in fresh:
            self.ops.append(("put", name, h, source.pop(h)))
        for h in batch:  # blocks the tier already held keep their data: nothing to copy
            source.pop(h, None)

    def loading(self, found: list[tuple]) -> None:
        """The tiers count `found` ((tier, hash, key) of `Tiers.match`) as loaded."""
        for tier, h, _ in found:
            op = ["load", tier.spec.name, h, None]
            self.ops.append(op)
            self.unplaced.append(op)

    # ------------------------------------------------------------ hooks of the driver
    def place(self, blocks: list[int]) -> None:
        """The GPU blocks the loads logged since the last call go to, in order."""
        for op, bid in zip(self.unplaced, blocks, strict=True):
            op[3] = bid
        self.ops.append(("placed", self.unplaced))
        self.unplaced = []


def attach_log(bm, log: TierLog) -> None:
    """Record the data moves of the tiers attached to BlockManager `bm` (tiers.attach) into `log`: each
    block the pool hands them is stored at once, from the GPU block it is published in."""
    tiers, pool = bm.tiers, bm.pool
    tiers.log = log
    cached, source, queue, flush = pool.cached, log.source, tiers.hand, tiers.flush

    def hand(hashes: list[int], keys: list[tuple]) -> None:
        for h, key in zip(hashes, keys, strict=True):
            source[h] = cached[h]  # the pool still maps the hash to its block here
            queue([h], [key])
            flush()

    if tiers.eager:
        pool.on_release = hand
    else:
        pool.on_evict = hand

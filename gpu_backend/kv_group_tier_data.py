"""The engine's KV tiers for a model with several KV cache groups: the CPU and disk slots behind a
GroupedBlockManager's pool, kept in step with the core's GroupTiers by its GroupTierLog
(simulator/core/paged/kv_group_tier_log.py).

A slot holds one page of one group: the pool block it came from across the pool's group_size tensors
(group g's i-th layer lives in tensor i, engine/kv_groups.py), so a slot is the `block_bytes` the tiers'
sizes count per page and a page loaded into a fresh block of its group is read by that group's layers.
The slots, the disk file and the batched device copies are kv_tiers.TierData's.
"""
from __future__ import annotations

import torch

from gpu_backend.kv_tiers import TierData
from simulator.core.paged.kv_group_tiers import mask_groups


class GroupTierData(TierData):
    """The data of the CPU and disk tiers of a grouped pool, a slot per (range hash, group) page."""

    def __init__(self, cache, tiers, log, disk_dir: str | None = None) -> None:
        super().__init__(cache, tiers, log, disk_dir)
        self.staged: dict[int, torch.Tensor] = {}  # token -> a handed page read before its frame

    # ----------------------------------------------------------------- queries
    def problems(self) -> list[str]:
        """Where the slots in use differ from the pages the core tiers' entries hold (empty when in step)."""
        out = []
        for tier in self.tiers.tiers:
            slots = self.slots[tier.spec.name]
            pages = {(h, g) for h, e in tier.keys.items() for g in mask_groups(e[2])}
            if set(slots.slot) != pages:
                out.append(f"{slots.name}: {len(slots.slot)} slots in use, {len(pages)} pages held")
            if len(slots.slot) + len(slots.free) != slots.num_slots:
                out.append(f"{slots.name}: {len(slots.slot)} used + {len(slots.free)} free slots != "
                           f"{slots.num_slots}")
        return out

    # ----------------------------------------------------------------- mutations
    def _apply(self, ops: list) -> list[list]:
        """Apply the log's reads, frames and loads to the slots (TierData.run writes what they queue)."""
        loads: list[list] = []  # [tier, slot, GPU block, data read early or None]
        by_dst: dict[int, list] = {}  # GPU block -> the load it holds from here on
        reads: dict[int, int] = {}  # token -> GPU block, pages handed down in this batch
        for op in ops:
            kind = op[0]
            if kind == "read":
                entry = by_dst.get(op[2])
                if entry is None:
                    reads[op[1]] = op[2]
                else:  # the block holds a load not written yet: its data is the load's
                    self._wait_host()
                    self.staged[op[1]] = entry[0].data[entry[1]].clone() if entry[3] is None else entry[3]
            elif kind == "load":
                tier = self.slots[op[1]]
                entry = [tier, tier.slot[op[2]], op[3], None]
                loads.append(entry)
                by_dst[op[3]] = entry
            else:
                self._frame(op[1], op[2], reads, loads)
        if reads:  # pages whose frame comes in a later batch: read before loads or forwards overwrite them
            staging = self._gather(list(reads.values()))
            for j, token in enumerate(reads):
                self.staged[token] = staging[j]
        return loads

    def _frame(self, changes: list, token: int | None, reads: dict[int, int], loads: list[list]) -> None:
        """Apply one frame: read every moving page, free the slots left, then fill the slots taken."""
        moving = {}
        for page, src, dst in changes:
            if src is not None and dst is not None:
                self._wait_host()
                tier = self.slots[src]
                moving[page] = tier.data[tier.slot[page]].clone()
        for page, src, _ in changes:
            if src is not None:
                tier = self.slots[src]
                self._keep_reads(loads, tier, tier.release(page))
        for page, src, dst in changes:
            if dst is None:
                continue
            tier = self.slots[dst]
            slot = tier.take(page)
            if src is not None:
                tier.data[slot].copy_(moving[page])
            elif token in reads:
                self._from_device(reads[token], tier, slot)
            else:
                self._wait_host()
                tier.data[slot].copy_(self.staged[token])
                self.copied_out[tier.name] += 1
        if token is not None:
            reads.pop(token, None)
            self.staged.pop(token, None)

"""The GroupTierLog of a model with several KV cache groups: replayed against a model of a driver's slots
(a page per slot, a tier's slots as many as its capacity), after every step of a simulation whose tiers
spill and drop, it must keep the slots in step with the pages the tiers hold, store each page from the
GPU block it was handed down from, and load only pages where it put them."""
from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from simulator.config import SimConfig
from simulator.core.paged.kv_group_tier_log import GroupTierLog, attach_group_log
from simulator.loop import simulate
from traces.multiturn import MultiTurnConfig, generate_multiturn

BASE = SimConfig(model="gemma-3-27b", gpu="h100-80gb", max_model_len=32768, kv_memory_gb=1.2,
                 kv_offloading_size=0.1, kv_offloading_disk_size=1.0)
MODELS: list[SlotModel] = []


class SlotModel:
    """A driver's slots fed by the log: checks each op as a driver would perform it."""

    def __init__(self, alloc) -> None:
        tiers, pool = alloc.tiers, alloc.pool
        self.tiers, self.log = tiers, GroupTierLog(tiers)
        attach_group_log(alloc, self.log)
        self.capacity = {t.spec.name: t.spec.num_blocks for t in tiers.tiers}
        self.slots: dict[str, set] = {name: set() for name in self.capacity}
        self.handed: dict[int, tuple[int, int]] = {}  # token -> (range hash, group) the pool handed down
        self.loads = 0
        self.drops = self.moves = 0
        hand = pool.on_release if tiers.eager else pool.on_evict

        def spy(hashes: list[int], keys: list[tuple]) -> None:
            for h, key in zip(hashes, keys, strict=True):  # one at a time: each page takes the next token
                self.handed[self.log.next_token] = (tiers.ranges[h], key[0])
                hand([h], [key])

        if tiers.eager:
            pool.on_release = spy
        else:
            pool.on_evict = spy

    def apply(self) -> None:
        """Perform the ops logged so far."""
        for op in self.log.take():
            if op[0] == "read":
                assert op[1] in self.handed
            elif op[0] == "load":
                assert op[2] in self.slots[op[1]], f"{op[2]} loaded from {op[1]}, which does not hold it"
                self.loads += 1
            else:
                changes, token = op[1], op[2]
                for page, src, dst in changes:
                    if src is not None:
                        self.slots[src].remove(page)
                    self.drops += dst is None
                    self.moves += src is not None and dst is not None
                for page, src, dst in changes:
                    if dst is not None:
                        assert page not in self.slots[dst]
                        self.slots[dst].add(page)
                        assert len(self.slots[dst]) <= self.capacity[dst]
                    if src is None:
                        assert page == self.handed[token]
                self.handed.pop(token)

    def pages(self, name: str) -> set:
        """The pages tier `name` holds, from its entries."""
        tier = next(t for t in self.tiers.tiers if t.spec.name == name)
        return {(h, g) for h, e in tier.keys.items() for g in range(e[2].bit_length()) if e[2] >> g & 1}


@dataclasses.dataclass(frozen=True)
class LoggedConfig(SimConfig):
    """A SimConfig whose grouped tiers log their data moves into a SlotModel."""

    def build_allocator(self):
        """The configured allocator with a SlotModel on its tiers' log."""
        alloc = super().build_allocator()
        MODELS.append(SlotModel(alloc))
        return alloc


@pytest.fixture(scope="module")
def trace() -> pd.DataFrame:
    """Conversations whose turns reuse their prefixes, more than the small pool and tiers keep."""
    return generate_multiturn(MultiTurnConfig(num_requests=40, rate=2.0, think_time_s=10.0))


@pytest.mark.parametrize("store", ["lazy", "eager"])
def test_the_log_keeps_slots_in_step_with_the_tiers_and_changes_no_decision(trace, store):
    config = dataclasses.replace(BASE, kv_offloading_store=store)
    plain = simulate(trace, config).summary
    logged = LoggedConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(SimConfig)})
    result = simulate(trace, logged, observer=lambda state: MODELS[-1].apply()).summary
    model = MODELS[-1]
    model.tiers.flush()
    model.apply()
    for name in model.capacity:
        assert model.slots[name] == model.pages(name)
    tiers = result["kv_tiers"]
    assert model.loads == sum(tiers[name]["hit_blocks"] for name in model.capacity) > 0
    assert model.moves > 0 and model.drops > 0  # the CPU tier spilled, the disk tier dropped
    assert not model.handed  # every page handed down was stored or passed over
    del plain["wall_s"], result["wall_s"]
    assert result == plain

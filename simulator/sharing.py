"""Memory saved by sharing KV blocks (the vLLM paper's Fig. 15): parallel sampling and beam search."""
from __future__ import annotations

import dataclasses

import pandas as pd

from simulator.config import SimConfig
from simulator.core.errors import ConfigError
from simulator.core.paged.block_manager import BlockManager
from simulator.loop import simulate


def sharing_saving(trace: pd.DataFrame, config: SimConfig) -> dict:
    """Run in step mode and average, over busy steps, (logical - physical) / logical blocks.

    Logical blocks are what every sequence's block table names (the blocks needed without sharing);
    physical blocks are the distinct blocks actually held. Saving = blocks saved by sharing / blocks
    needed without sharing, as in the paper. Each step counts once (a step average, measured after the
    step's sampling, forks and frees).
    """
    if config.allocator != "paged":
        raise ConfigError("sharing savings are measured on the paged allocator")
    totals = {"steps": 0, "ratio_sum": 0.0, "logical": 0, "physical": 0}

    def observe(run) -> None:
        alloc: BlockManager = run.alloc
        logical = sum(len(s.block_table) for s in alloc.seqs.values())
        if logical:
            physical = alloc.num_used_blocks
            totals["steps"] += 1
            totals["ratio_sum"] += (logical - physical) / logical
            totals["logical"] += logical
            totals["physical"] += physical

    result = simulate(trace, dataclasses.replace(config, mode="step", record_events=False), observer=observe)
    steps = totals["steps"]
    return {"saving": totals["ratio_sum"] / steps if steps else 0.0,
            "mean_logical_blocks": totals["logical"] / steps if steps else 0.0,
            "mean_physical_blocks": totals["physical"] / steps if steps else 0.0,
            "steps": steps, "summary": result.summary}

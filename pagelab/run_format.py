"""The run format's vocabulary (docs/run-format.md): the memory states and each table's columns and types.

One definition that the memory core (its taxonomy), the simulation's and the replay's tables, and the
figures all read. Types are numpy/Arrow type names, so this module imports nothing heavy.
"""
from __future__ import annotations

from pathlib import Path

# The five states of a KV slot: they add up to the pool's capacity, in this order (bottom to top in every
# stacked figure: the useful part sits on the axis, as in the vLLM paper's Fig. 2).
MEMORY_STATES = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free")

# Parts of a state, each drawn inside its parent (column -> the state or part it belongs to): what the
# prefix cache holds of free memory, and what a pool split into KV cache groups wastes. `padding` is the
# layer slots of held blocks that a padded group leaves unused (part of internal fragmentation);
# `window_cached` the free blocks a sliding window handed back that the prefix cache still keeps (part of
# cached_free, so of free).
SUB_STATES: dict[str, str] = {"cached_free": "free", "padding": "internal_fragmentation",
                              "window_cached": "cached_free"}
# Only a run whose pool is split into KV cache groups (a sliding window, or several groups: the grouped
# allocator) carries HYBRID_STATES, zeros where its layout has no padding or no window. A one-group run
# lacks the columns rather than carrying zeros: its tables, summary and figures hold only the columns it
# can fill, and its steps (millions in a long run) pack no extra values; readers take the columns as
# optional (0 when absent).
HYBRID_STATES = ("padding", "window_cached")

# One row per step (or span of steps, or idle gap): the states as fractions of capacity, and counts.
MEMORY_COLUMNS: dict[str, str] = {
    "step": "int64", "num_steps": "int64", "t_s": "float64", "dt_s": "float64",
    **dict.fromkeys(MEMORY_STATES, "float64"), "cached_free": "float64",
    "token_occupancy": "float64", "block_occupancy": "float64",
    "num_running": "int64", "num_waiting": "int64", "num_swapped": "int64", "num_batched_tokens": "int64",
    "blocks_used": "int64",
}
# ... of a run with KV cache groups: HYBRID_STATES follow cached_free.
_AFTER = list(MEMORY_COLUMNS).index("cached_free") + 1
HYBRID_MEMORY_COLUMNS: dict[str, str] = {
    **dict(list(MEMORY_COLUMNS.items())[:_AFTER]), **dict.fromkeys(HYBRID_STATES, "float64"),
    **dict(list(MEMORY_COLUMNS.items())[_AFTER:]),
}

# One row per request, in trace order: its trace columns, what happened to it, and derived latencies.
TRACE_COLUMNS: dict[str, str] = {"request_id": "int64", "arrival_s": "float64", "prompt_len": "int64",
                                 "output_len": "int64", "n": "int64", "beam_width": "int64"}
REQUEST_COLUMNS: dict[str, str] = {
    **TRACE_COLUMNS, "admitted_s": "float64", "first_token_s": "float64", "finish_s": "float64",
    "num_preemptions": "int64", "rejected": "bool", "prefix_hit_tokens": "int64", "queueing_s": "float64",
    "ttft_s": "float64", "tpot_s": "float64", "e2e_s": "float64", "normalized_latency_s": "float64",
}

# One row per tenure (a block or region held by a request from t_start_s to t_end_s), ordered by release
# time, then acquisition. Compact types: pool offsets, sizes, request ids and counts fit in int32.
# `prefix_key` is the block's content key in the prefix cache when released (0: none); `seq_id` is the
# sequence that acquired it (a block shared by fork stays its acquirer's). Runs written before these columns
# existed lack them, so readers take them as optional (EVENT_OPTIONAL).
EVENT_COLUMNS: dict[str, str] = {
    "request_id": "int32", "start": "int32", "size": "int32", "t_start_s": "float64", "t_end_s": "float64",
    "max_ref_count": "int32", "filled": "int32", "prefix_key": "int64", "seq_id": "int64",
}
EVENT_OPTIONAL = ("prefix_key", "seq_id")

# One row per change of a request's place that the request table only counts: preemptions (its blocks
# freed, to be recomputed) and swaps out to and in from the CPU pool, in time order. `kind` indexes
# TRANSITION_KINDS.
TRANSITION_KINDS = ("preempted", "swapped_out", "swapped_in")
TRANSITION_COLUMNS: dict[str, str] = {"request_id": "int32", "t_s": "float64", "kind": "int8"}

# A sweep folder keeps each point's run folder in SWEEP_POINTS_DIR and their rows in SWEEP_TABLE
# (docs/sweeps.md).
SWEEP_POINTS_DIR = "points"
SWEEP_TABLE = "sweep.parquet"


def is_sweep_folder(path: Path) -> bool:
    """Whether `path` holds a sweep (its points, or its table)."""
    return (path / SWEEP_POINTS_DIR).is_dir() or (path / SWEEP_TABLE).is_file()


def sweep_axis_applies(axis: str, allocator: str) -> bool:
    """Whether a sweep axis changes a run of `allocator`: the block size only a paged one's (a sweep runs a
    contiguous configuration once, at the first block size, and names none)."""
    return axis != "block_size" or allocator == "paged"


# One row per change of a held block's (or region's) reference count between owners, in time order: the
# block at slot `start` has `ref_count` owners from `t_s` on (acquisitions and releases are the tenures).
REFCOUNT_COLUMNS: dict[str, str] = {"start": "int32", "t_s": "float64", "ref_count": "int32"}

"""A tiny, schema-exact run folder (docs/run-format.md) with hand-placed tenures for the viz tests.

Pool: 64 slots, block size 16. Two allocators over t in [0, 4) s:

paged (blocks of 16 slots)                  contiguous-max (24-slot regions, max_model_len 24)
  req 1: slots  0-15, t 0.0-2.0, filled 16    req 1: slots  0-23, t 0-2, filled 20
  req 2: slots 16-31, t 1.0-3.0, filled 16    req 2: slots 24-47, t 1-3, filled 22
  req 2: slots 32-47, t 1.0-3.0, filled 10    req 3: slots  0-23, t 2-4, filled 18
  req 3: slots 48-63, t 0.4-2.6, ref 2        req 4: slots 24-47, t 3-4, filled 10
  req 4: slots  0-15, t 2.25-4.0, filled 5    slots 48-63 are never used: a hole

Requests carry the trace's own ids 1-4 (rows 0-3); the tenures name them by row, as a run does.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from pagelab.run_format import MEMORY_STATES

CAPACITY = 64
BLOCK_SIZE = 16
DURATION = 4.0
STATES = MEMORY_STATES

EVENTS = {
    "paged": [  # request_id (the request's row), start, size, t_start_s, t_end_s, max_ref_count, filled
        (0, 0, 16, 0.0, 2.0, 1, 16),
        (1, 16, 16, 1.0, 3.0, 1, 16),
        (1, 32, 16, 1.0, 3.0, 1, 10),
        (2, 48, 16, 0.4, 2.6, 2, 16),
        (3, 0, 16, 2.25, 4.0, 1, 5),
    ],
    "contiguous-max": [
        (0, 0, 24, 0.0, 2.0, 1, 20),
        (1, 24, 24, 1.0, 3.0, 1, 22),
        (2, 0, 24, 2.0, 4.0, 1, 18),
        (3, 24, 24, 3.0, 4.0, 1, 10),
    ],
}
MEMORY_FRACTIONS = {
    "paged": {"token_states": 0.55, "reservation": 0.05, "internal_fragmentation": 0.04,
              "external_fragmentation": 0.0, "free": 0.36},
    "contiguous-max": {"token_states": 0.35, "reservation": 0.1, "internal_fragmentation": 0.15,
                       "external_fragmentation": 0.25, "free": 0.15},
}
REQUESTS = {  # request_id: arrival, prompt, output, admitted, first_token, finish, preemptions
    "paged": [(1, 0.0, 12, 4, 0.0, 0.5, 2.0, 0), (2, 0.9, 20, 6, 1.0, 1.5, 3.0, 0),
              (3, 0.4, 16, 5, 0.4, 0.9, 2.6, 0), (4, 2.0, 3, 2, 2.25, 2.5, 4.0, 0)],
    "contiguous-max": [(1, 0.0, 12, 8, 0.0, 0.5, 2.0, 0), (2, 0.9, 20, 2, 1.0, 1.5, 3.0, 0),
                       (3, 0.4, 16, 2, 2.0, 2.4, 4.0, 0), (4, 2.0, 3, 7, 3.0, 3.2, np.nan, 0)],
}


def memory_table(name: str, num_rows: int = 16, spike_row: int | None = 5) -> pd.DataFrame:
    """Step rows every 0.25 s; state fractions wobble around the summary and sum to 1."""
    base = MEMORY_FRACTIONS[name]
    t = np.arange(num_rows) * (DURATION / num_rows)
    wobble = 0.05 * np.sin(np.arange(num_rows))
    rows = {s: np.full(num_rows, base[s]) for s in STATES}
    rows["token_states"] = rows["token_states"] + wobble
    rows["free"] = rows["free"] - wobble
    if spike_row is not None:  # one step where the pool is completely used
        moved = rows["free"][spike_row]
        rows["free"][spike_row] = 0.0
        rows["token_states"][spike_row] += moved
    running = np.array([1, 2, 2, 3, 3, 4, 3, 3, 2, 2, 2, 1, 1, 1, 1, 0])[:num_rows]
    return pd.DataFrame({
        "step": np.arange(num_rows, dtype=np.int64), "num_steps": np.ones(num_rows, dtype=np.int64),
        "t_s": t, "dt_s": np.full(num_rows, DURATION / num_rows), **rows,
        "cached_free": np.zeros(num_rows), "token_occupancy": rows["token_states"],
        "block_occupancy": 1.0 - rows["free"], "num_running": running.astype(np.int64),
        "num_waiting": np.maximum(0, 2 - running).astype(np.int64),
        "num_swapped": np.zeros(num_rows, dtype=np.int64),
        "num_batched_tokens": (running * 3).astype(np.int64), "blocks_used": (running + 1).astype(np.int64),
    })


def requests_table(name: str) -> pd.DataFrame:
    """Per-request rows with derived latencies (NaN when unfinished)."""
    cols = ["request_id", "arrival_s", "prompt_len", "output_len", "admitted_s", "first_token_s",
            "finish_s", "num_preemptions"]
    df = pd.DataFrame(REQUESTS[name], columns=cols)
    for col in ("request_id", "prompt_len", "output_len", "num_preemptions"):
        df[col] = df[col].astype(np.int64)
    df["n"] = np.ones(len(df), dtype=np.int64)
    df["beam_width"] = np.ones(len(df), dtype=np.int64)
    df["rejected"] = np.zeros(len(df), dtype=bool)
    df["prefix_hit_tokens"] = np.zeros(len(df), dtype=np.int64)
    df["queueing_s"] = df["admitted_s"] - df["arrival_s"]
    df["ttft_s"] = df["first_token_s"] - df["arrival_s"]
    df["e2e_s"] = df["finish_s"] - df["arrival_s"]
    df["tpot_s"] = (df["finish_s"] - df["first_token_s"]) / (df["output_len"] - 1)
    df["normalized_latency_s"] = df["e2e_s"] / df["output_len"]
    return df


def events_table(name: str) -> pd.DataFrame:
    """The hand-placed tenures of one allocator."""
    cols = ["request_id", "start", "size", "t_start_s", "t_end_s", "max_ref_count", "filled"]
    df = pd.DataFrame(EVENTS[name], columns=cols)
    for col in ("request_id", "start", "size", "max_ref_count", "filled"):
        df[col] = df[col].astype(np.int64)
    return df


def summary_for(name: str, requests: pd.DataFrame, rate: float | None, block_size: int) -> dict:
    """SUMMARY with the fixed memory fractions and latencies computed from `requests`."""
    def stats(col: str) -> dict:
        v = requests[col].dropna().to_numpy(float)
        return {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)),
                "p90": float(np.percentile(v, 90)), "p99": float(np.percentile(v, 99))}
    finished = requests["finish_s"].notna()
    return {
        "capacity_tokens": CAPACITY, "block_size": block_size, "num_blocks": CAPACITY // block_size,
        "num_requests": len(requests), "num_finished": int(finished.sum()), "num_rejected": 0,
        "num_preemptions": 0, "sim_duration_s": DURATION, "wall_s": 0.01,
        "mean_batch_size": 2.0 if name == "paged" else 1.5,
        "throughput_tokens_per_s": float(requests.loc[finished, "output_len"].sum() / DURATION),
        "normalized_latency_s_per_token": float(requests["normalized_latency_s"].mean())
        * (1.0 if rate is None else rate),
        "ttft_s": stats("ttft_s"), "tpot_s": stats("tpot_s"), "e2e_s": stats("e2e_s"),
        "memory": {**MEMORY_FRACTIONS[name], "cached_free": 0.0},
        "token_occupancy": MEMORY_FRACTIONS[name]["token_states"], "block_occupancy": 0.6,
        "prefix_cache_hit_rate": 0.0 if name == "paged" else None,
    }


def write_small_run(root: Path, rate: float | None = None, block_size: int = BLOCK_SIZE,
                    allocators: tuple[str, ...] = ("paged", "contiguous-max"), point_hash: str | None = None
                    ) -> Path:
    """Write the run folder under `root` and return it; `rate` goes into config.json when given, and
    `point_hash` into the summary's trace as a sweep point's."""
    root.mkdir(parents=True, exist_ok=True)
    top = {"trace": {"name": "hand-built", "num_requests": 4}, "allocators": {}}
    if point_hash is not None:
        top["trace"]["point_hash"] = point_hash
    for name in allocators:
        folder = root / name
        folder.mkdir()
        requests = requests_table(name)
        summary = summary_for(name, requests, rate, block_size)
        config = {"seed": 0, "pagelab_version": "0.1.0", "source": "simulate", "allocator": name,
                  "capacity_tokens": CAPACITY, "block_size": block_size, "max_model_len": 24}
        if rate is not None:
            config["rate"] = rate
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "summary.json").write_text(json.dumps(summary))
        requests.to_parquet(folder / "requests.parquet")
        memory_table(name).to_parquet(folder / "memory.parquet")
        events_table(name).to_parquet(folder / "events.parquet")
        top["allocators"][name] = summary
    (root / "summary.json").write_text(json.dumps(top))
    return root


def write_sweep_point(sweep: Path, name: str, rate: float | None = None, block_size: int = BLOCK_SIZE
                      ) -> Path:
    """A run folder laid out as a point of the sweep folder `sweep`: in its points/ folder, with a hash."""
    return write_small_run(sweep / "points" / name, rate, block_size, point_hash=f"hash-{name}")

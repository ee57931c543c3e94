"""Gemma 3 27B on long conversations: all layers full attention, the hybrid layout, and hybrid with FP8 KV
(`python -m bench.hybrid`; docs/hybrid.md).

Each configuration serves the first requests of the bundled Mooncake conversation trace (prompts of 1k to
126k tokens, median 6.9k, with shared prefixes) on one H100-80GB by the roofline latency model; the table
gives the mean batch, throughput, prefix hit rate and the time-weighted memory breakdown, with the share
of padding layers and of free blocks a sliding window handed back that the prefix cache still holds (the
memory table's `padding` and `window_cached` columns; 0 for the run forced into one group, which lacks them).
A second table sweeps the block size of the hybrid layout for its prefix hit rate, and `--timing`
measures what per-type groups cost the simulator against the same run forced into one group (median of
alternating repeats).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from pagelab.column_stats import weighted_sum
from pagelab.run_format import HYBRID_STATES, MEMORY_STATES
from simulator.config import SimConfig
from simulator.loop import simulate
from traces import load_trace

BASE = SimConfig(model="gemma-3-27b", gpu="h100-80gb", max_model_len=131072, max_num_batched_tokens=131072,
                 record_events=False)
CONFIGS = {
    "all full attention": {"disable_hybrid_kv_cache_manager": True},
    "hybrid": {},
    "hybrid + fp8": {"kv_cache_dtype": "fp8"},
}


def _trace(num_requests: int):
    return load_trace("mooncake-conv").iloc[:num_requests].reset_index(drop=True)


def run_one(trace, config: SimConfig) -> dict:
    """One simulation: serving numbers, the mean memory shares, and the parts of them that are padding
    layers (of internal fragmentation) and window blocks kept for prefix caching (of free memory)."""
    res = simulate(trace, config)
    m, s = res.memory, res.summary
    w = m["dt_s"].to_numpy()
    shares = {k: float(weighted_sum(w, m[k].to_numpy()) / w.sum()) if k in m else 0.0
              for k in (*MEMORY_STATES, "cached_free", *HYBRID_STATES)}
    return {"num_blocks": s["num_blocks"], "mean_batch": s["mean_batch_size"],
            "throughput_tok_s": s["throughput_tokens_per_s"], "prefix_hit_rate": s["prefix_cache_hit_rate"],
            "preemptions": s["num_preemptions"], "finished": s["num_finished"], **shares}


def study(num_requests: int, chunk: int | None = None) -> dict[str, dict]:
    """The three configurations side by side (with chunked prefill of `chunk` tokens per step if given)."""
    trace = _trace(num_requests)
    base = BASE if chunk is None else \
        dataclasses.replace(BASE, enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    return {label: run_one(trace, dataclasses.replace(base, **kw)) for label, kw in CONFIGS.items()}


def block_sizes(num_requests: int, sizes=(16, 32, 64, 128, 256, 512, 1024, 2048)) -> dict[int, float]:
    """Prefix hit rate of the hybrid layout for each block size."""
    trace = _trace(num_requests)
    return {bs: run_one(trace, dataclasses.replace(BASE, block_size=bs))["prefix_hit_rate"] for bs in sizes}


def timing(num_requests: int, repeats: int) -> dict[str, float]:
    """Median wall and CPU seconds of the hybrid run and of the same run forced into one group, both in
    the default (fast) mode, the two alternating; `ratio_cpu` and `ratio_wall` are hybrid / one group."""
    trace = _trace(num_requests)
    runs = {"hybrid": BASE, "one group": dataclasses.replace(BASE, disable_hybrid_kv_cache_manager=True)}
    times: dict[str, list[float]] = {f"{k} {u}": [] for k in runs for u in ("wall_s", "cpu_s")}
    for _ in range(repeats):
        for label, config in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            simulate(trace, config)
            times[f"{label} wall_s"].append(time.perf_counter() - t0)
            times[f"{label} cpu_s"].append(time.process_time() - c0)
    out = {k: statistics.median(v) for k, v in times.items()}
    for unit in ("cpu", "wall"):
        out[f"ratio_{unit}"] = out[f"hybrid {unit}_s"] / out[f"one group {unit}_s"]
    return out


def figure(rows: dict[str, dict], hits: dict[int, float], path: Path) -> None:
    """Memory shares side by side (padding and window-kept blocks split out) and hit rate vs block size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from viz.palette import STATE_COLORS

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.6))
    parts = [("token_states", "token states"), ("reservation", "reservation"),
             ("internal_other", "internal fragmentation"), ("padding", "padding layers"),
             ("free_other", "free"), ("window_cached", "window blocks kept for prefix caching")]
    colors = {**STATE_COLORS, "internal_other": STATE_COLORS["internal_fragmentation"], "padding": "#AA3377",
              "free_other": STATE_COLORS["free"], "window_cached": "#4477AA"}
    labels = list(rows)
    bottom = np.zeros(len(labels))
    for key, name in parts:
        vals = []
        for r in rows.values():
            if key == "internal_other":
                vals.append(r["internal_fragmentation"] - r["padding"])
            elif key == "free_other":
                vals.append(r["free"] + r["external_fragmentation"] - r["window_cached"])
            else:
                vals.append(r[key])
        left.bar(labels, vals, bottom=bottom, color=colors[key], label=name)
        bottom += np.array(vals)
    left.set_ylabel("share of KV memory (time-weighted)")
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    right.plot(list(hits), [100 * h for h in hits.values()], marker="o")
    right.set_xscale("log", base=2)
    right.set_xlabel("block size (tokens)")
    right.set_ylabel("prefix hit rate (%)")
    right.set_title("hybrid Gemma 3 27B")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Run the study (and the timing with --timing); print JSON and write the figure into --out."""
    ap = argparse.ArgumentParser(prog="python -m bench.hybrid", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="first requests of the trace (default 200)")
    ap.add_argument("--out", type=Path, default=Path("hybrid-study"), help="folder for the JSON and figure")
    ap.add_argument("--timing", type=int, default=0, metavar="REPEATS",
                    help="also time hybrid against one group, REPEATS alternating runs each")
    ap.add_argument("--chunk", type=int, default=None, metavar="TOKENS",
                    help="also run the study with chunked prefill of TOKENS per step (vLLM's default: 8192)")
    args = ap.parse_args(argv)
    if args.chunk is not None and args.chunk < 1:
        ap.error(f"--chunk must be >= 1 token, got {args.chunk}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"study": study(args.requests), "hit_rate_by_block_size": block_sizes(args.requests)}
    if args.chunk is not None:
        result["study_chunked"] = study(args.requests, args.chunk)
    if args.timing:
        result["timing_s"] = timing(args.requests, args.timing)
    (args.out / "hybrid.json").write_text(json.dumps(result, indent=2))
    figure(result["study"], result["hit_rate_by_block_size"], args.out / "hybrid.png")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

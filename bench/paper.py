"""Reproduce the vLLM paper's Fig. 2 and Fig. 13 tables (`python -m bench.paper`; docs/paper-reproduction.md).

Kwon et al., SOSP 2023. The setup is the paper's (OPT-13B, 12 GiB of KV, max_model_len 2048, buddy
placement for the contiguous Orca baselines, FCFS, recompute preemption) on pagelab's synthetic ShareGPT-
and Alpaca-like traces. Besides the whole-run time-weighted shares that `pagelab simulate` reports, the
Fig. 2 table gives the shares over the *saturated* window (steps with a non-empty waiting queue): a burst
run ends with a drain phase in which the queue is empty and the pool empties, and that tail is free memory
that no allocator could fill. The paper's Fig. 2 has no "free" category.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from pagelab.column_stats import weighted_sum
from pagelab.run_format import MEMORY_STATES
from simulator.config import SimConfig
from simulator.loop import RunResult, simulate
from traces import SyntheticConfig, generate_trace

STATES = MEMORY_STATES
ALLOCATORS = ("contiguous-max", "contiguous-pow2", "contiguous-oracle", "paged")
LABELS = {"contiguous-max": "Orca (Max)", "contiguous-pow2": "Orca (Pow2)",
          "contiguous-oracle": "Orca (Oracle)", "paged": "vLLM / paged"}
# The paper's setting (section 6.1 / 6.2): OPT-13B on one A100-40GB with 12 GiB left for the KV cache.
BASE = SimConfig(model="opt-13b", gpu="a100-40gb", kv_memory_gb=12, max_model_len=2048,
                 max_num_batched_tokens=8192, record_events=False)
TRACES = {
    "sharegpt-2rps": SyntheticConfig(num_requests=2000, rate=2.0, lengths="sharegpt", seed=0),
    "sharegpt-burst": SyntheticConfig(num_requests=2000, arrival="burst", lengths="sharegpt", seed=0),
    "alpaca-30rps": SyntheticConfig(num_requests=10000, rate=30.0, lengths="alpaca", seed=0),
    "alpaca-burst": SyntheticConfig(num_requests=3000, arrival="burst", lengths="alpaca", seed=0),
}
# Read off the paper's figures: Fig. 2 (token states, ShareGPT) and Fig. 13 (mean batched requests).
PAPER_TOKEN_SHARE = {"contiguous-max": 20.4, "contiguous-pow2": 26.8, "contiguous-oracle": 38.2,
                     "paged": 96.3}
PAPER_BATCH = {"sharegpt-2rps": (7.00, 9.81, 13.62, 30.42), "alpaca-30rps": (7.00, 43.24, 72.75, 132.44)}


def window_shares(memory: pd.DataFrame, saturated: bool) -> dict[str, float]:
    """Time-weighted memory-state fractions over the whole run, or over the rows with a waiting queue."""
    rows = memory[memory["num_waiting"] > 0] if saturated else memory
    w = rows["dt_s"].to_numpy(np.float64)
    total = w.sum()
    if total <= 0:
        return {s: float("nan") for s in STATES}
    return {s: float(weighted_sum(w, rows[s].to_numpy(np.float64)) / total) for s in STATES}


def saturated_time_share(memory: pd.DataFrame) -> float:
    """Fraction of the run's time in which some request waits."""
    w = memory["dt_s"].to_numpy(np.float64)
    return float(w[(memory["num_waiting"] > 0).to_numpy()].sum() / w.sum()) if w.sum() > 0 else float("nan")


def run_paper(traces: dict[str, SyntheticConfig] | None = None, base: SimConfig = BASE
              ) -> dict[str, dict[str, RunResult]]:
    """Simulate every trace against the four allocators: {trace: {allocator: result}}."""
    out = {}
    for name, tcfg in (traces or TRACES).items():
        df = generate_trace(tcfg)
        out[name] = {a: simulate(df, dataclasses.replace(base, allocator=a, extra={"trace": name}))
                     for a in ALLOCATORS}
    return out


def paged_free_causes(trace: pd.DataFrame, base: SimConfig = BASE) -> dict[str, float]:
    """Why a saturated paged pool keeps blocks free: after every step (step mode) with a waiting queue,
    time-weighted free blocks, whether the head of the queue is a preempted (recompute) request, what it
    needs, and how much of the free space lies under the watermark (which admission may not touch)."""
    rows: list[tuple[float, int, int, bool, int]] = []
    last = [0.0]

    def observe(run) -> None:
        dt, last[0] = run.now - last[0], run.now
        if run.sched.waiting and dt > 0:
            head, bm = run.sched.waiting[0].seqs[0], run.alloc
            need = -(-head.length // bm.block_size)  # blocks to (re)compute the head's tokens so far
            rows.append((dt, bm.num_free_blocks, need, head.length > head.prompt_len, bm.watermark_blocks))

    cfg = dataclasses.replace(base, allocator="paged", mode="step", record_events=False)
    simulate(trace, cfg, observer=observe)
    dt, free, need, preempted, wm = (np.asarray(c, dtype=np.float64) for c in zip(*rows, strict=True))
    total, pre = dt.sum(), preempted > 0

    def mean(x, mask):
        return float(weighted_sum(dt[mask], x[mask]) / dt[mask].sum()) if dt[mask].sum() > 0 else float("nan")

    return {"saturated_s": float(total), "mean_free_blocks": mean(free, dt > 0),
            "head_preempted_time_share": float(dt[pre].sum() / total),
            "free_blocks_when_head_preempted": mean(free, pre), "head_need_when_preempted": mean(need, pre),
            "free_blocks_when_head_fresh": mean(free, ~pre), "head_need_when_fresh": mean(need, ~pre),
            "head_does_not_fit_time_share": float(dt[free - need < wm].sum() / total),
            "free_blocks_under_watermark": mean(np.minimum(free, wm), dt > 0)}


# Paged settings that might explain free memory under saturation (docs/paper-reproduction.md).
PAGED_VARIANTS = {
    "default (watermark 0.01, block 16, budget 8192)": {},
    "watermark 0": {"watermark": 0.0},
    "budget 2,560 (vLLM v0.1 default)": {"max_num_batched_tokens": 2560},
    "budget 16,384": {"max_num_batched_tokens": 16384},
    "chunked prefill (budget 512)": {"enable_chunked_prefill": True, "max_num_batched_tokens": None},
    "block 8": {"block_size": 8},
    "block 32": {"block_size": 32},
    "watermark 0, block 8": {"watermark": 0.0, "block_size": 8},
}


def paged_variants_table(trace: pd.DataFrame, base: SimConfig = BASE) -> str:
    """Markdown: paged token / free shares, whole run and saturated, under each of PAGED_VARIANTS."""
    lines = ["| variant | token % whole run | free % whole run | token % saturated | free % saturated "
             "| drain % of time | preemptions | batch |", "|---|---|---|---|---|---|---|---|"]
    for name, change in PAGED_VARIANTS.items():
        r = simulate(trace, dataclasses.replace(base, allocator="paged", record_events=False, **change))
        run, sat = window_shares(r.memory, False), window_shares(r.memory, True)
        lines.append(f"| {name} | {100 * run['token_states']:.1f} | {100 * run['free']:.1f} "
                     f"| {100 * sat['token_states']:.1f} | {100 * sat['free']:.1f} "
                     f"| {100 * (1 - saturated_time_share(r.memory)):.1f} | {r.summary['num_preemptions']} "
                     f"| {r.summary['mean_batch_size']:.2f} |")
    return "\n".join(lines)


def fig2_table(results: dict[str, RunResult], paper: dict[str, float] | None = None) -> str:
    """Markdown: the five memory states per allocator, whole run and saturated window, with the paper's
    token-state share where it has one (its Fig. 2 is ShareGPT only)."""
    lines = ["| system | window | token states | reservation | internal frag. | external frag. & other "
             "| free | paper token states |", "|---|---|---|---|---|---|---|---|"]
    for a in ALLOCATORS:
        mem = results[a].memory
        for sat in (False, True):
            s = window_shares(mem, sat)
            window = f"saturated ({100 * saturated_time_share(mem):.0f} % of time)" if sat else "whole run"
            cells = " | ".join(f"{100 * s[k]:.1f}" for k in STATES)
            ref = paper[a] if paper and sat else "–" if sat else ""
            lines.append(f"| {LABELS[a]} | {window} | {cells} | {ref} |")
    return "\n".join(lines)


def fig13_table(all_results: dict[str, dict[str, RunResult]]) -> str:
    """Markdown: mean number of batched requests per trace and allocator, and the paper's where it has one."""
    lines = ["| trace | " + " | ".join(LABELS[a] for a in ALLOCATORS) + " |",
             "|---" * (len(ALLOCATORS) + 1) + "|"]
    for name, results in all_results.items():
        if name in PAPER_BATCH:
            lines.append(f"| {name}, paper | " + " | ".join(f"{b:.2f}" for b in PAPER_BATCH[name]) + " |")
        lines.append(f"| {name}, pagelab | "
                     + " | ".join(f"{results[a].summary['mean_batch_size']:.2f}" for a in ALLOCATORS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the Fig. 2 tables (ShareGPT and Alpaca, saturated) and Fig. 13; optionally write run folders."""
    ap = argparse.ArgumentParser(prog="python -m bench.paper", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write one run folder per trace here (for `pagelab plot`)")
    ap.add_argument("--placement", default="buddy", choices=("buddy", "first-fit"))
    ap.add_argument("--free-causes", action="store_true",
                    help="also analyse the paged pool's free blocks on the ShareGPT burst (step mode, and "
                         "under other watermarks, budgets and block sizes)")
    args = ap.parse_args(argv)
    base = dataclasses.replace(BASE, placement=args.placement, record_events=args.out is not None)
    results = run_paper(base=base)
    for name in ("sharegpt-burst", "alpaca-burst"):
        paper = PAPER_TOKEN_SHARE if name.startswith("sharegpt") else None
        print(f"\n## Fig. 2, {name} ({args.placement})\n\n{fig2_table(results[name], paper)}")
    print(f"\n## Fig. 13 ({args.placement})\n\n{fig13_table(results)}")
    if args.free_causes:
        print("\n## Paged free blocks under saturation (sharegpt-burst, after each step with a queue)\n")
        causes = paged_free_causes(generate_trace(TRACES["sharegpt-burst"]), base)
        print("\n".join(f"- {k}: {v:.3f}" for k, v in causes.items()))
        print(f"\n{paged_variants_table(generate_trace(TRACES['sharegpt-burst']), base)}")
    if args.out is not None:
        from pagelab.run_folder import write_run
        from traces.stats import trace_info
        for name, res in results.items():
            info = {"source": f"synthetic {name}", **trace_info(generate_trace(TRACES[name]))}
            write_run(args.out / f"paper-{name}", info, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU-only vs a CPU tier vs CPU + disk tiers on multi-turn traces (`python -m bench.tier_study`;
docs/traces.md, "Prefix reuse and KV tiers").

A Llama-3-8B-sized model (Llama 3.1's 128k context) on one H100-80GB, prefix caching on, LRU in every tier,
lazy stores. Traces: the bundled Mooncake conversation trace with its arrivals re-timed to --rate, and the
multi-turn generator (defaults matching Mooncake) at three think-time scales. For each trace and tier
setting: prompt tokens by source, TTFT p50/p99, output throughput, and the simulator's wall time.
`--overhead` instead times GPU-only and CPU + disk runs of one trace, alternating, and prints the ratio of
the medians.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

from simulator.config import SimConfig
from simulator.loop import simulate
from traces import load_trace, respace_arrivals
from traces.multiturn import MultiTurnConfig, generate_multiturn

BASE = SimConfig(model="llama-3-8b", gpu="h100-80gb", max_model_len=131072, record_events=False)
TIERS = {
    "GPU only": {},
    "+CPU 256 GB": {"kv_offloading_size": 256},
    "+CPU 256 GB +disk 2 TB": {"kv_offloading_size": 256, "kv_offloading_disk_size": 2048},
}
THINK_TIMES = (10.0, 60.0, 600.0)
SOURCES = ("gpu_hit", "cpu_hit", "disk_hit", "computed")


def traces(rate: float, num: int) -> dict:
    """The study's traces by label."""
    out = {"mooncake-conv": respace_arrivals(load_trace("mooncake-conv"), rate)}
    for think in THINK_TIMES:
        out[f"multi-turn, think {think:g} s"] = generate_multiturn(
            MultiTurnConfig(num_requests=num, rate=rate, think_time_s=think))
    return out


def run_one(trace, extra: dict) -> dict:
    """One simulation's numbers for the table."""
    result = simulate(trace, dataclasses.replace(BASE, **extra))
    s = result.summary
    stats = s["allocator_stats"]
    query = stats["prefix_query_tokens"]
    by = s.get("kv_tiers", {}).get("tokens_by_source") or {
        "gpu_hit": stats["prefix_hit_tokens"], "computed": query - stats["prefix_hit_tokens"]}
    return {"share": {k: by.get(k, 0) / query if query else 0.0 for k in SOURCES},
            "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"],
            "output_tok_per_s": s["throughput_tokens_per_s"], "finished": s["num_finished"],
            "wall_s": s["wall_s"]}


def study(rate: float, num: int) -> dict:
    """Every trace under every tier setting."""
    out: dict = {}
    for name, trace in traces(rate, num).items():
        out[name] = {}
        for label, extra in TIERS.items():
            out[name][label] = run_one(trace, extra)
            print(f"{name} / {label}: {json.dumps(out[name][label])}", file=sys.stderr, flush=True)
    return out


def table(results: dict) -> str:
    """The study as a Markdown table."""
    lines = ["| trace | tiers | GPU hit | CPU hit | disk hit | computed | TTFT p50 (s) | TTFT p99 (s) "
             "| output tok/s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rows in results.items():
        for label, r in rows.items():
            sh = r["share"]
            shares = " | ".join(f"{100 * sh[k]:.1f} %" for k in SOURCES)
            lines.append(f"| {name} | {label} | {shares} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} "
                         f"| {r['output_tok_per_s']:.0f} |")
    return "\n".join(lines)


def figure(results: dict, path: Path) -> Path:
    """Prompt tokens by source and TTFT p50/p99 for each trace and tier setting."""
    from viz.common import new_figure, save_figure

    fig = new_figure(12.0, 4.2)
    ax_src, ax_ttft = fig.subplots(1, 2)
    labels, bottoms = [], None
    colours = {"gpu_hit": "#4477AA", "cpu_hit": "#228833", "disk_hit": "#CCBB44", "computed": "#BBBBBB"}
    rows = [(f"{name}\n{label}", r) for name, group in results.items() for label, r in group.items()]
    labels = [lab for lab, _ in rows]
    bottoms = [0.0] * len(rows)
    for k in SOURCES:
        vals = [100 * r["share"][k] for _, r in rows]
        ax_src.barh(labels, vals, left=bottoms, color=colours[k], label=k.replace("_", " "))
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    ax_src.set_xlabel("prompt tokens (%)")
    ax_src.invert_yaxis()
    ax_src.tick_params(axis="y", labelsize=6)
    ax_src.legend(fontsize=7, loc="lower right")
    ax_src.set_title("Where prompt tokens come from")
    y = list(range(len(rows)))
    ax_ttft.scatter([r["ttft_p50_s"] for _, r in rows], y, marker="o", label="TTFT p50")
    ax_ttft.scatter([r["ttft_p99_s"] for _, r in rows], y, marker="^", label="TTFT p99")
    ax_ttft.set_yticks(y, [""] * len(y))
    ax_ttft.invert_yaxis()
    ax_ttft.set_xscale("log")
    ax_ttft.set_xlabel("seconds")
    ax_ttft.legend(fontsize=7)
    ax_ttft.set_title("Time to first token")
    return save_figure(fig, path, path.suffix.lstrip(".") or "png")


def overhead(trace, repeats: int) -> dict:
    """Wall and CPU seconds of GPU-only and CPU + disk runs of `trace` (each with the collection of what it
    left), alternating; medians and their ratios, the wall ratio also per simulated step (tier hits
    shorten prefills, which changes how many steps the run takes)."""
    times: dict[str, list[float]] = {"GPU only": [], "+CPU +disk": []}
    cpu: dict[str, list[float]] = {"GPU only": [], "+CPU +disk": []}
    steps: dict[str, int] = {}
    tiered = {"kv_offloading_size": 256, "kv_offloading_disk_size": 2048}
    for _ in range(repeats):
        for label, extra in (("GPU only", {}), ("+CPU +disk", tiered)):
            t0, c0 = time.perf_counter(), time.process_time()
            steps[label] = simulate(trace, dataclasses.replace(BASE, **extra)).summary["num_steps"]
            gc.collect()  # a run's cost includes freeing what it built, not left to a later run
            times[label].append(time.perf_counter() - t0)
            cpu[label].append(time.process_time() - c0)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    per_step = {k: med[k] / steps[k] for k in med}
    return {"seconds": times, "cpu_seconds": cpu, "median": med, "median_cpu": med_cpu, "steps": steps,
            "ratio": med["+CPU +disk"] / med["GPU only"],
            "ratio_cpu": med_cpu["+CPU +disk"] / med_cpu["GPU only"],
            "ratio_per_step": per_step["+CPU +disk"] / per_step["GPU only"]}


def main(argv: list[str] | None = None) -> None:
    """Run the study (or the overhead timing) and write JSON, a Markdown table and a figure."""
    p = argparse.ArgumentParser(prog="python -m bench.tier_study", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("tier-study"), help="Folder for the results.")
    p.add_argument("--rate", type=float, default=0.8, help="Requests per second of every trace.")
    p.add_argument("--num", type=int, default=6000, help="Requests of each generated trace.")
    p.add_argument("--overhead", type=int, metavar="REPEATS", default=0,
                   help="Time GPU-only vs CPU + disk on the first 3,000 Mooncake requests instead.")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.overhead:
        trace = respace_arrivals(load_trace("mooncake-conv"), args.rate).iloc[:3000]
        result = overhead(trace, args.overhead)
        (args.out / "overhead.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result["median"]), json.dumps(result["median_cpu"]), json.dumps(result["steps"]),
              f"ratio {result['ratio']:.2f} (CPU {result['ratio_cpu']:.2f}), per step "
              f"{result['ratio_per_step']:.2f}")
        return
    results = study(args.rate, args.num)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    (args.out / "table.md").write_text(table(results) + "\n")
    figure(results, args.out / "tiers.png")
    print(table(results))


if __name__ == "__main__":
    main()

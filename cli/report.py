"""Result tables for simulate and replay: memory breakdown and `vllm bench serve`-style serving metrics.

Both tables fit in 80 columns: allocators are shortened (contiguous-max -> max) and the serving metrics
are rows with one column per allocator, as vLLM prints one metric per line.
"""
from __future__ import annotations

from rich import box
from rich.table import Table

from cli.common import UserError, warn
from simulator.metrics import (
    DEFAULT_METRICS,
    DEFAULT_PERCENTILES,
    METRICS,
    overload_warning,
    rejection_warning,
)

_LABEL = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


def short(name: str) -> str:
    """contiguous-max -> max (keeps table columns narrow)."""
    return name.removeprefix("contiguous-")


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def parse_metrics(text: str | None) -> tuple[str, ...]:
    """--percentile-metrics ttft,tpot,itl,e2el (vLLM's names)."""
    if text is None:
        return DEFAULT_METRICS
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise UserError(f"--percentile-metrics {text!r}: choose among {', '.join(METRICS)}")
    return names


def parse_percentiles(text: str | None) -> tuple[float, ...]:
    """--metric-percentiles 50,90,99 (each in (0, 100])."""
    if text is None:
        return DEFAULT_PERCENTILES
    try:
        qs = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--metric-percentiles {text!r}: expected numbers, e.g. 50,90,99") from None
    if not qs or not all(0 < q <= 100 for q in qs):
        raise UserError(f"--metric-percentiles {text!r}: each percentile must be in (0, 100]")
    return qs


def memory_table(summaries: dict[str, dict]) -> Table:
    """Where the KV memory went (time-weighted % of capacity), batch size, preemptions, rejections."""
    t = Table(title="KV-cache memory, % of capacity (time-weighted)", box=box.SIMPLE_HEAD, pad_edge=False)
    for c in ("allocator", "token", "resv", "intern", "extern", "free", "batch", "preempt", "reject"):
        t.add_column(c, justify="left" if c == "allocator" else "right", no_wrap=True)
    for name, s in summaries.items():
        m = s["memory"]
        t.add_row(short(name), _pct(m["token_states"]), _pct(m["reservation"]),
                  _pct(m["internal_fragmentation"]), _pct(m["external_fragmentation"]), _pct(m["free"]),
                  f"{s['mean_batch_size']:.1f}", f"{s['num_preemptions']:,}", f"{s['num_rejected']:,}")
    return t


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def serving_table(metrics: dict[str, dict], kinds: tuple[str, ...], percentiles: tuple[float, ...]) -> Table:
    """One row per metric (with its unit), one column per allocator, like `vllm bench serve`'s summary."""
    t = Table(title="Serving metrics", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("metric", no_wrap=True)
    for name in metrics:
        t.add_column(short(name), justify="right", no_wrap=True)
    rows: list[tuple[str, str, int]] = [
        ("Completed requests", "completed", 0), ("Rejected requests", "rejected", 0),
        ("Duration (s)", "duration_s", 1), ("Request throughput (req/s)", "request_throughput", 2),
        ("Output token throughput (tok/s)", "output_throughput", 1),
        ("Total token throughput (tok/s)", "total_token_throughput", 1)]
    if any("request_goodput" in m for m in metrics.values()):
        rows.append(("Request goodput (req/s)", "request_goodput", 2))
    for kind in kinds:
        stats = (("mean", "Mean"), ("median", "Median"),
                 *((f"p{q:g}", f"P{q:g}") for q in percentiles if q != 50))
        for stat, label in stats:
            rows.append((f"{label} {_LABEL[kind]} (ms)", f"{stat}_{kind}_ms", 2))
    for label, key, digits in rows:
        t.add_row(label, *(_fmt(m.get(key), digits) for m in metrics.values()))
    return t


def warn_about(results: dict) -> None:
    """Warn, with reasons and counts, about rejected requests and an overloaded system."""
    for name, res in results.items():
        s = res.summary
        max_len = res.config.get("max_model_len") or res.config.get("engine", {}).get("max_model_len")
        text = rejection_warning(res.request_data(), int(max_len or 0) or 2**62, s["capacity_tokens"])
        if text:
            warn(f"{name}: {text}")
        text = overload_warning(res.request_data(), s["sim_duration_s"])
        if text:
            warn(f"{name}: {text}")

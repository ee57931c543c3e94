"""Result tables for simulate and replay: memory breakdown and `vllm bench serve`-style serving metrics.

Both tables fit in 80 columns at any run length: allocators are shortened (contiguous-max -> max), the
serving metrics are rows with one column per allocator (as vLLM prints one metric per line), numbers keep
at most nine characters, and a latency row whose values reach 100 s is given in seconds
(pagelab/units.py, as the figures choose theirs).
"""
from __future__ import annotations

import math

from rich import box
from rich.table import Table

from cli.common import UserError, model_limit, warn
from pagelab.units import latency_unit
from simulator.metrics import (
    DEFAULT_METRICS,
    DEFAULT_PERCENTILES,
    GPU_POOL_OPTIONS,
    METRICS,
    overload_warning,
    rejection_warning,
)

_LABEL = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


def short(name: str) -> str:
    """contiguous-max -> max (keeps table columns narrow)."""
    return name.removeprefix("contiguous-")


def pct(x: float | None, sign: str = "") -> str:
    """A share in percent with one decimal; "-" for none (NaN: no time passed, every request rejected)."""
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}{sign}"


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


def count(value: int | None, width: int = 7) -> str:
    """A count in at most `width` characters: exact (999,999) while it fits, else in millions (1.2M)."""
    if value is None:
        return "-"
    exact = f"{value:,}"
    return exact if len(exact) <= width else f"{value / 1e6:.1f}M"


def number(value: float | None, digits: int = 2, size: float | None = None) -> str:
    """A number in at most nine characters: fewer decimals as `size` (default: the value's own magnitude;
    a table row passes its largest, so the row keeps one format) grows, then scientific notation."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    size = abs(value) if size is None else size
    if size >= 1e7:
        return f"{value:.3g}"
    if size >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{min(digits, 1) if size >= 100 else digits}f}"


def memory_table(summaries: dict[str, dict]) -> Table:
    """Where the KV memory went (time-weighted % of capacity), batch size, preemptions, rejections; a run
    with KV cache groups names its padding layers (of intern) and window blocks kept for prefix caching (of
    free) beneath."""
    t = Table(title="KV-cache memory, % of capacity (time-weighted)", box=box.SIMPLE_HEAD, pad_edge=False,
              collapse_padding=True)
    for c in ("allocator", "token", "resv", "intern", "extern", "free", "batch", "preempt", "reject"):
        t.add_column(c, justify="left" if c == "allocator" else "right", no_wrap=True)
    parts = []
    for name, s in summaries.items():
        m = s["memory"]
        t.add_row(short(name), pct(m["token_states"]), pct(m["reservation"]),
                  pct(m["internal_fragmentation"]), pct(m["external_fragmentation"]), pct(m["free"]),
                  number(s["mean_batch_size"], 1), count(s["num_preemptions"]), count(s["num_rejected"]))
        if "padding" in m:
            parts.append(f"{short(name)}: padding layers {pct(m['padding'])} of intern; window blocks kept "
                         f"for prefix caching {pct(m['window_cached'])} of free")
    if parts:
        t.caption = "\n".join(parts)
        t.caption_justify = "left"
    return t


def _latency(value: float | None, size: float) -> str:
    """`number(value, 2, size)`, unless that rounds a nonzero latency to 0: then to its own magnitude."""
    text = number(value, 2, size)
    if value and not float(text.replace(",", "")):
        text = number(value, 3)
    return text


def _largest(values) -> float:
    """The largest magnitude among the defined values of a row (0 when none is)."""
    return max((abs(v) for v in values if v is not None and not math.isnan(v)), default=0.0)


def serving_table(metrics: dict[str, dict], kinds: tuple[str, ...], percentiles: tuple[float, ...],
                  summaries: dict[str, dict] | None = None) -> Table:
    """One row per metric (with its unit), one column per allocator, like `vllm bench serve`'s summary;
    with the run summaries, the paged pool's prefix-cache hit rate as a last row."""
    t = Table(title="Serving metrics", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    t.add_column("metric", no_wrap=True)
    for name in metrics:
        t.add_column(short(name), justify="right", no_wrap=True)
    rows: list[tuple[str, str, int]] = [
        ("Completed requests", "completed", -1), ("Rejected requests", "rejected", -1),
        ("Duration (s)", "duration_s", 1), ("Total input tokens", "total_input_tokens", -1),
        ("Total generated tokens", "total_output_tokens", -1),
        ("Request throughput (req/s)", "request_throughput", 2),
        ("Output token throughput (tok/s)", "output_throughput", 1),
        ("Peak output throughput (tok/s)", "max_output_tokens_per_s", 1),
        ("Peak concurrent requests", "max_concurrent_requests", -1),
        ("Total token throughput (tok/s)", "total_token_throughput", 1)]
    if any("request_goodput" in m for m in metrics.values()):
        rows.append(("Request goodput (req/s)", "request_goodput", 2))
    for label, key, digits in rows:
        values = [m.get(key) for m in metrics.values()]
        size = _largest(values)
        t.add_row(label, *(count(v, 9) if digits < 0 else number(v, digits, size) for v in values))
    for kind in kinds:
        stats = (("mean", "Mean"), ("median", "Median"),
                 *((f"p{q:g}", f"P{q:g}") for q in percentiles if q != 50))
        # One unit for all of a metric's rows, so that a percentile never reads below its mean.
        every = [m.get(f"{stat}_{kind}_ms") for stat, _ in stats for m in metrics.values()]
        unit, per_s = latency_unit(None if v is None else v / 1e3 for v in every)
        for stat, label in stats:
            scaled = [None if v is None else v / 1e3 * per_s for m in metrics.values()
                      for v in (m.get(f"{stat}_{kind}_ms"),)]
            t.add_row(f"{label} {_LABEL[kind]} ({unit})", *(_latency(v, _largest(scaled)) for v in scaled))
    if summaries is not None and any(s.get("prefix_cache_hit_rate") is not None for s in summaries.values()):
        t.add_row("Prefix cache hit rate (%)",
                  *(pct(summaries[n].get("prefix_cache_hit_rate")) for n in metrics))
    if summaries is not None and any("kv_tiers" in s for s in summaries.values()):
        _tier_rows(t, [summaries[n].get("kv_tiers") for n in metrics])
    return t


def _tier_rows(t: Table, tiers: list[dict | None]) -> None:
    """Prompt tokens by source (computed, GPU hit, CPU hit, disk hit) as shares of the tokens looked up."""
    sources = ("computed", "gpu_hit", "cpu_hit", "disk_hit")
    labels = ("Prompt tokens computed (%)", "Prompt tokens from GPU cache (%)",
              "Prompt tokens from CPU tier (%)", "Prompt tokens from disk tier (%)")
    for source, label in zip(sources, labels, strict=True):
        if not any(x and source in x["tokens_by_source"] for x in tiers):
            continue
        shares = []
        for x in tiers:
            by = x["tokens_by_source"] if x else {}
            total = sum(by.values())
            shares.append(by[source] / total if by and source in by and total else None)
        t.add_row(label, *(pct(v) for v in shares))


# A pool sized by one of these options ignores the GPU's: only a larger value of that option grows it.
_SIZING_OPTIONS = {"capacity_tokens": "--capacity-tokens", "kv_memory_gb": "--kv-memory-gb",
                   "num_blocks": "--num-blocks"}


def warn_about(results: dict, sized_by: str | None = None) -> None:
    """Warn, with reasons and counts, about rejected requests and an overloaded system.

    `sized_by`: what sized the KV pool (KVCapacity.sized_by), so that the advice names an option that works.
    """
    option = _SIZING_OPTIONS.get(sized_by or "")
    pool_options = f"a larger {option}" if option else GPU_POOL_OPTIONS
    for name, res in results.items():
        s = res.summary
        max_len = res.config.get("max_model_len") or res.config.get("engine", {}).get("max_model_len")
        # A paged pool refuses by blocks (of every KV cache group), a contiguous one by token slots.
        pool = f"{s['num_blocks']:,} blocks of {s['block_size']} tokens" if s.get("allocator") == "paged" \
            else f"{s['capacity_tokens']:,} token slots"
        text = rejection_warning(res.request_data(), int(max_len or 0) or 2**62, pool,
                                 model_limit(res.config.get("model")), pool_options, res.config.get("source"))
        if text:
            warn(f"{name}: {text}")
        text = overload_warning(res.request_data(), s["sim_duration_s"])
        if text:
            warn(f"{name}: {text}")

"""Figure titles that say what was run: trace, model (and GPU), KV capacity, rejected requests.

A figure copied out of its run folder (into a README, a slide) must still say which experiment it shows;
everything here comes from config.json and summary.json (docs/run-format.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePath

from viz.load import AllocatorRun, Run
from viz.palette import allocator_label


@dataclass
class PartRun(Run):
    """A run drawn without some of its allocators (they ran no step): the titles still count them."""

    left_out: dict[str, AllocatorRun] = field(default_factory=dict)


def trace_name(run: Run) -> str | None:
    """The trace's file or bundled name: config.json extra.trace, else the run summary's trace source."""
    for alloc in run.allocators.values():
        extra = alloc.config.get("extra")
        name = extra.get("trace") if isinstance(extra, dict) else None
        name = name or alloc.config.get("trace")
        if isinstance(name, str) and name:
            return PurePath(name).name
    source = run.trace.get("source") or run.trace.get("name")
    return PurePath(source).name if isinstance(source, str) and source else None


def _unique(values: list) -> list:
    """Distinct non-None values in first-seen order."""
    seen: list = []
    for v in values:
        if v is not None and v not in seen:
            seen.append(v)
    return seen


def _capacity(alloc: AllocatorRun) -> str | None:
    """'15,728 tokens (12 GiB)' from summary/config; None when neither records the capacity."""
    tokens = alloc.summary.get("capacity_tokens", alloc.config.get("capacity_tokens"))
    if not isinstance(tokens, (int, float)):
        return None
    gib = alloc.config.get("kv_memory_gb")
    return f"{int(tokens):,} tokens" + (f" ({gib:g} GiB)" if isinstance(gib, (int, float)) else "")


def _capacities(allocs: list[AllocatorRun]) -> str | None:
    """'KV cache 15,728 tokens' when the allocators agree, else each capacity with whose it is: by kind
    ('KV cache: paged 38,736 tokens, contiguous 43,742 tokens') when that is unambiguous, else by
    allocator."""
    known = [(a, c) for a in allocs if (c := _capacity(a)) is not None]
    if not known:
        return None
    if len({c for _, c in known}) == 1:
        return f"KV cache {known[0][1]}"
    by_kind: dict[str, list[str]] = {}
    for alloc, cap in known:
        by_kind.setdefault("paged" if alloc.is_paged else "contiguous", []).append(cap)
    if all(len(set(caps)) == 1 for caps in by_kind.values()):
        return "KV cache: " + ", ".join(f"{kind} {caps[0]}" for kind, caps in by_kind.items())
    return "KV cache: " + ", ".join(f"{allocator_label(a.name)} {c}" for a, c in known)


def _left_out(alloc: AllocatorRun) -> str:
    """Why an allocator is not drawn, as a title says it."""
    total, rejected = alloc.summary.get("num_requests"), alloc.summary.get("num_rejected")
    if isinstance(total, (int, float)) and total and rejected == total:
        return f"{allocator_label(alloc.name)} rejected all {int(total):,} requests (not drawn)"
    return f"{allocator_label(alloc.name)} ran no step (not drawn)"


def _rejected(run: Run) -> str | None:
    """'0 rejected' when every drawn allocator agrees, else 'rejected: paged (vLLM) 0, contiguous (Max) 3';
    then each allocator left out of the figure, with its rejections (a count of the drawn ones alone
    would pass for the whole run)."""
    counts = {name: a.summary.get("num_rejected") for name, a in run.allocators.items()}
    known = {name: int(c) for name, c in counts.items() if isinstance(c, (int, float))}
    parts = []
    if len(set(known.values())) == 1:
        parts.append(f"{next(iter(known.values())):,} rejected")
    elif known:
        parts.append("rejected: " + ", ".join(f"{allocator_label(n)} {c:,}" for n, c in known.items()))
    parts += [_left_out(a) for a in run.left_out.values()] if isinstance(run, PartRun) else []
    return "; ".join(parts) or None


def run_description(run: Run) -> str:
    """One line: trace, model on GPU, capacity, rejected count (parts the run folder lacks are left out)."""
    allocs = list(run.allocators.values())
    models = _unique([a.config.get("model") for a in allocs])
    gpus = _unique([a.config.get("gpu") for a in allocs])
    model = "/".join(map(str, models)) + (f" on {'/'.join(map(str, gpus))}" if models and gpus else "")
    parts = [f"trace {trace_name(run)}" if trace_name(run) else None, model or None,
             _capacities(allocs), _rejected(run)]
    return " · ".join(p for p in parts if p)


MAX_DESCRIBED_RUNS = 4  # more lines would crowd out the figure


def runs_description(runs: list[Run]) -> str:
    """run_description of one run; with several, one line per run prefixed by its label."""
    if len(runs) == 1:
        return run_description(runs[0])
    lines = [f"{run.label}: {run_description(run)}" for run in runs[:MAX_DESCRIBED_RUNS]]
    if len(runs) > MAX_DESCRIBED_RUNS:
        lines.append(f"... and {len(runs) - MAX_DESCRIBED_RUNS} more runs")
    return "\n".join(lines)


def figure_title(what: str, runs: list[Run]) -> str:
    """Suptitle text: what the figure shows, then the run description on its own line(s)."""
    description = runs_description(runs)
    return f"{what}\n{description}" if description else what

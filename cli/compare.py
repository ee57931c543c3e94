"""`pagelab compare A B`: a simulation against a replay (how far the model is from the measurement), or any
two runs of one kind side by side (configuration, memory, batch, throughput, latency, and the changes)."""
from __future__ import annotations

import math
from functools import partial
from pathlib import Path, PurePath

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from cli.common import UserError, console, err_console, figure_format, user_errors, warn
from cli.report import number, pct
from pagelab.units import latency_unit

CONFIG_KEYS = ("model", "gpu", "kv_cache_dtype", "allocator", "block_size", "capacity_tokens",
               "max_model_len", "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
               "preemption_mode", "swap_space_gb", "enable_prefix_caching", "placement", "latency", "mode",
               "trace", "rate")
SHOWN_ALWAYS = ("model", "allocator", "block_size", "capacity_tokens")  # other keys only when they differ
LATENCIES = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E latency"))
MEMORY_PARTS = {"internal_fragmentation": (("padding", "  of which padding layers"),),
                "free": (("window_cached", "  of which window blocks kept for prefix caching"),)}


_pct = partial(pct, sign="%")


def run_kind(run: Path) -> str:
    """"measured" when a run folder holds a replay, else "simulated"."""
    from bench.run_tools import allocator_dirs, read_config

    sources = {read_config(folder).get("source") for _, folder in allocator_dirs(run)}
    return "measured" if "replay" in sources else "simulated"


def _config_value(config: dict, key: str):
    """A configuration value from config.json, looking under `extra` and `engine` too."""
    for place in (config, config.get("extra") or {}, config.get("engine") or {}):
        if isinstance(place, dict) and place.get(key) is not None:
            return place[key]
    return None


def side_by_side(a: tuple[dict, dict], b: tuple[dict, dict]) -> list[tuple[str, str, object, object]]:
    """(section, row label, value in A, value in B) of two allocator runs, each given as (config.json,
    summary.json): the configuration (what differs, and the pool), memory, batch, throughput, latency."""
    from simulator.tier_config import TIER_FIELDS

    (ca, sa), (cb, sb) = a, b
    rows: list[tuple[str, str, object, object]] = []
    for key in (*CONFIG_KEYS, *TIER_FIELDS):
        va, vb = _config_value(ca, key), _config_value(cb, key)
        if key == "capacity_tokens":
            va, vb = sa.get(key, va), sb.get(key, vb)
        if key in SHOWN_ALWAYS or va != vb:
            rows.append(("configuration", key, va, vb))
    ma, mb = sa.get("memory") or {}, sb.get("memory") or {}
    for state in ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free"):
        rows.append(("memory (% of capacity)", state.replace("_", " "), _scaled(ma.get(state), 100),
                     _scaled(mb.get(state), 100)))
        # A part of the state, where either run carries it (runs with KV cache groups; 0 in others).
        for part, label in MEMORY_PARTS.get(state, ()):
            if part in ma or part in mb:
                rows.append(("memory (% of capacity)", label, _scaled(ma.get(part, 0.0), 100),
                             _scaled(mb.get(part, 0.0), 100)))
    for key, label in (("mean_batch_size", "mean batch size"), ("num_preemptions", "preemptions"),
                       ("num_rejected", "rejected requests"),
                       ("prefix_cache_hit_rate", "prefix hit rate (%)")):
        scale = 100 if key == "prefix_cache_hit_rate" else 1
        rows.append(("batch", label, _scaled(sa.get(key), scale), _scaled(sb.get(key), scale)))
    for key, label in (("sim_duration_s", "duration (s)"), ("throughput_tokens_per_s", "output tokens/s")):
        rows.append(("throughput", label, sa.get(key), sb.get(key)))
    for key, label in LATENCIES:
        for stat in ("mean", "p50", "p90", "p99"):
            va, vb = (sa.get(key) or {}).get(stat), (sb.get(key) or {}).get(stat)
            unit, per_s = latency_unit((va, vb))  # ms, or s from 100 s on, as the serving table
            rows.append(("latency", f"{label} {stat} ({unit})", _scaled(va, per_s), _scaled(vb, per_s)))
    return rows


def _scaled(value, factor: float):
    return None if value is None else value * factor


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return PurePath(value).name if "/" in value else value  # a path by its last part: cells stay short
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return number(float(value))


def _change(va, vb) -> tuple[str, str]:
    """(B - A, relative change) for numbers; blanks otherwise."""
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb))
    if not numeric:
        return ("" if va == vb else "differs"), ""
    diff = vb - va
    if diff == 0:
        return "0", ""
    shown = f"{diff:+,}" if isinstance(diff, int) else ("+" if diff > 0 else "-") + number(abs(diff))
    if not va or not math.isfinite(va):
        return shown, "-"
    ratio = vb / va
    return shown, (f"{100 * (ratio - 1):+.1f}%" if 0.1 < ratio < 10 else f"{ratio:.3g}x")


def side_by_side_tables(rows) -> tuple[Table, Table]:
    """The configuration of A and B (values whole, however long), then one row per measured quantity:
    A, B, their difference and the relative change."""
    config = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    config.add_column("configuration", no_wrap=True)
    for head in ("A", "B"):
        config.add_column(head, justify="right", no_wrap=True)
    numbers = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    numbers.add_column("", no_wrap=True)
    for head in ("A", "B", "B - A", "change"):
        numbers.add_column(head, justify="right", no_wrap=True)
    section = None
    for sec, label, va, vb in rows:
        if sec == "configuration":
            config.add_row(f"  {label}", _cell(va), _cell(vb))
            continue
        if sec != section:
            numbers.add_row(Text(sec, style="bold"), "", "", "", "")
            section = sec
        numbers.add_row(f"  {label}", _cell(va), _cell(vb), *_change(va, vb))
    return config, numbers


def comparison_report(result: dict) -> Table:
    """The simulated-vs-measured table."""
    t = Table(title="simulated vs measured (relative error = (sim - real) / real)")
    for c in ("metric", "median |err|", "p90 |err|", "median err", "n"):
        t.add_column(c, justify="left" if c == "metric" else "right")
    for metric, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end latency")):
        s = result["latency"][metric]
        t.add_row(label, _pct(s["median_abs"]), _pct(s["p90_abs"]), _pct(s["median"]), str(s["count"]))
    s = result["step_time"]
    basis = "model" if s["basis"].startswith("latency") else "index"
    t.add_row(f"step time (by {basis})", _pct(s["median_abs"]), _pct(s["p90_abs"]), _pct(s["median"]),
              str(s["count"]))
    thr = result["throughput"]
    t.add_row("output throughput", _pct(None if thr["rel_error"] is None else abs(thr["rel_error"])), "-",
              _pct(thr["rel_error"]), "1")
    return t


def _pick(run: Path, allocator: str | None, other: Path) -> tuple[str, Path]:
    """The allocator folder of `run` to compare: `allocator`, else the first `other` has too, else the
    only one it has."""
    from bench.run_tools import allocator_dirs

    mine = dict(allocator_dirs(run, allocator))
    theirs = dict(allocator_dirs(other, allocator))
    common = [n for n in mine if n in theirs]
    if common:
        return common[0], mine[common[0]]
    if len(mine) == 1 and len(theirs) == 1:
        return next(iter(mine.items()))
    raise UserError(f"{run} and {other} share no allocator ({', '.join(mine)} vs {', '.join(theirs)}); give "
                    "two allocator folders (RUN/ALLOCATOR) or --allocator")


@user_errors
def compare_cmd(
    run_a: Path = typer.Argument(..., metavar="A",
                                 help="A run folder (or one allocator's folder RUN/NAME)."),
    run_b: Path = typer.Argument(..., metavar="B",
                                 help="Another; when one of A and B is a replay and the other a simulation, "
                                      "the simulation is judged against it."),
    allocator: str = typer.Option(None, help="Allocator to compare (default: the first both runs have)."),
    out: Path = typer.Option(None, "--out", "-o", help="Write comparison.json and the figures here."),
    fmt: str = typer.Option(None, "--format", "-f",
                            help="Figure format with --out: png (default), svg or pdf."),
) -> None:
    """Compare two runs: a simulation against a replay, or two runs of one kind side by side."""
    if fmt is not None and out is None:  # figures are drawn only into --out
        raise UserError(f"--format {fmt} is the format of the figures --out writes: give --out too")
    fmt = figure_format(fmt or "png")
    kinds = (run_kind(run_a), run_kind(run_b))
    if out is not None:
        from cli.runs import check_out_folder

        check_out_folder(out, f"--out {out}")
    if set(kinds) == {"simulated", "measured"}:
        sim, real = (run_a, run_b) if kinds[0] == "simulated" else (run_b, run_a)
        return _sim_vs_real(sim, real, allocator, out, fmt)
    _side_by_side(run_a, run_b, kinds[0], allocator, out, fmt)
    return None


def _side_by_side(run_a: Path, run_b: Path, kind: str, allocator: str | None, out: Path | None,
                  fmt: str) -> None:
    """Two runs of one kind: the table, and with --out comparison.json, latency CDFs and breakdowns."""
    from bench.run_tools import read_config
    from viz.load import load_allocator

    name_a, folder_a = _pick(run_a, allocator, run_b)
    name_b, folder_b = _pick(run_b, allocator, run_a)
    a, b = load_allocator(folder_a), load_allocator(folder_b)
    rows = side_by_side((read_config(folder_a), a.summary), (read_config(folder_b), b.summary))
    console.print(f"{kind} vs {kind}: A = {run_a} ({name_a}), B = {run_b} ({name_b})", markup=False)
    for table in side_by_side_tables(rows):
        console.print(table)
    if out is None:
        return
    from pagelab.run_folder import write_json
    from viz import no_steps, plot_runs
    from viz.common import staged_folder

    if no_steps(a) and no_steps(b):  # refused before comparison.json is written: nothing half done
        raise UserError(f"--out {out}: no figure can be drawn: {folder_a}: {no_steps(a)}; {folder_b}: "
                        f"{no_steps(b)}")
    with staged_folder(out) as tmp:  # a figure that fails leaves no comparison.json in `out`
        write_json(tmp / "comparison.json", {
            "kind": f"{kind} vs {kind}", "a": {"run": str(run_a), "allocator": name_a},
            "b": {"run": str(run_b), "allocator": name_b},
            "rows": [{"section": s, "quantity": q, "a": va, "b": vb} for s, q, va, vb in rows]})
        paths = plot_runs([folder_a, folder_b], tmp, fmt, ["breakdown", "latency_cdf"], warn=warn)
    err_console.print(f"wrote {out / 'comparison.json'} and {', '.join(str(out / p.name) for p in paths)}",
                      markup=False)


def _sim_vs_real(sim_run: Path, real_run: Path, allocator: str | None, out: Path | None, fmt: str) -> None:
    """Latency, throughput, step-time and per-step memory differences of a simulation and a replay."""
    from bench.run_tools import compare_folders, write_comparison
    from simulator.timing.step_latency import STALL_FACTOR
    from viz.common import staged_folder

    _check_steps(sim_run, real_run, allocator)
    result, sim_folder, real_folder = compare_folders(sim_run, real_run, allocator)
    for message in result.get("warnings", []):
        warn(message)
    console.print(comparison_report(result))
    st, mem = result["step_time"], result["memory"]
    console.print(f"steps: {st['num_steps_sim']} simulated, {st['num_steps_real']} measured; total step "
                  f"time error {_pct(st['total_rel_error'])}; run duration error "
                  f"{_pct(result['duration']['rel_error'])}")
    stalled = st.get("stalls") or {"count": 0}
    if stalled["count"]:
        shown = ", ".join(map(str, stalled["steps"][:8])) + (", ..." if stalled["count"] > 8 else "")
        console.print(f"stalls: {stalled['count']} measured steps took >= {STALL_FACTOR:g}x what the model "
                      f"prices them (+{stalled['excess_s']:.2f} s, {_pct(stalled['busy_share'])} of the "
                      f"measured busy time; steps {shown}): first-use kernel compiles or pauses no step "
                      "model can price (docs/calibration.md)")
    if mem["step_aligned"]:
        verdict = "equal at every step" if mem["equal"] else f"differs at {mem['num_steps_differing']} steps"
        console.print(f"memory breakdown: {verdict} (largest difference "
                      f"{max(mem['max_abs_difference'].values(), default=0):.3g})")
    else:
        console.print(f"memory breakdown: not compared ({mem['reason']})")
    if out is not None:
        with staged_folder(out) as tmp:  # a figure that fails leaves no comparison.json in `out`
            path = write_comparison(tmp, result, sim_folder, real_folder, fmt)
        err_console.print(f"wrote {out / 'comparison.json'}" + (f" and {out / path.name}" if path else ""))


def _check_steps(sim_run: Path, real_run: Path, allocator: str | None) -> None:
    """Refuse, before any work, a replay's steps table without a column the step times are compared by
    (calibrate's check, on the columns alone); a table that cannot be read is compare's warning."""
    import pandas as pd

    from bench.run_tools import allocator_dirs
    from simulator.timing.calibrate import check_steps
    from viz.tables import table_columns

    sims = dict(allocator_dirs(sim_run, allocator))
    for name, folder in allocator_dirs(real_run, allocator):
        columns = table_columns(folder, "steps") if name in sims else None
        if columns is not None:
            check_steps(pd.DataFrame(columns=columns), str(folder))

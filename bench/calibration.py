"""Held-out validation of a latency profile (`python -m bench.calibration`; docs/calibration.md).

The validation targets (TARGET_E2E, TARGET_THROUGHPUT), measured in one command: the first 120 requests of the
bundled Azure conversation trace are cut into three parts of 40 (A, B, C; each shifted to start at 0), and A
is also run at half the rate (`--time-scale 2`, "A-x2"); `--parts ...,code` adds another trace, the first 40
requests of Azure's code trace (long prompts, short outputs). None of them is in the `make profile`
calibration set. Each part is replayed on the engine (by default the CPU engine: tiny preset, torch backend,
CPU-time clock, block size 16, 0.25 GiB of KV, recompute preemption, prefix caching on; `--device cuda`:
llama-1b-shape, Triton, wall clock, 8 GiB of KV; bench/replay_setup.py), simulated with the profile on the
replay's own configuration (`simulate --profile P --config-from RUN`), and compared (`pagelab compare`). The
table gives, per run, the errors of the simulation against the measurement and whether each target is met.
Parts replayed twice (`--repeat`) also give the noise floor: each repeat compared with its first replay, and
whether the machine repeats itself within the targets at all (if not, no verdict above says anything about the
model).

Everything runs in this process through the library functions behind the `pagelab replay`, `simulate
--config-from` and `compare` commands (gpu_backend/replay_run.py, bench/run_tools.py), so the run folders
under --out hold what a user would get by typing the commands one by one (docs/calibration.md, "The loop").
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import pandas as pd

from bench.replay_setup import ReplaySetup, add_arguments, replay
from pagelab.errors import PagelabError

# name -> (bundled trace, first request, arrival time scale); the order of docs/calibration.md's table.
PARTS = {"A": ("azure-conv", 0, 1.0), "B": ("azure-conv", 40, 1.0), "A-x2": ("azure-conv", 0, 2.0),
         "C": ("azure-conv", 80, 1.0), "code": ("azure-code", 0, 1.0)}
DEFAULT_PARTS = ("A", "B", "A-x2", "C")
PART_SIZE = 40
# The validation targets: median |end-to-end latency error| and |output throughput error| per held-out run.
TARGET_E2E = 0.10
TARGET_THROUGHPUT = 0.05
COLUMNS = ("e2e median |err|", "e2e p90 |err|", "TTFT median |err|", "TPOT median |err|", "throughput err",
           "step median |err|", "total busy time err")
# A repeat against its first replay, signed as (repeat - first) / first.
FLOOR_COLUMNS = ("e2e median |diff|", "throughput diff", "total busy time diff")


def held_out_part(trace: pd.DataFrame, start: int, size: int = PART_SIZE) -> pd.DataFrame:
    """Requests [start, start + size) of a trace, their arrivals shifted so the first one is at 0."""
    part = trace.iloc[start: start + size].reset_index(drop=True).copy()
    if len(part) < size:
        raise ValueError(f"the trace has {len(trace)} requests; part [{start}, {start + size}) is short")
    part["arrival_s"] = part["arrival_s"] - part["arrival_s"].iloc[0]
    return part


def run_names(parts: list[str], repeats: list[str]) -> list[tuple[str, str]]:
    """(run folder name, part) of every replay: the parts, then the repeats (folder NAME-repeat[K])."""
    runs, seen = [], {}
    for part in [*parts, *repeats]:
        if part not in PARTS:
            raise ValueError(f"unknown part {part!r}; choose from {', '.join(PARTS)}")
        seen[part] = seen.get(part, 0) + 1
        k = seen[part]
        runs.append((part if k == 1 else f"{part}-repeat" + ("" if k == 2 else str(k - 1)), part))
    return runs


def replay_run(trace_csv: Path, time_scale: float, setup: ReplaySetup, out: Path, reuse: bool) -> Path:
    """Replay one run into OUT/real (unless `reuse` finds one there); the run folder."""
    real = out / "real"
    if not (reuse and (real / "summary.json").is_file()):
        replay(setup, trace_csv, real, PART_SIZE, time_scale)
    return real


def part_trace(out: Path, part: str) -> Path:
    """The trace file of a part's requests under `out` (written by `replay_all`)."""
    trace, start, _ = PARTS[part]
    return out / f"{trace}-{start}-{start + PART_SIZE - 1}.csv"


def validate_run(real: Path, profile: str, out: Path, trace: Path) -> dict:
    """Simulate the replay in `real` with the profile and compare the two; the comparison's JSON. The
    trace is named, not taken from the replay's config.json, whose path is the replaying machine's."""
    sim, cmp = out / "sim", out / "compare"
    simulate_replay(trace, profile, real, sim)
    return compare(sim, real, cmp)


def simulate_replay(trace: Path, profile: str, real: Path, out: Path) -> Path:
    """Simulate the replay in `real` with the profile on the replay's own configuration into the run folder
    `out`, replacing the one there: what `pagelab simulate TRACE --profile P --config-from REAL` writes."""
    from bench.run_tools import (
        replay_twin,
        serving_metrics,
        simulate_runs,
        simulation_labels,
        simulation_metadata,
    )
    from pagelab.atomic import atomic_dir
    from pagelab.run_folder import write_run_files
    from simulator.config import SimConfig
    from simulator.timing.step_latency import load_fitted
    from traces import load_trace
    from traces.stats import trace_info

    source = str(trace)
    df = load_trace(source)
    info = {"source": source, **trace_info(df), "rate_override": None, "burstiness": None, "limit": None}
    fitted = load_fitted(profile)
    base = SimConfig(model=fitted.model.name, gpu=fitted.gpu.name, latency=profile,
                     extra=simulation_labels(info))
    name, df, base, _, _ = replay_twin(real, df, base, step_times=False)
    with atomic_dir(out) as tmp:
        results = simulate_runs(df, {name: dataclasses.replace(base, allocator=name)}, tmp,
                                info["num_requests"])
        write_run_files(tmp, info, results, metadata=simulation_metadata(base, [name], source),
                        extra_summary={"serving_metrics": serving_metrics(results)})
    return out


def compare(sim: Path, real: Path, out: Path) -> dict:
    """Compare the run `sim` with the run `real` into `out` (what `pagelab compare SIM REAL --out OUT`
    writes); the comparison."""
    from bench.run_tools import compare_folders, write_comparison

    result, sim_folder, real_folder = compare_folders(sim, real)
    write_comparison(out, result, sim_folder, real_folder)
    return json.loads((out / "comparison.json").read_text())


def summary_row(comparison: dict) -> dict[str, float | None]:
    """The table's columns (fractions, signed where the name says err) of one comparison."""
    lat, step = comparison["latency"], comparison["step_time"]
    values = (lat["e2e_s"]["median_abs"], lat["e2e_s"]["p90_abs"], lat["ttft_s"]["median_abs"],
              lat["tpot_s"]["median_abs"], comparison["throughput"]["rel_error"], step["median_abs"],
              step["total_rel_error"])
    return dict(zip(COLUMNS, values, strict=True))


def verdicts(row: dict) -> tuple[bool, bool]:
    """(e2e target met, throughput target met) for one run's row."""
    e2e, thr = row["e2e median |err|"], row["throughput err"]
    return (e2e is not None and e2e <= TARGET_E2E, thr is not None and abs(thr) <= TARGET_THROUGHPUT)


def markdown_table(rows: dict[str, dict]) -> str:
    """The rows as docs/calibration.md's table, plus the two target columns."""
    signed = {"throughput err", "total busy time err"}
    head = ["held-out run", *COLUMNS, "e2e <= 10%", "throughput <= 5%"]
    lines = ["| " + " | ".join(c.replace("|", "\\|") for c in head) + " |", "|" + "---|" * len(head)]
    for name, row in rows.items():
        cells = ["-" if v is None else f"{100 * v:+.1f}%" if c in signed else f"{100 * v:.1f}%"
                 for c, v in row.items()]
        cells += ["met" if ok else "NOT met" for ok in verdicts(row)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict_lines(rows: dict[str, dict]) -> list[str]:
    """One line per target: on how many held-out runs it is met, and which miss it."""
    targets = (f"e2e median |err| <= {TARGET_E2E:.0%}", f"|throughput err| <= {TARGET_THROUGHPUT:.0%}")
    return [f"{target}: met on {len(rows) - len(missed)} of {len(rows)} held-out runs"
            + (f", NOT met on {', '.join(missed)}" if missed else "")
            for target, missed in zip(targets, _missed(rows), strict=True)]


def _missed(rows: dict[str, dict]) -> tuple[list[str], list[str]]:
    """The runs that miss the e2e target, and those that miss the throughput target."""
    return ([n for n, row in rows.items() if not verdicts(row)[0]],
            [n for n, row in rows.items() if not verdicts(row)[1]])


def floor_pairs(runs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(repeat, first replay of its part) for every repeat among `runs` (as `run_names` gives them)."""
    first: dict[str, str] = {}
    pairs = []
    for name, part in runs:
        if part in first:
            pairs.append((name, first[part]))
        else:
            first[part] = name
    return pairs


def floor_row(comparison: dict) -> dict[str, float | None]:
    """The floor table's columns (fractions) of a repeat compared with its first replay."""
    values = (comparison["latency"]["e2e_s"]["median_abs"], comparison["throughput"]["rel_error"],
              comparison["step_time"]["total_rel_error"])
    return dict(zip(FLOOR_COLUMNS, values, strict=True))


def noise_floor(out: Path, pairs: list[tuple[str, str]]) -> dict[str, dict]:
    """Compare each repeat's replay with its first one (`pagelab compare`, into OUT/REPEAT/floor)."""
    rows = {}
    for repeat, first in pairs:
        comparison = compare(out / repeat / "real", out / first / "real", out / repeat / "floor")
        rows[f"{repeat} vs {first}"] = floor_row(comparison)
    return rows


def floor_table(rows: dict[str, dict]) -> str:
    """The floor rows as a markdown table."""
    head = ["repeat vs first replay", *FLOOR_COLUMNS]
    lines = ["| " + " | ".join(c.replace("|", "\\|") for c in head) + " |", "|" + "---|" * len(head)]
    for name, row in rows.items():
        cells = ["-" if v is None else f"{100 * v:.1f}%" if c == FLOOR_COLUMNS[0] else f"{100 * v:+.1f}%"
                 for c, v in row.items()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _floor_over(row: dict) -> list[str]:
    """How a repeat's floor row exceeds the targets ("e2e 12.3%", "throughput +6.1%"); empty: within both."""
    e2e, thr = row[FLOOR_COLUMNS[0]], row[FLOOR_COLUMNS[1]]
    return ([f"e2e {100 * e2e:.1f}%"] if e2e is None or e2e > TARGET_E2E else []) + \
           ([f"throughput {100 * thr:+.1f}%"] if thr is None or abs(thr) > TARGET_THROUGHPUT else [])


def floor_lines(rows: dict[str, dict]) -> list[str]:
    """Whether this machine repeats its own replays within the targets: where it does not, a part's
    verdicts measure the machine's noise as much as the model's error."""
    if not rows:
        return ["noise floor: not measured (--repeat B,A,C measures it), so the verdicts above cannot tell "
                "the model's error from the machine's noise"]
    noisy, steady = [], []
    for name, row in rows.items():
        over = _floor_over(row)
        part = name.split(" vs ")[1]
        (noisy if over else steady).append(f"{part} ({', '.join(over)})" if over else part)
    if not noisy:
        return [f"noise floor within both targets on every repeated part ({', '.join(steady)}): the verdicts "
                "above judge the model"]
    return [f"noise floor ABOVE a target on {', '.join(noisy)}: this machine does not repeat those replays "
            "within the targets, so their verdicts cannot judge the model"
            + (f"; {', '.join(steady)} within both" if steady else "")]


def judged_lines(rows: dict[str, dict], floor: dict[str, dict], runs: list[tuple[str, str]]) -> list[str]:
    """The targets counted over the runs whose part the machine repeats within both targets (each of its
    repeats against its first replay): the verdicts that measure the model rather than the machine."""
    if not floor:
        return []
    parts = [p for p, ok in steady_parts(floor).items() if ok]
    if not parts:
        return ["judged runs: none (no repeated part is within both targets of its first replay)"]
    judged = {name: rows[name] for name, part in runs if part in parts and name in rows}
    return [f"judged runs ({', '.join(parts)} and their repeats): {target} target met on "
            f"{len(judged) - len(missed)} of {len(judged)}"
            + (f", NOT met on {', '.join(missed)}" if missed else "")
            for target, missed in zip(("e2e", "throughput"), _missed(judged), strict=True)]


def steady_parts(floor: dict[str, dict]) -> dict[str, bool]:
    """Repeated part -> whether every repeat of it is within both targets of its first replay."""
    steady: dict[str, bool] = {}
    for name, row in floor.items():
        part = name.split(" vs ")[1]
        steady[part] = steady.get(part, True) and not _floor_over(row)
    return steady


def part_floors(floor: dict[str, dict]) -> dict[str, tuple]:
    """part -> (e2e |diff|, throughput diff) of its repeats against its first replay: with several
    repeats the largest of each (None, as in the table, where a comparison had no value)."""
    worst: dict[str, tuple] = {}
    for pair, row in floor.items():
        part = pair.split(" vs ")[1]  # the first replay's folder is named after its part
        e2e, thr = row[FLOOR_COLUMNS[0]], row[FLOOR_COLUMNS[1]]
        if part in worst:
            e0, t0 = worst[part]
            e2e = None if None in (e0, e2e) else max(e0, e2e)
            thr = None if None in (t0, thr) else max(t0, thr, key=abs)
        worst[part] = (e2e, thr)
    return worst


def held_out_runs(rows: dict[str, dict], floor: dict[str, dict], runs: list[tuple[str, str]]) -> list:
    """The figure's rows: each run's errors, its verdicts, and its part's floor and whether it is judged."""
    from viz.validation import HeldOutRun

    parts, steady, floors = dict(runs), steady_parts(floor), part_floors(floor)
    out = []
    for name, row in rows.items():
        floor_e2e, floor_throughput = floors.get(parts[name], (None, None))
        out.append(HeldOutRun(name, row["e2e median |err|"], row["throughput err"], *verdicts(row),
                              judged=steady.get(parts[name], False), floor_e2e=floor_e2e,
                              floor_throughput=floor_throughput))
    return out


def save_validation_figure(rows: dict[str, dict], floor: dict[str, dict], runs: list[tuple[str, str]],
                           path: Path, title: str) -> Path:
    """validation.png: every run's errors against the targets beside its part's noise floor."""
    from viz.common import save_figure
    from viz.validation import plot_validation

    fig = plot_validation(held_out_runs(rows, floor, runs), TARGET_E2E, TARGET_THROUGHPUT, title)
    return save_figure(fig.figure, path, "png")


def replay_all(setup: ReplaySetup, out: Path, runs: list[tuple[str, str]],
               reuse: bool = False) -> dict[str, Path]:
    """Write each part's trace into `out` and replay every (run name, part); run name -> replay folder."""
    from traces import load_trace, save_trace

    out.mkdir(parents=True, exist_ok=True)
    reals = {}
    for name, part in runs:
        trace, start, scale = PARTS[part]
        trace_csv = part_trace(out, part)
        if not trace_csv.is_file():
            save_trace(held_out_part(load_trace(trace), start), trace_csv)
        reals[name] = replay_run(trace_csv, scale, setup, out / name, reuse)
    return reals


def replay_only(setup: ReplaySetup, out: Path, runs: list[tuple[str, str]], reuse: bool = False) -> str:
    """Replay every run and measure the repeats' noise floor, no profile needed; the floor's report."""
    replay_all(setup, out, runs, reuse)
    floor = noise_floor(out, floor_pairs(runs))
    return "\n".join([floor_table(floor)] * bool(floor) + floor_lines(floor))


def validate(profile: str, out: Path, runs: list[tuple[str, str]], reuse: bool = False,
             setup: ReplaySetup | None = None) -> dict[str, dict]:
    """Replay, simulate and compare every (run name, part); measure the noise floor of the repeats; write
    validation.md/.json; the table's rows."""
    reals = replay_all(setup or ReplaySetup(), out, runs, reuse)
    parts = dict(runs)
    rows = {name: summary_row(validate_run(real, profile, out / name, part_trace(out, parts[name])))
            for name, real in reals.items()}
    floor = noise_floor(out, floor_pairs(runs))
    table = markdown_table(rows)
    lines = verdict_lines(rows) + floor_lines(floor) + judged_lines(rows, floor, runs)
    traces = ", ".join(dict.fromkeys(PARTS[part][0] for _, part in runs))
    report = f"profile {profile}, held-out runs of {traces} (docs/calibration.md)\n\n{table}\n\n"
    if floor:
        report += f"Noise floor (each repeat against its first replay):\n\n{floor_table(floor)}\n\n"
    report += "\n".join(lines)
    print(f"\n{report}")
    (out / "validation.md").write_text(report + "\n")
    (out / "validation.json").write_text(json.dumps({"profile": profile, "rows": rows, "floor": floor,
                                                     "verdicts": lines}, indent=2) + "\n")
    save_validation_figure(rows, floor, runs, out / "validation.png", f"Held-out validation of {profile}")
    print(f"wrote {out / 'validation.md'}, validation.json and validation.png")
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command line of `python -m bench.calibration` (also `pagelab bench calibration`)."""
    ap = argparse.ArgumentParser(prog="python -m bench.calibration", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu-tiny", help="bundled profile name or JSON file (default "
                    "cpu-tiny)")
    ap.add_argument("--out", type=Path, default=Path("runs/validate"), help="folder of every run (default "
                    "runs/validate)")
    ap.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"held-out runs, comma-separated "
                    f"(default {','.join(DEFAULT_PARTS)}; also: "
                    f"{', '.join(p for p in PARTS if p not in DEFAULT_PARTS)})")
    ap.add_argument("--repeat", default="", help="parts replayed a second time, e.g. B,A,C (the noise floor)")
    ap.add_argument("--reuse", action="store_true", help="keep replays already in --out (validate another "
                    "profile on the same measurements)")
    ap.add_argument("--replay-only", action="store_true", help="replay the runs and stop (measure on one "
                    "machine, validate with --reuse on another)")
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        runs = run_names(split_names(args.parts), split_names(args.repeat))
    except ValueError as exc:
        ap.error(str(exc))
    setup = ReplaySetup.from_args(args)
    try:
        if args.replay_only:
            print(replay_only(setup, args.out, runs, args.reuse))
        else:
            validate(args.profile, args.out, runs, args.reuse, setup)
    except PagelabError as exc:  # a bad profile, trace or run folder: one line, as the commands print it
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    return 0


def split_names(text: str | None) -> list[str]:
    """Comma-separated part names, blanks dropped."""
    return [p.strip() for p in (text or "").split(",") if p.strip()]


if __name__ == "__main__":
    sys.exit(main())

"""The GPU check in one go: `python -m bench.gpu [--out DIR] [--budget-s 300]` (`make gpu-check`).

On a machine whose image has torch, Triton and transformers, after `pip install --no-deps
--no-build-isolation -e .`, it measures in one process, part by part, within a time budget (a device is
lent 15 minutes in all, start-up included): the GPU tests (`pytest -m gpu`); `bench attention` at
B1x32k, B16x1k, B64x1k and B64x32k against SDPA and the copy bandwidth; sliding-window decode against
full attention at the same number of KV blocks read (bench.window_attention); the CPU KV tier's load of
256 blocks against the latency model's `load_time`; decode step p50 at batch 64 and 256
(llama-1b-shape, bf16, CUDA graphs and eager) on 256 azure-conv requests arriving at once, with their
context lengths and each step's weights+KV read time; where a steady decode step of 64 sequences spends
its time (bench.decode_profile: wall against kernel time, the top kernels); the memory-bound
four-allocator replay (2 GiB of KV); contiguous-max against paged replay wall at the same batch limit;
the held-out calibration replays (azure-code first) with their stalls against a profile of this GPU
kind (the bundled h200-llama-1b on an H200; elsewhere one is fitted first when time allows); engine
throughput against transformers on the same 256 requests. A part that does not fit in the time left is
skipped and says so.

It writes DIR/gpu-check.json (everything), DIR/gpu-check.md (the device, then one table with the targets)
and DIR/gpu-check-runs.tar.gz (the --runs folder: every replay's run folder and the tests' junit report):
the simulations, comparisons and figures that need only a CPU run afterwards from the unpacked folders
(the Markdown lists the commands).

Without CUDA (or with --dry-run) the same code runs end to end at toy sizes on the CPU (tiny preset, torch
backend; the GPU tests collected, not run), which is how CI tests it.
"""
from __future__ import annotations

import argparse
import json
import sys
import tarfile
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from bench import gpu_parts as parts
from bench.gpu_report import markdown, next_steps, verdicts


class Check:
    """One run of the check: its setup, folders, clock and what the parts share."""

    def __init__(self, setup: parts.CheckSetup, out: Path, runs: Path, budget_s: float):
        self.setup, self.out, self.runs, self.budget_s = setup, out, runs, budget_s
        self.start = time.perf_counter()
        self.deadline = self.start + budget_s
        self.copy_gbps: float | None = None
        self.device: dict = {}
        self._model = None

    def left(self) -> float:
        """Seconds left of the budget."""
        return self.deadline - time.perf_counter()

    def fits(self, seconds: float) -> bool:
        """Whether a step estimated at `seconds` on a GPU fits in the time left (a dry run runs it all)."""
        return self.setup.dry_run or self.left() >= seconds

    def model(self):
        """The check's model, built on first use and shared by its replays."""
        if self._model is None:
            self._model = parts.build_model(self.setup)
        return self._model

    def copy_bandwidth(self) -> float:
        """GB/s of a device-to-device copy (read + written), measured once."""
        if self.copy_gbps is None:
            import torch

            from bench.attention import copy_bandwidth_gbps

            self.copy_gbps = round(copy_bandwidth_gbps(torch.device(self.setup.device)), 1)
        return self.copy_gbps


# ----------------------------------------------------------------- the parts
def part_tests(check: Check) -> dict:
    """`pytest -m gpu` with what the budget leaves it (at most 75 s)."""
    return parts.gpu_tests(check.runs, max(10.0, min(75.0, check.left() - 200.0)))


def part_attention(check: Check) -> dict:
    """The decode-attention shapes against SDPA and the copy bandwidth."""
    result = parts.attention(check.setup)
    check.copy_gbps = result["copy_gb_per_s"]
    return result


def part_window_attention(check: Check) -> dict:
    """Sliding-window decode against full attention at the same blocks read (bench.window_attention)."""
    from bench.window_attention import default_config, run_window_bench

    return run_window_bench(default_config(check.setup.device))


def part_decode(check: Check) -> dict:
    """Decode step p50 at each batch limit, with CUDA graphs and eagerly (on a CPU: eager only)."""
    setup = check.setup
    df, info = parts.workload(setup)
    modes = (False, True) if setup.device == "cuda" else (True,)
    out: dict = {"requests": len(df), "trace": "azure-conv", "kv_memory_gb": setup.decode_kv_gb}
    for batch in setup.decode_batches:
        for eager in modes:
            name = f"b{batch}-{'eager' if eager else 'graphs'}"
            if not check.fits(20):
                out[name] = {"skipped": f"needs ~20 s, {check.left():.0f} s left"}
                continue
            config = parts.replay_config(setup, max_num_seqs=batch, kv_memory_gb=setup.decode_kv_gb,
                                         enforce_eager=eager)
            res = parts.replay_into(check.runs / "decode" / name, df, info, {"paged": config},
                                    check.model())["paged"]
            out[name] = {**parts.decode_steps(res, batch, check.copy_bandwidth()),
                         "max_num_seqs": batch, "replay_wall_s": res.summary["sim_duration_s"],
                         "num_preemptions": res.summary["num_preemptions"]}
    return out


def part_decode_profile(check: Check) -> dict:
    """Where a steady decode step of 64 sequences goes: wall against kernel time, the top kernels."""
    from bench.decode_profile import profile_decode

    if check.setup.dry_run:
        return profile_decode(check.model(), num_seqs=2, prompt_len=16, steps=3, max_model_len=256)
    return profile_decode(check.model(), num_seqs=64, prompt_len=1024, steps=30)


def part_memory_bound(check: Check) -> dict:
    """The four allocators on a pool small enough that KV memory binds."""
    setup = check.setup
    df, info = parts.workload(setup)
    configs = {a: parts.replay_config(setup, a, kv_memory_gb=setup.bound_kv_gb,
                                      max_model_len=setup.max_model_len) for a in parts.ALLOCATORS}
    results = parts.replay_into(check.runs / "memory-bound", df, info, configs, check.model())
    return {"kv_memory_gb": setup.bound_kv_gb, "max_model_len": setup.max_model_len,
            "allocators": {name: parts.run_summary_row(res) for name, res in results.items()}}


def part_contiguous(check: Check) -> dict:
    """contiguous-max against paged at the same batch limit, each with room for that many regions."""
    from gpu_backend.model_config import resolve_dtype
    from gpu_backend.model_presets import PRESETS

    setup = check.setup
    df, info = parts.workload(setup)
    per_token = PRESETS[setup.model].kv_bytes_per_token(resolve_dtype(setup.dtype))
    kv_gb = round(setup.compare_max_num_seqs * setup.max_model_len * per_token * 1.02 / 2**30, 3)
    configs = {a: parts.replay_config(setup, a, kv_memory_gb=kv_gb, max_model_len=setup.max_model_len,
                                      max_num_seqs=setup.compare_max_num_seqs)
               for a in ("paged", "contiguous-max")}
    results = parts.replay_into(check.runs / "contiguous-vs-paged", df, info, configs, check.model())
    rows = {name: parts.run_summary_row(res) for name, res in results.items()}
    return {"kv_memory_gb": kv_gb, "max_num_seqs": setup.compare_max_num_seqs, "allocators": rows,
            "wall_ratio": rows["contiguous-max"]["wall_s"] / rows["paged"]["wall_s"]}


def part_calibration(check: Check) -> dict:
    """The held-out replays (bench.calibration's parts and folders), each with its stalls."""
    from bench.calibration import PARTS, held_out_part, part_trace
    from bench.replay_setup import ReplaySetup, replay
    from traces import load_trace, save_trace

    setup = ReplaySetup.for_device(check.setup.device)
    out = check.runs / "validate"
    out.mkdir(parents=True, exist_ok=True)
    profile, note = _profile(check, setup)
    rows: dict = {}
    for part in check.setup.calibration_parts:
        trace, first, scale = PARTS[part]
        df = held_out_part(load_trace(trace), first, check.setup.part_size)
        need = float(df["arrival_s"].iloc[-1]) * scale + 10.0  # arrivals come in real time, then the tail
        if not check.fits(need):
            rows[part] = {"skipped": f"needs ~{need:.0f} s (its arrivals span {need - 10:.0f} s), "
                                     f"{check.left():.0f} s left"}
            continue
        csv = part_trace(out, part)
        save_trace(df, csv)
        begin = time.perf_counter()
        real = replay(setup, csv, out / part / "real", check.setup.part_size, scale)
        rows[part] = {"trace": trace, "first_request": first, "time_scale": scale,
                      "seconds": time.perf_counter() - begin}
        if profile is not None:
            rows[part]["stalls"] = parts.stalls_against(profile, real)
    return {"profile": profile, "profile_note": note, "setup": vars(setup).copy(), "parts": rows}


def _profile(check: Check, setup) -> tuple[str | None, str]:
    """The latency profile of this GPU kind: bundled, fitted here first, or none (and why)."""
    if check.setup.dry_run:
        return "cpu-tiny", "bundled (CPU dry run)"
    name = check.device.get("name") or ""
    if "H200" in name:
        return "h200-llama-1b", "bundled, fitted on an H200"
    gpu = "h100-80gb" if "H100" in name else None
    if gpu is None or not check.fits(90 + 25):
        return None, (f"no bundled profile for {name!r}" + ("" if gpu else " (no GPU preset)") +
                      f"; fitting one (~90 s) did not fit in the {check.left():.0f} s left: stalls not "
                      "judged (`make profile DEVICE=cuda GPU=h100-80gb`, then `python -m bench.calibration`)")
    from bench.profile import make_profile

    path = check.runs / "profile" / f"{gpu}-llama-1b.json"
    make_profile(setup, gpu, path, check.runs / "profile")
    return str(path), "fitted here first (bench.profile: four calibration replays)"


def part_engine(check: Check) -> dict:
    """Engine throughput against transformers; transformers gets what the budget leaves (>= one batch)."""
    deadline = time.perf_counter() + max(5.0, check.left() - 5.0)
    return parts.engine_vs_transformers(check.setup, deadline=deadline)


def part_kv_tier_copy(check: Check) -> dict:
    """The engine's CPU-tier load of 256 blocks (8 in a dry run) against the latency model's load_time."""
    from bench.kv_tier_copy import tier_copy

    setup = check.setup
    return tier_copy(setup.device, setup.model, setup.dtype, num_blocks=8 if setup.dry_run else 256)


# name -> (function, seconds it is estimated to take on an H100/H200); run in this order.
PARTS: dict[str, tuple[Callable[[Check], dict], float]] = {
    "tests": (part_tests, 45.0),
    "attention": (part_attention, 25.0),
    "window_attention": (part_window_attention, 20.0),
    "kv_tier_copy": (part_kv_tier_copy, 5.0),
    "decode": (part_decode, 40.0),
    "decode_profile": (part_decode_profile, 20.0),
    "memory_bound": (part_memory_bound, 45.0),
    "contiguous_vs_paged": (part_contiguous, 25.0),
    "calibration": (part_calibration, 45.0),
    "engine_vs_transformers": (part_engine, 30.0),
}


def run_check(check: Check, names: list[str], commit: str | None = None) -> dict:
    """Run the named parts in order, each only if its estimate fits the time left; the report."""
    check.out.mkdir(parents=True, exist_ok=True)
    check.runs.mkdir(parents=True, exist_ok=True)
    check.device = parts.device_info(check.setup.device)
    report = {"device": check.device, "dry_run": check.setup.dry_run, "budget_s": check.budget_s,
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "commit": commit or _commit(), "setup": vars(check.setup).copy(), "parts": {}}
    for name in names:
        fn, estimate = PARTS[name]
        if not check.fits(estimate):
            report["parts"][name] = {"status": "skipped",
                                     "reason": f"estimated {estimate:.0f} s, {check.left():.0f} s left"}
            continue
        begin = time.perf_counter()
        print(f"[{begin - check.start:6.1f} s] {name}", flush=True)
        try:
            result = {"status": "ok", "result": fn(check)}
        except Exception as exc:  # one broken part must not lose the others' numbers
            result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()[-4000:]}
        result["seconds"] = round(time.perf_counter() - begin, 1)
        report["parts"][name] = result
        # Written after every part, so that a check stopped from outside still returns what it measured.
        (check.out / "gpu-check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        _release_memory()
    report["seconds"] = round(time.perf_counter() - check.start, 1)
    report["verdicts"] = verdicts(report)
    report["next"] = next_steps(report, check.runs)
    return report


def _release_memory() -> None:
    """Give the next part the device memory this one cached (its tensors are garbage by now)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _commit() -> str | None:
    """The checkout's commit, when it is a git checkout (a device machine may get a copy without .git)."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def write_outputs(report: dict, out: Path, runs: Path) -> list[Path]:
    """gpu-check.json, gpu-check.md and the run folders as gpu-check-runs.tar.gz, in `out`."""
    paths = [out / "gpu-check.json", out / "gpu-check.md", out / "gpu-check-runs.tar.gz"]
    paths[0].write_text(json.dumps(report, indent=2, default=str) + "\n")
    paths[1].write_text(markdown(report))
    with tarfile.open(paths[2], "w:gz") as tar:
        tar.add(runs, arcname=runs.name)
    return paths


def main(argv: list[str] | None = None) -> int:
    """Command line of `python -m bench.gpu`."""
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/gpu-check"), help="where gpu-check.json, .md and "
                    "the runs' tarball go (default runs/gpu-check)")
    ap.add_argument("--runs", type=Path, default=Path("runs/gpu-check-runs"), help="folder of the run "
                    "folders, packed into OUT/gpu-check-runs.tar.gz at the end (default runs/gpu-check-runs)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="seconds the check may take; parts that "
                    "do not fit are skipped (default 300)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"parts to run, in this order (default: all: "
                    f"{','.join(PARTS)})")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (automatic without CUDA)")
    ap.add_argument("--commit", help="the commit measured, for a copy of the checkout without .git (default: "
                    "git rev-parse HEAD)")
    args = ap.parse_args(argv)
    names = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in names if p not in PARTS]
    if unknown or not names:
        ap.exit(2, f"{ap.prog}: error: --parts: unknown {', '.join(unknown) or '(none given)'}; choose from "
                   f"{', '.join(PARTS)}\n")
    if args.budget_s <= 0:
        ap.exit(2, f"{ap.prog}: error: --budget-s must be positive, got {args.budget_s}\n")
    import torch

    dry = args.dry_run or not torch.cuda.is_available()
    if dry:  # toy models on a shared CPU: one thread, as the CPU replays and tests run them
        torch.set_num_threads(1)
    runs = args.runs
    check = Check(parts.DRY if dry else parts.FULL, args.out, runs, args.budget_s)
    report = run_check(check, names, args.commit)
    paths = write_outputs(report, args.out, runs)
    print(markdown(report))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())

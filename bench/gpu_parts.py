"""The measurements of the GPU check (bench/gpu.py): one function per part, each returning a JSON-ready
dict. Every replay writes a run folder under the check's runs folder, so what needs only a CPU afterwards
(simulations, comparisons, figures) runs from the copied folders.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The files holding `pytest -m gpu` tests (kernels, parity, KV cache, graphs, decode batch, compiles, KV
# tiers, KV cache groups, layer ops).
GPU_TEST_FILES = ("tests/gpu_backend/test_ops_triton.py", "tests/gpu_backend/test_engine_parity.py",
                  "tests/gpu_backend/test_kv_cache.py", "tests/gpu_backend/test_cuda_graph.py",
                  "tests/gpu_backend/test_decode_step.py", "tests/gpu_backend/test_kernel_variants.py",
                  "tests/cli/test_cli_bench_engine.py", "tests/gpu_backend/test_engine_tiers.py",
                  "tests/gpu_backend/test_engine_groups.py", "tests/gpu_backend/test_layer_ops.py",
                  "tests/gpu_backend/test_engine_group_tiers.py")
ALLOCATORS = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")
ROOT = Path(__file__).resolve().parents[1]  # the checkout: GPU_TEST_FILES are relative to it


@dataclass(frozen=True)
class CheckSetup:
    """What the check runs: the full GPU check (`FULL`) or its dry run on a CPU (`DRY`)."""

    dry_run: bool
    device: str
    model: str
    backend: str
    dtype: str
    num_requests: int  # the first N azure-conv requests, all arriving at once
    decode_batches: tuple[int, ...]  # --max-num-seqs of the decode replays
    decode_kv_gb: float
    attention_shapes: tuple[tuple[int, int], ...]  # (batch, context)
    attention_min_time_s: float
    bound_kv_gb: float  # the pool of the memory-bound four-allocator replay
    max_model_len: int  # of the allocator comparisons and the memory-bound replay
    compare_max_num_seqs: int  # contiguous-max against paged, at the same batch limit
    engine_max_model_len: int  # engine vs transformers: prompts clipped as `bench engine` clips them
    hf_batch_size: int
    calibration_parts: tuple[str, ...]
    part_size: int
    max_lengths: tuple[int, int] | None = None  # prompts and outputs cut to these (the dry run: seconds)


FULL = CheckSetup(False, "cuda", "llama-1b-shape", "triton", "bfloat16", 256, (64, 256), 32.0,
                  ((1, 32768), (16, 1024), (64, 1024), (64, 32768)), 0.2, 2.0, 4096, 64, 1024, 16,
                  ("code", "A", "B", "C", "A-x2"), 40)
DRY = CheckSetup(True, "cpu", "tiny", "torch", "float32", 6, (2, 4), 0.02, ((1, 256), (2, 128)), 0.01,
                 0.004, 512, 2, 256, 3, ("A",), 3, max_lengths=(160, 24))


def device_info(device: str) -> dict:
    """The device named: GPU (or CPU) name, memory, driver and CUDA versions, torch and Triton."""
    import torch

    info = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info |= {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                 "multiprocessors": props.multi_processor_count, "driver": _driver_version()}
    else:
        from bench.attention import _cpu_model

        info |= {"name": _cpu_model() or "cpu", "memory_gib": None, "multiprocessors": None, "driver": None}
    return info


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def gpu_tests(out: Path, timeout_s: float) -> dict:
    """`pytest -m gpu` over GPU_TEST_FILES, in a subprocess with a time limit; the summary counts (without
    CUDA every one of them is skipped)."""
    xml = (out / "gpu-tests.xml").resolve()
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", f"--junitxml={xml}",
           *GPU_TEST_FILES]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:  # no junit report then: count the verbose lines
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"timed_out": True, "timeout_s": timeout_s, **verbose_counts(out)}
    counts = _junit_counts(xml) if xml.is_file() else {}
    lines = proc.stdout.strip().splitlines()
    return {"returncode": proc.returncode, "seconds": time.perf_counter() - start, **counts,
            "summary": lines[-1] if lines else "",
            "failures_tail": proc.stdout[-3000:] if proc.returncode else ""}


OUTCOMES = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped"}


def verbose_counts(out: str) -> dict:
    """passed / failed / errors / skipped counted from `pytest -v` lines, and the tests that failed."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed = []
    for line in out.splitlines():
        words = line.split()
        if len(words) < 2 or "::" not in words[0]:
            continue
        outcome = OUTCOMES.get(words[1])
        if outcome:
            counts[outcome] += 1
            if outcome in ("failed", "errors"):
                failed.append(words[0])
    return {**counts, "failed_tests": failed}


def _junit_counts(xml: Path) -> dict:
    """passed / failed / errors / skipped of a junit XML report."""
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"]}


def attention(setup: CheckSetup) -> dict:
    """`bench attention` at each (batch, context) of the setup: the kernels against SDPA and the copy
    bandwidth, one record per implementation."""
    from bench.attention import AttentionBenchConfig, default_config, run_attention_bench

    base = default_config(setup.device) if setup.device == "cuda" else AttentionBenchConfig(device="cpu")
    shapes, machine = [], None
    for batch, context in setup.attention_shapes:
        config = dataclasses.replace(base, batches=(batch,), contexts=(context,),
                                     min_time_s=setup.attention_min_time_s)
        result = run_attention_bench(config)
        machine = result.machine
        shapes.append({"shape": f"B{batch}x{_k(context)}", "batch": batch, "context": context,
                       "records": [dataclasses.asdict(r) for r in result.records]})
    return {"copy_gb_per_s": machine["copy_gb_per_s"], "shapes": shapes}


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def workload(setup: CheckSetup, limit: int | None = None):
    """The first N requests of azure-conv, all arriving at once (`--time-scale 0`), and its trace entry."""
    from traces import load_trace
    from traces.stats import trace_info

    n = setup.num_requests if limit is None else limit
    df = load_trace("azure-conv").iloc[:n].reset_index(drop=True)
    if setup.max_lengths is not None:
        df["prompt_len"] = df["prompt_len"].clip(upper=setup.max_lengths[0])
        df["output_len"] = df["output_len"].clip(upper=setup.max_lengths[1])
    info = {"source": "azure-conv", **trace_info(df), "rate_override": None, "burstiness": None, "limit": n,
            "time_scale": 0.0}
    return df, info


def replay_into(out: Path, df, info: dict, configs: dict, model=None) -> dict:
    """Replay `df` once per allocator config (over one `model`, when given) into the run folder `out`."""
    import torch

    from bench.run_tools import serving_metrics
    from gpu_backend.replay import replay
    from gpu_backend.replay_run import replay_metadata
    from pagelab.run_folder import write_run

    results = {}
    for name, cfg in configs.items():
        results[name] = replay(df, cfg, model=model)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next engine's pool and graphs start from free memory
    write_run(out, info, results, metadata=replay_metadata(configs, info["source"]),
              extra_summary={"serving_metrics": serving_metrics(results)})
    return results


def replay_config(setup: CheckSetup, allocator: str = "paged", **engine):
    """The ReplayConfig of the check's model, device and backend (all arrivals at once)."""
    from gpu_backend.engine.engine_config import EngineConfig
    from gpu_backend.replay import ReplayConfig

    return ReplayConfig(model=setup.model, device=setup.device, backend=setup.backend, dtype=setup.dtype,
                        engine=EngineConfig(allocator=allocator, **engine), time_scale=0.0,
                        extra={"trace": "azure-conv", "limit": setup.num_requests})


def build_model(setup: CheckSetup):
    """The check's model, built once and shared by its replays."""
    from gpu_backend.model_presets import build_preset
    from gpu_backend.ops import get_backend

    return build_preset(setup.model, dtype=setup.dtype, device=setup.device,
                        backend=get_backend(setup.backend, setup.device))


def decode_steps(result, batch: int, copy_gbps: float) -> dict:
    """Decode-only steps of `batch` sequences (of >= 90 % of it when fewer than 20 are exactly that
    big): the p50 step, their contexts, and the time to read the weights and the KV once per step."""
    steps = result.steps
    decode = steps[(steps["num_prefill_seqs"] == 0) & (steps["num_decode_seqs"] > 0)]
    exact = decode[decode["num_decode_seqs"] == batch]
    rule = f"exactly {batch} sequences"
    if len(exact) < 20:
        exact = decode[decode["num_decode_seqs"] >= int(np.ceil(0.9 * batch))]
        rule = f">= {int(np.ceil(0.9 * batch))} sequences (fewer than 20 steps of exactly {batch})"
    if exact.empty:
        return {"num_steps": 0, "rule": rule}
    dt = exact["dt_s"].to_numpy(np.float64)
    ctx = exact["sum_context"].to_numpy(np.float64)
    per_seq = ctx / exact["num_decode_seqs"].to_numpy(np.float64)
    weights = result.summary["measured"]["weights_bytes"]
    per_token = result.config["bytes_per_token"]
    floor = (weights + ctx * per_token) / (copy_gbps * 1e9)
    p50 = float(np.median(dt))
    return {"num_steps": int(len(dt)), "rule": rule, "p50_ms": 1e3 * p50,
            "p90_ms": 1e3 * float(np.percentile(dt, 90)),
            "sum_context_p10_p50_p90": [float(x) for x in np.percentile(ctx, [10, 50, 90])],
            "context_per_seq_p50": float(np.median(per_seq)),
            "read_floor_ms": 1e3 * float(np.median(floor)), "over_read_floor": float(np.median(dt / floor)),
            "weights_bytes": int(weights), "kv_bytes_per_token": int(per_token), "copy_gb_per_s": copy_gbps}


def run_summary_row(res) -> dict:
    """A replay's serving numbers: throughput, mean batch, TTFT/TPOT, memory breakdown, wall time."""
    s = res.summary
    return {"throughput_tok_s": s["throughput_tokens_per_s"], "mean_batch": s["mean_batch_size"],
            "ttft_p50_s": (s.get("ttft_s") or {}).get("p50"),
            "tpot_p50_s": (s.get("tpot_s") or {}).get("p50"),
            "num_steps": s["num_steps"], "num_preemptions": s["num_preemptions"],
            "num_finished": s["num_finished"], "wall_s": s["sim_duration_s"], "memory": s["memory"],
            "step_p50_ms": 1e3 * (s["measured"]["step_time_s"]["p50"] or 0.0)}


def stalls_against(profile: str, real: Path) -> dict:
    """The replay's steps priced by `profile`: its stalls (steps >= 10x their price), as `pagelab
    compare` counts them, and the p50 relative step error."""
    from bench.run_tools import measured_steps
    from simulator.timing.compare import stalls
    from simulator.timing.step_latency import DECODE_FEATURE, FEATURES, load_fitted

    fitted = load_fitted(profile)
    (_, _, steps), = measured_steps([real])
    busy = steps[steps["num_batched_tokens"] > 0]
    predicted = fitted.step_times(*(busy[f].to_numpy(np.float64) for f in (*FEATURES, DECODE_FEATURE)))
    measured = busy["dt_s"].to_numpy(np.float64)
    found = stalls(busy["step"].to_numpy(), predicted, measured)
    return {**found, "num_steps": int(len(busy)), "busy_s": float(measured.sum()),
            "step_median_abs_rel_error": float(np.median(np.abs(predicted - measured) / measured))}


def engine_vs_transformers(setup: CheckSetup, deadline: float) -> dict:
    """`bench engine` on the check's requests; transformers' static batches until `deadline` (the
    batches it finished count, and say so)."""
    from bench.engine import requests_of, run_engine, run_transformers, to_transformers

    model = build_model(setup)
    work = requests_of(model, workload(setup)[0], max_model_len=setup.engine_max_model_len)
    engine = run_engine(model, work, device=setup.device)
    hf = run_transformers(to_transformers(model), work, setup.hf_batch_size, deadline=deadline)
    return {"requests": len(work.prompts), "output_tokens": work.num_output_tokens,
            "max_model_len": setup.engine_max_model_len, "engine": engine, "transformers": hf,
            "speedup": engine["tokens_per_s"] / hf["tokens_per_s"] if hf["tokens_per_s"] else None}

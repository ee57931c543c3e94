"""`python -m bench.gpu`: the GPU check, run end to end as its CPU dry run, and its time budget."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tarfile
from pathlib import Path

from bench import gpu, gpu_parts
from bench.gpu_report import markdown

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_measures_every_part_and_writes_one_json_one_table_and_the_runs(tmp_path):
    out, runs = tmp_path / "out", tmp_path / "work" / "gpu-check-runs"
    cmd = [sys.executable, "-m", "bench.gpu", "--dry-run", "--out", str(out), "--runs", str(runs)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check-runs.tar.gz", "gpu-check.json",
                                                     "gpu-check.md"]
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["dry_run"] and report["device"]["torch"]
    assert {name: p["status"] for name, p in report["parts"].items()} == dict.fromkeys(gpu.PARTS, "ok")
    results = {name: p["result"] for name, p in report["parts"].items()}
    assert results["tests"]["skipped"] > 0 and results["tests"]["failed"] == 0  # no CUDA: all skipped
    assert [s["shape"] for s in results["attention"]["shapes"]] == ["B1x256", "B2x128"]
    window = results["window_attention"]["rows"]  # sliding and full read the same blocks: same outputs
    assert len(window) == 4 and all(r["rel_err"] < 1e-6 and r["ratio"] > 0 for r in window)
    decode = results["decode"]["b2-eager"]
    assert decode["num_steps"] > 0 and decode["p50_ms"] > 0 and decode["over_read_floor"] > 0
    assert set(results["memory_bound"]["allocators"]) == set(gpu_parts.ALLOCATORS)
    assert results["contiguous_vs_paged"]["wall_ratio"] > 0
    assert results["calibration"]["parts"]["A"]["stalls"]["num_steps"] > 0
    assert results["engine_vs_transformers"]["speedup"] > 0
    assert results["kv_tier_copy"]["blocks"] == 8 and results["kv_tier_copy"]["ratio"] > 0
    table = (out / "gpu-check.md").read_text()
    assert table.startswith("GPU check on **") and "dry run" in table
    assert table.count("| part | measurement |") == 1 and table.count("\n| decode |") == 4
    assert all(f"| {name} |" in table for name in gpu.PARTS)
    with tarfile.open(out / "gpu-check-runs.tar.gz") as tar:
        names = set(tar.getnames())
    for folder in ("decode/b2-eager/paged", "memory-bound/contiguous-pow2", "validate/A/real/paged"):
        assert f"gpu-check-runs/{folder}/summary.json" in names, folder
    assert "gpu-check-runs/gpu-tests.xml" in names


def test_parts_that_do_not_fit_the_budget_are_skipped_and_say_so(tmp_path):
    setup = dataclasses.replace(gpu_parts.FULL, device="cpu")  # a full check's estimates, on any machine
    check = gpu.Check(setup, tmp_path / "out", tmp_path / "runs", budget_s=20.0)
    report = gpu.run_check(check, ["tests", "attention", "calibration"])
    assert report["parts"]["tests"]["status"] == "skipped"  # 45 s estimated, 20 s budget
    assert "estimated 45 s" in report["parts"]["tests"]["reason"]
    assert all(p["status"] == "skipped" for p in report["parts"].values())
    assert "| tests | skipped | estimated 45 s" in markdown(report)


def test_unknown_parts_are_a_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--parts", "decode,warp"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--parts: unknown warp" in proc.stderr and "Traceback" not in proc.stderr


def test_the_tier_copy_part_loads_blocks_and_sets_them_against_the_model_load_time():
    import torch

    from bench.kv_tier_copy import tier_copy
    from gpu_backend.model_presets import PRESETS
    from simulator.presets import get_gpu
    from simulator.tier_config import CPU_LATENCY_S

    r = tier_copy("cpu", "tiny", "float32", num_blocks=4, repeats=2)
    per_token = PRESETS["tiny"].kv_bytes_per_token(torch.float32)
    assert r["gpu_preset"] == "cpu" and r["measured_s"] > 0
    assert r["model_s"] == CPU_LATENCY_S + 4 * 16 * per_token / get_gpu("cpu").pcie_bandwidth
    assert r["ratio"] == r["measured_s"] / r["model_s"]


def test_a_timed_out_test_run_still_counts_what_ran_and_names_failures():
    out = ("tests/a.py::test_x PASSED [ 10%]\ntests/a.py::test_y[cuda] FAILED [ 20%]\n"
           "tests/b.py::test_z SKIPPED (needs CUDA) [ 30%]\nnoise line\n")
    counts = gpu_parts.verbose_counts(out)
    assert counts == {"passed": 1, "failed": 1, "errors": 0, "skipped": 1,
                      "failed_tests": ["tests/a.py::test_y[cuda]"]}


def test_forward_times_count_every_step_whether_eager_or_replayed_from_a_graph():
    """The decode profile pairs each step with its forward call: a graph replay counts as one too."""
    from bench.engine_host import record_forward_times
    from gpu_backend import LLMEngine, SamplingParams
    from gpu_backend.engine.cuda_graph import DecodeGraphRunner

    engine = LLMEngine("tiny", device="cpu", capacity_tokens=2048, max_num_seqs=4, max_model_len=128)
    engine.graph_runner = DecodeGraphRunner(engine._forward, 4, 128 // 16 + 1, 128, False, "cpu",
                                            capture=False, buffers=engine.decoder.buffers)
    times = record_forward_times(engine)
    replays = []
    inner = engine.graph_runner.replay
    engine.graph_runner.replay = lambda n, longest=None: replays.append(n) or inner(n, longest)
    for i in range(3):
        engine.add_request([5 + i] * (10 + i), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    ran = 0
    while engine.has_unfinished():
        ran += engine.step().ran
    assert replays and len(times) == ran

"""A replay measured on an H200 (tests/data/h200-azure-40-79) checks the simulator on the CPU.

The run is held-out part B of `python -m bench.calibration --device cuda` (azure-conv requests 40-79,
llama-1b-shape, Triton, CUDA graphs, 2026-11-27; docs/calibration.md, "On a GPU"); the bundled profile
h200-llama-1b was fitted on four `bench.profile` replays on the same machine, not on this run.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from simulator.core.models import get_model
from simulator.presets import get_gpu
from simulator.timing.latency_fit import fit_latency

DATA = Path(__file__).parent.parent / "data" / "h200-azure-40-79"
REPLAY, TRACE = DATA / "replay", DATA / "trace.csv"
# azure-code requests 0-39 replayed on an H200 by an engine whose kernels specialized on changing integer
# arguments (see jit_unspecialized, gpu_backend/ops/triton_tile.py): nine of its steps are 0.50-0.67 s
# of compiling new Triton variants.
CODE = Path(__file__).parent.parent / "data" / "h200-azure-code-0-39"
runner = CliRunner()

pytestmark = pytest.mark.usefixtures("single_thread")


def _run(*args) -> None:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output


def _compare(tmp_path: Path, *simulate_args, trace: Path = TRACE, replay: Path = REPLAY) -> dict:
    _run("simulate", trace, *simulate_args, "--out", tmp_path / "sim")
    _run("compare", tmp_path / "sim", replay, "--out", tmp_path / "cmp")
    return json.loads((tmp_path / "cmp" / "comparison.json").read_text())


def test_the_h200_step_times_reproduce_its_memory_at_every_step(tmp_path):
    c = _compare(tmp_path, "--step-times-from", REPLAY)
    mem = c["memory"]
    assert mem["step_aligned"] and mem["equal"] and mem["num_steps_differing"] == 0
    assert mem["num_steps_real"] == mem["num_steps_sim"] > 4000
    assert c["latency"]["e2e_s"]["median_abs"] < 1e-9


def test_the_bundled_h200_profile_meets_the_targets_on_the_held_out_h200_run(tmp_path):
    c = _compare(tmp_path, "--profile", "h200-llama-1b", "--config-from", REPLAY)
    assert c["latency"]["e2e_s"]["median_abs"] <= 0.10
    assert abs(c["throughput"]["rel_error"]) <= 0.05
    # Prefill steps run eagerly and decode steps as graphs: without the prefill-step term TTFT is ~50% off.
    assert c["latency"]["ttft_s"]["median_abs"] <= 0.30
    assert c["step_time"]["stalls"]["count"] == 0


def test_compare_names_the_compile_stalls_of_a_replay(tmp_path):
    c = _compare(tmp_path, "--profile", "h200-llama-1b", "--config-from", CODE / "replay",
                 trace=CODE / "trace.csv", replay=CODE / "replay")
    steps = pd.read_parquet(CODE / "replay" / "paged" / "steps.parquet")
    slow = steps.loc[steps["dt_s"] > 0.4, "step"].tolist()  # 0.50-0.67 s; every other step under 0.04 s
    assert c["step_time"]["stalls"]["steps"] == slow and len(slow) == 9
    assert 0.6 < c["step_time"]["stalls"]["busy_share"] < 0.8
    # What the stalls do to the latency errors, though the steps themselves are priced well.
    assert c["step_time"]["median_abs"] < 0.10 and c["latency"]["e2e_s"]["median_abs"] > 0.5


def test_graphed_decodes_need_the_prefill_step_term():
    steps = pd.read_parquet(REPLAY / "paged" / "steps.parquet")
    steps = steps[steps["num_batched_tokens"] > 0]
    data = {c: steps[c].to_numpy(np.float64)
            for c in ("num_batched_tokens", "attn_pairs", "kv_tokens_read", "num_decode_seqs")}
    data["step_s"] = steps["dt_s"].to_numpy(np.float64)
    prefill = (steps["num_prefill_seqs"] > 0).to_numpy()
    errors = {}
    for term in (False, True):
        fit = fit_latency(data, get_model("llama-3.2-1b"), get_gpu("h200"), relative=True, sqrt_decode=True,
                          prefill_step=term)
        predicted = fit.step_times(*(data[c] for c in ("num_batched_tokens", "attn_pairs", "kv_tokens_read",
                                                       "num_decode_seqs")))
        errors[term] = np.median((predicted / data["step_s"] - 1)[prefill])
    # One constant for every step prices the eager prefills from the graphed decodes, far short.
    assert errors[False] < -0.3 and abs(errors[True]) < 0.15


def test_a_replay_whose_trace_stayed_on_its_machine_asks_for_the_trace(tmp_path):
    recorded = json.loads((REPLAY / "paged" / "config.json").read_text())["trace"]
    assert not Path(recorded).exists()  # validate/...: the H200 job's folder (tests/data/README.md)
    result = runner.invoke(app, ["simulate", "--profile", "h200-llama-1b", "--config-from", str(REPLAY)])
    assert result.exit_code == 2
    message = " ".join(result.output.split())
    assert f"the replay ran trace {recorded}, which is not here; give that trace" in message

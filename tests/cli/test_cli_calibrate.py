"""`pagelab calibrate`, `simulate --profile / --step-times-from` and `pagelab compare` on a CPU replay."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from traces import SyntheticConfig, generate_trace, save_trace

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("single_thread", "wide_consoles")


def run(*args):
    """Invoke `pagelab ARGS...` in this process (the loop's many steps would pay torch's import each time)."""
    return runner.invoke(app, [str(a) for a in args])


def run_process(*args) -> subprocess.CompletedProcess:
    """Run `pagelab ARGS...` as a user would: a fresh process, its exit code and its streams."""
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "COLUMNS": "400"}
    return subprocess.run([sys.executable, "-c", "from cli import main; main()", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """A few seconds of the tiny preset on the CPU: two bursts with a gap, a pool tight enough to preempt."""
    tmp = tmp_path_factory.mktemp("replay")
    trace = generate_trace(SyntheticConfig(num_requests=10, arrival="poisson", rate=50.0, lengths="uniform",
                                           prompt_range=(8, 80), output_range=(4, 30), max_model_len=256,
                                           seed=2))
    trace.loc[6:, "arrival_s"] += 0.3
    path = tmp / "trace.csv"
    save_trace(trace, path)
    out = tmp / "real"
    result = run("replay", path, "--model", "tiny", "--device", "cpu", "--backend", "torch",
                 "--num-blocks", 12, "--max-model-len", 256, "--no-prefix-caching", "--out", out)
    assert result.exit_code == 0, result.output
    return tmp, out


def test_replay_writes_a_steps_table(replayed):
    _, real = replayed
    steps = pd.read_parquet(real / "paged" / "steps.parquet")
    memory = pd.read_parquet(real / "paged" / "memory.parquet")
    busy = memory[memory["num_steps"] == 1]
    assert len(steps) == len(busy) >= 20
    assert steps["step"].tolist() == busy["step"].tolist()
    assert (steps["dt_s"].to_numpy() == busy["dt_s"].to_numpy()).all()
    assert (steps["num_batched_tokens"] == steps["num_prefill_tokens"] + steps["num_decode_seqs"]).all()
    assert (steps["batch_size"] == steps["num_prefill_seqs"] + steps["num_decode_seqs"]).all()
    assert (steps["attn_pairs"] >= steps["kv_tokens_read"]).all() and (steps["sum_context"] > 0).all()


def test_calibrate_simulate_compare_loop(replayed):
    tmp, real = replayed
    profile = tmp / "profile.json"
    result = run("calibrate", real, "--out", profile, "--min-steps", 10)
    assert result.exit_code == 0, result.output
    assert "fit quality: R²" in result.output
    data = json.loads(profile.read_text())
    assert data["model"] == "tiny" and data["gpu"] == "cpu" and data["block_size"] == 16
    assert data["fit"]["num_steps"] >= 20 and data["coefficients"]["step_overhead_s"] >= 0

    sim = tmp / "sim"
    trace = tmp / "trace.csv"
    result = run("simulate", trace, "--profile", profile, "--allocator", "paged",
                 "--capacity-tokens", 12 * 16, "--max-model-len", 256, "--no-prefix-caching", "--out", sim)
    assert result.exit_code == 0, result.output
    assert json.loads((sim / "paged" / "config.json").read_text())["latency"] == str(profile)

    report = tmp / "report"
    result = run("compare", sim, real, "--out", report)
    assert result.exit_code == 0, result.output
    assert "end-to-end latency" in result.output and "output throughput" in result.output
    comparison = json.loads((report / "comparison.json").read_text())
    assert comparison["latency"]["e2e_s"]["count"] == 10
    assert comparison["throughput"]["sim"] > 0 and comparison["throughput"]["real"] > 0
    assert (report / "latency_overlay.png").stat().st_size > 0
    # The replay named first: still the simulation judged against the measurement, the same numbers.
    result = run("compare", real, sim, "--out", tmp / "reversed")
    assert result.exit_code == 0, result.output
    assert "simulated vs measured" in result.output
    assert json.loads((tmp / "reversed" / "comparison.json").read_text()) == comparison

    # --config-from: the replay's pool and trace as run, timed by the profile; the per-step time error
    # is the profile's on the measured steps (what calibrate printed as its fit quality).
    twin = tmp / "twin"
    result = run("simulate", "--profile", profile, "--config-from", real, "--out", twin)
    assert result.exit_code == 0, result.output
    config = json.loads((twin / "paged" / "config.json").read_text())
    assert config["capacity_tokens"] == 12 * 16 and config["max_model_len"] == 256
    assert not config["enable_prefix_caching"] and config["extra"]["config_from"].endswith("paged")
    result = run("compare", twin, real, "--out", tmp / "twin-report")
    assert result.exit_code == 0, result.output
    step = json.loads((tmp / "twin-report" / "comparison.json").read_text())["step_time"]
    assert step["basis"] == "latency model on the measured steps"
    assert step["median_abs"] == pytest.approx(data["fit"]["median_abs_rel_error"])


def test_a_simulation_of_a_replay_is_labelled_by_it_and_refuses_options_it_would_drop(replayed):
    tmp, real = replayed
    twin = tmp / "twin-labels"
    result = run("simulate", "--profile", "cpu-tiny", "--config-from", real, "--out", twin)
    assert result.exit_code == 0, result.output
    trace = json.loads((twin / "summary.json").read_text())["trace"]
    assert trace["source"].endswith("trace.csv") and trace["num_requests"] == 10  # not the default trace
    assert json.loads((twin / "paged" / "config.json").read_text())["extra"]["trace"] == trace["source"]
    assert "the registry's" not in result.output  # no alias line for a model nobody typed
    for args, given in ((("--config-from", real, "--profile", "cpu-tiny", "--block-size", 32, "--limit", 5),
                         "--block-size, --limit: --config-from takes"),
                        (("--step-times-from", real, "--mode", "fast"), "--mode: --step-times-from takes")):
        result = run_process("simulate", *args)
        assert result.returncode == 2 and given in result.stderr, result.stderr
    # A simulation of other requests is not compared with the replay as if it were its twin.
    other = tmp / "other"
    result = run("simulate", tmp / "trace.csv", "--profile", "cpu-tiny", "--limit", 6, "-a", "paged",
                 "--capacity-tokens", 12 * 16, "--max-model-len", 256, "--out", other)
    assert result.exit_code == 0, result.output
    result = run_process("compare", other, real)
    assert result.returncode == 2 and "they served different requests: 6 and 10 requests" in result.stderr


def test_step_times_from_a_replay_gives_equal_memory_at_every_step(replayed):
    tmp, real = replayed
    sim = tmp / "retrace"
    # --mode step is the mode measured step times force: said again, it is accepted (--mode fast is not).
    result = run("simulate", "--step-times-from", real, "--mode", "step", "--out", sim)
    assert result.exit_code == 0, result.output
    result = run("compare", sim, real, "--out", tmp / "retrace-report")
    assert result.exit_code == 0, result.output
    assert "memory breakdown: equal at every step" in result.output
    comparison = json.loads((tmp / "retrace-report" / "comparison.json").read_text())
    mem = comparison["memory"]
    assert mem["equal"] and mem["num_steps_sim"] == mem["num_steps_real"] >= 20
    assert all(v == 0 for v in mem["max_abs_difference"].values())
    assert comparison["step_time"]["median_abs"] == 0  # the measured times themselves
    # Both runs end where their last step ends: the same duration, so the same throughput.
    assert comparison["duration"]["sim"] == pytest.approx(comparison["duration"]["real"], rel=1e-9)
    assert comparison["latency"]["e2e_s"]["p90_abs"] < 1e-9


def test_bundled_profile_works_by_name(tmp_path):
    result = run("simulate", "--profile", "cpu-tiny", "--limit", 20, "--kv-memory-gb", 0.25, "-a", "paged")
    assert result.exit_code == 0, result.output
    assert "paged" in result.output


@pytest.mark.parametrize("case", ["no-steps", "too-few", "unknown-profile", "other-model",
                                  "other-block-size", "both-twins", "run-twice", "gpu-of-a-cpu-run"])
def test_bad_input_is_a_one_line_error_with_exit_2(replayed, tmp_path, case):
    tmp, real = replayed
    if case == "no-steps":
        sim = tmp_path / "sim"
        assert run("simulate", "--limit", 5, "-a", "paged", "--out", sim).exit_code == 0
        args, match = ["calibrate", sim, "--out", tmp_path / "p.json"], "no steps table"
    elif case == "too-few":
        args = ["calibrate", real, "--out", tmp_path / "p.json", "--min-steps", 10_000]
        match = "too few steps"
    elif case == "run-twice":
        args, match = ["calibrate", real, real, "--out", tmp_path / "p.json"], "a RUN is given twice"
    elif case == "gpu-of-a-cpu-run":
        args = ["calibrate", real, "--gpu", "h100-80gb", "--out", tmp_path / "p.json"]
        match = "measured on the CPU, not on --gpu h100-80gb"
    elif case == "unknown-profile":
        args, match = ["simulate", "--profile", "no-such-gpu", "--limit", 5], "neither a file nor a bundled"
    elif case == "other-model":
        args, match = ["simulate", "--profile", "cpu-tiny", "--model", "llama-3-8b", "--limit", 5], \
            "fitted for model 'tiny', not 'llama-3-8b'"
    elif case == "other-block-size":
        args, match = ["simulate", "--profile", "cpu-tiny", "--block-size", 32, "--limit", 5], \
            "fitted for block size 16, not 32"
    else:
        args, match = ["simulate", "--step-times-from", real, "--config-from", real], "not both"
    result = run_process(*args)
    assert result.returncode == 2, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and match in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("field, value, expected", [("block_size", "abc", "a whole number"),
                                                    ("max_model_len", "abc", "a whole number or null"),
                                                    ("enable_prefix_caching", "yes", "true or false")])
def test_a_replays_config_of_the_wrong_type_is_named(replayed, tmp_path, field, value, expected):
    _, real = replayed
    bad = tmp_path / "bad"
    shutil.copytree(real, bad)
    config = json.loads((bad / "paged" / "config.json").read_text())
    config[field] = value
    (bad / "paged" / "config.json").write_text(json.dumps(config))
    result = run_process("simulate", "--profile", "cpu-tiny", "--config-from", bad)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"config.json: field '{field}': expected {expected}, got '{value}'" in result.stderr


def test_a_run_of_several_allocators_is_refused_by_the_option_given(tmp_path):
    run = tmp_path / "two"
    assert run_process("simulate", "azure-conv", "--limit", 5, "-a", "paged,contiguous-max", "--out",
                       run).returncode == 0
    result = run_process("simulate", "--profile", "cpu-tiny", "--config-from", run)
    assert result.returncode == 2 and "holds 2 allocators; point --config-from at one" in result.stderr


def test_a_replays_itl_counts_every_gap_of_its_tokens(tmp_path):
    # Each finished request's gaps add up to its finish less its first token, preemptions included, so the
    # pooled mean is the total decode time over the number of gaps.
    trace = tmp_path / "tight.csv"
    trace.write_text("arrival_s,prompt_len,output_len\n" + "0,40,40\n" * 4 + "0.01,40,40\n")
    real = tmp_path / "real"
    result = run("replay", trace, "--model", "tiny", "--device", "cpu", "--backend", "torch", "--num-blocks",
                 12, "--max-model-len", 128, "--no-prefix-caching", "--out", real)
    assert result.exit_code == 0, result.output
    req = pd.read_parquet(real / "paged" / "requests.parquet")
    assert req["num_preemptions"].sum() > 0
    done = req[req["finish_s"].notna()]
    metrics = json.loads((real / "summary.json").read_text())["serving_metrics"]["paged"]
    expect = (done["finish_s"] - done["first_token_s"]).sum() / (done["output_len"] - 1).sum()
    assert metrics["mean_itl_ms"] == pytest.approx(1e3 * expect, rel=1e-9)
    assert metrics["p99_itl_ms"] > metrics["median_itl_ms"]  # a preempted request's wait is one long gap

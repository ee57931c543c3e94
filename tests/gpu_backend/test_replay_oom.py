"""The engine out of memory: a pool or step that cannot fit is refused before the run (a CPU's budget stands
in for a device's memory); an out-of-memory error mid-run stops the replay cleanly, leaving a run folder
marked incomplete that plot and compare read with a warning."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from cli import app
from gpu_backend.engine.llm_engine import LLMEngine
from gpu_backend.memory_budget import BUDGET_ENV, DeviceMemoryError, is_out_of_memory, step_activation_bytes
from gpu_backend.replay import ReplayConfig, replay
from gpu_backend.replay_run import ReplayIncomplete, replay_configs, replay_to_dir
from traces import SyntheticConfig, generate_trace, save_trace

pytestmark = pytest.mark.usefixtures("single_thread", "wide_consoles")
STOP_AT = 6  # the step whose forward runs out of memory


def _trace() -> pd.DataFrame:
    return generate_trace(SyntheticConfig(num_requests=8, arrival="poisson", rate=200.0, lengths="uniform",
                                          prompt_range=(5, 40), output_range=(4, 12), max_model_len=128,
                                          seed=3))


@pytest.fixture
def oom_at_step(monkeypatch):
    """The engine's step STOP_AT raises CUDA's out-of-memory error (what a device does when a step's
    activations no longer fit), or `error` if given."""
    def arm(error: BaseException | None = None):
        calls = {"n": 0}
        step = LLMEngine.step

        def failing(self):
            calls["n"] += 1
            if calls["n"] == STOP_AT:
                raise error or torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return step(self)
        monkeypatch.setattr(LLMEngine, "step", failing)
    return arm


def test_a_pool_that_cannot_fit_the_budget_is_refused_before_the_run(monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, "0.05")
    with pytest.raises(DeviceMemoryError) as caught:
        LLMEngine("tiny", device="cpu", kv_memory_gb=0.1)
    message = str(caught.value)
    assert "the KV pool (0.1 GiB)" in message
    assert f"but the device has 0.05 GiB ({BUDGET_ENV}=0.05)" in message
    assert "give a KV pool of at most" in message
    monkeypatch.setenv(BUDGET_ENV, "1")
    assert LLMEngine("tiny", device="cpu", kv_memory_gb=0.1).capacity_tokens > 0


def test_a_budget_that_is_not_a_size_is_refused(monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, "lots")
    with pytest.raises(DeviceMemoryError, match=f"{BUDGET_ENV}='lots': expected a number of GiB > 0"):
        LLMEngine("tiny", device="cpu", num_blocks=8)


def test_a_step_that_cannot_fit_the_budget_is_refused_before_the_run(monkeypatch):
    engine = LLMEngine("tiny", device="cpu", num_blocks=8)
    need = step_activation_bytes(engine.model.config, engine.model.dtype, 1 << 20, 256)
    monkeypatch.setenv(BUDGET_ENV, str(need / 2**30))
    with pytest.raises(DeviceMemoryError, match="lower --max-num-batched-tokens"):
        LLMEngine("tiny", device="cpu", num_blocks=8, max_num_batched_tokens=1 << 20)


def test_out_of_memory_errors_are_recognised():
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory."))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_out_of_memory_mid_run_keeps_the_steps_so_far(oom_at_step):
    oom_at_step(MemoryError())
    result = replay(_trace(), ReplayConfig(device="cpu", time_scale=0))
    stopped = result.summary["incomplete"]
    assert stopped["num_steps"] == STOP_AT - 1 == len(result.steps)
    assert stopped["reason"].startswith("the device ran out of memory (MemoryError")
    requests = result.requests
    assert len(requests) == stopped["num_requests_arrived"] <= stopped["num_requests"] == 8
    assert requests["finish_s"].isna().sum() == stopped["num_requests_in_flight"] > 0


def test_an_incomplete_replay_is_written_and_marked(tmp_path, oom_at_step):
    oom_at_step()
    configs = replay_configs(["paged", "contiguous-max"], ReplayConfig(device="cpu", time_scale=0))
    with pytest.raises(ReplayIncomplete, match=r"the paged replay stopped at step 5: the device ran out of "
                                               r"memory \(OutOfMemoryError: CUDA out of memory"):
        replay_to_dir(_trace(), configs, {"source": "t"}, tmp_path / "r")
    marker = json.loads((tmp_path / "r" / "run.json").read_text())["incomplete"]
    assert marker["allocator"] == "paged" and marker["num_steps"] == STOP_AT - 1
    assert marker["not_run"] == ["contiguous-max"]
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["paged", "run.json", "summary.json"]
    assert len(pd.read_parquet(tmp_path / "r" / "paged" / "steps.parquet")) == STOP_AT - 1


def test_the_commands_on_an_incomplete_run(tmp_path, oom_at_step):
    trace = tmp_path / "t.csv"
    save_trace(_trace(), trace)
    oom_at_step()
    runner = CliRunner()
    result = runner.invoke(app, ["replay", str(trace), "--device", "cpu", "--time-scale", "0", "--out",
                                 str(tmp_path / "real")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0].endswith(f"wrote the steps so far to {tmp_path / 'real'} (its run.json marks it "
                             "incomplete)")

    plotted = runner.invoke(app, ["plot", str(tmp_path / "real"), "--only", "breakdown,latency_cdf"])
    assert plotted.exit_code == 0, plotted.output
    assert (f"warning: {tmp_path / 'real' / 'paged'}: an incomplete run, stopped at step {STOP_AT - 1} (the "
            "device ran out of memory") in plotted.output
    assert sorted(p.name for p in (tmp_path / "real" / "figures").iterdir()) == ["breakdown.png",
                                                                                 "latency_cdf.png"]

    simulated = runner.invoke(app, ["simulate", str(trace), "--model", "tiny", "--gpu", "cpu", "-a", "paged",
                                    "--capacity-tokens", "4096", "--out", str(tmp_path / "sim")])
    assert simulated.exit_code == 0, simulated.output
    compared = runner.invoke(app, ["compare", str(tmp_path / "sim"), str(tmp_path / "real"), "--out",
                                   str(tmp_path / "cmp")])
    assert compared.exit_code == 0, compared.output
    assert f"warning: {tmp_path / 'real' / 'paged'}: an incomplete run" in compared.output
    warnings = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["warnings"]
    assert warnings[0].endswith("; compared as far as it ran")


def test_the_cli_refuses_a_pool_beyond_the_budget_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, "0.01")
    result = CliRunner().invoke(app, ["replay", "--device", "cpu", "--kv-memory-gb", "0.1", "--limit", "2",
                                      "--out", str(tmp_path / "r")])
    assert result.exit_code == 2, result.output
    assert "but the device has 0.01 GiB" in result.output
    assert list(tmp_path.iterdir()) == []

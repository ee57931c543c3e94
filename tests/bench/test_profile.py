"""The calibration recipe (`python -m bench.profile`) and the replay setup it shares with the validation."""
from __future__ import annotations

import argparse
import json

import pandas as pd
import pytest

from bench import calibration, profile
from bench.replay_setup import ReplaySetup, add_arguments


def _setup(*argv: str) -> ReplaySetup:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return ReplaySetup.from_args(ap.parse_args(list(argv)))


def test_each_device_gets_its_own_defaults_and_clock():
    cpu = _setup()
    assert (cpu.model, cpu.backend, cpu.kv_memory_gb, cpu.clock) == ("tiny", "torch", 0.25, "cpu")
    gpu = _setup("--device", "cuda")
    assert (gpu.model, gpu.backend, gpu.kv_memory_gb, gpu.clock) == ("llama-1b-shape", "triton", 8.0, "wall")
    custom = _setup("--device", "cuda", "--model", "tiny", "--kv-memory-gb", "2", "--block-size", "32")
    assert (custom.model, custom.backend, custom.kv_memory_gb, custom.block_size) == \
        ("tiny", "triton", 2.0, 32)


def test_the_replay_config_is_what_the_bundled_profile_was_measured_with():
    cfg = ReplaySetup().replay_config(time_scale=2.0, extra={"trace": "t.csv"})
    assert (cfg.model, cfg.device, cfg.backend, cfg.clock, cfg.time_scale, cfg.extra) == \
        ("tiny", "cpu", "torch", "cpu", 2.0, {"trace": "t.csv"})
    engine = cfg.engine
    assert (engine.block_size, engine.kv_memory_gb, engine.max_model_len, engine.preemption_mode,
            engine.enable_prefix_caching, engine.enforce_eager) == (16, 0.25, 4096, "recompute", True, False)
    gpu = _setup("--device", "cuda").replay_config()
    assert (gpu.clock, gpu.engine.kv_memory_gb, gpu.engine.enforce_eager) == ("wall", 8.0, False)
    assert _setup("--device", "cuda", "--enforce-eager").replay_config().engine.enforce_eager


def test_the_prefill_step_term_is_fitted_by_default_only_where_decode_steps_are_graphs():
    assert profile.graphed_decode(_setup("--device", "cuda"))
    assert not profile.graphed_decode(_setup("--device", "cuda", "--enforce-eager"))
    assert not profile.graphed_decode(_setup("--device", "cuda", "--backend", "torch"))
    assert not profile.graphed_decode(_setup())


def test_prompt_ranges_leave_room_for_the_longest_output():
    assert profile.prompt_range((16, 3796), 4096) == (16, 3796)
    assert profile.prompt_range((16, 3796), 1024) == (16, 1024 - profile.OUTPUT_RANGE[1])
    assert profile.prompt_range((16, 600), 200) == (16, 16)  # never below the bottom of the range


def test_a_gpu_profile_needs_its_gpu_preset(capsys):
    with pytest.raises(SystemExit) as exc:
        profile.main(["--device", "cuda"])
    assert exc.value.code == 2
    assert "--gpu is required" in capsys.readouterr().err


def test_the_recipe_replays_every_trace_and_fits_them_all(tmp_path, single_thread):
    out = tmp_path / "p.json"
    assert profile.main(["--num", "4", "--max-model-len", "320", "--runs", str(tmp_path / "runs"),
                         "--out", str(out)]) == 0
    prof = json.loads(out.read_text())
    assert (prof["model"], prof["gpu"], prof["block_size"], prof["device"]) == ("tiny", "cpu", 16, "cpu")
    steps = [pd.read_parquet(tmp_path / "runs" / f"replay-{name}" / "paged" / "steps.parquet")
             for name in profile.TRACES]
    # The fit takes every step that computed tokens but the stalls it leaves out (a pause of the wall
    # clock on a busy machine); a replay on the wall clock may also log an idle step.
    busy = sum(int((s["num_batched_tokens"] > 0).sum()) for s in steps)
    assert prof["fit"]["num_steps"] == busy - prof["stalls_excluded"]["count"]
    for name, (_, (low, _high), _) in profile.TRACES.items():
        trace = pd.read_csv(tmp_path / "runs" / f"{name}.csv")
        assert len(trace) == 4
        assert trace["prompt_len"].between(low, 320 - profile.OUTPUT_RANGE[1]).all()
    # The relative objective, scaled: the fit prices its own steps' total exactly.
    assert prof["fit"]["total_time_rel_error"] == pytest.approx(0.0, abs=1e-9)


def test_replay_only_measures_the_floor_without_a_profile(tmp_path, single_thread, capsys):
    assert calibration.main(["--replay-only", "--parts", "C", "--repeat", "C", "--max-model-len", "256",
                             "--out", str(tmp_path), "--profile", "no-such-profile"]) == 0
    assert (tmp_path / "C" / "real" / "paged" / "steps.parquet").is_file()
    assert (tmp_path / "C-repeat" / "floor" / "comparison.json").is_file()
    assert not (tmp_path / "C" / "sim").exists()
    assert "C-repeat vs C" in capsys.readouterr().out
    # Replays copied from the machine that ran them validate here: their config.json's trace path is that
    # machine's (moved away below), so the part's trace must come from the folder.
    moved = tmp_path.parent / f"{tmp_path.name}-moved"
    tmp_path.rename(moved)
    assert calibration.main(["--reuse", "--parts", "C", "--repeat", "C", "--max-model-len", "256",
                             "--out", str(moved), "--profile", "cpu-tiny"]) == 0
    assert "| C-repeat |" in (moved / "validation.md").read_text()
    assert (moved / "validation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_another_trace_is_a_part(tmp_path, single_thread):
    assert calibration.main(["--parts", "code", "--max-model-len", "256", "--out", str(tmp_path),
                             "--profile", "cpu-tiny"]) == 0
    trace = pd.read_csv(tmp_path / "azure-code-0-39.csv")
    requests = pd.read_parquet(tmp_path / "code" / "real" / "paged" / "requests.parquet")
    assert trace["request_id"].tolist() == requests["request_id"].tolist() == list(range(40))
    assert "held-out runs of azure-code" in (tmp_path / "validation.md").read_text()

"""`pagelab simulate|replay --kv-offloading-size ...`: the tiers' rows in the serving table, bad settings."""
from __future__ import annotations

import json

import pytest
from clirun import one_line_error, pagelab
from typer.testing import CliRunner

from cli import app
from traces import save_trace
from traces.multiturn import MultiTurnConfig, generate_multiturn

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("wide_consoles")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiers") / "chat.csv"
    save_trace(generate_multiturn(MultiTurnConfig(num_requests=150, first_prompt_len=400, user_len=80,
                                                  output_len=60, mean_turns=4, think_time_s=2, rate=4,
                                                  system_prompt_len=64, prefix_block_size=16,
                                                  max_model_len=2048, seed=2)), path)
    return path


def test_simulate_with_tiers_shows_tokens_by_source(chat):
    result = runner.invoke(app, ["simulate", str(chat), "--capacity-tokens", "2560", "--max-model-len",
                                 "2048", "--kv-offloading-size", "0.5", "--kv-offloading-disk-size", "2"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "paged" in out and "contiguous" not in out  # tiers need the paged pool: it runs alone
    rows = {line.split("(%)")[0].strip(): float(line.split()[-1]) for line in out.splitlines()
            if line.strip().startswith("Prompt tokens")}
    assert set(rows) == {"Prompt tokens computed", "Prompt tokens from GPU cache",
                         "Prompt tokens from CPU tier", "Prompt tokens from disk tier"}
    assert sum(rows.values()) == pytest.approx(100, abs=0.3)
    assert rows["Prompt tokens from CPU tier"] > 0


def test_simulate_without_tiers_has_no_tier_rows(chat):
    result = runner.invoke(app, ["simulate", str(chat), "--capacity-tokens", "2560", "--max-model-len",
                                 "2048", "-a", "paged"])
    assert result.exit_code == 0, result.output
    assert "Prompt tokens" not in result.stdout


def test_compare_lists_the_tiers_among_the_configuration_differences(chat, tmp_path):
    base = ["simulate", str(chat), "--capacity-tokens", "2560", "--max-model-len", "2048", "-a", "paged"]
    assert runner.invoke(app, [*base, "--out", str(tmp_path / "a")]).exit_code == 0
    assert runner.invoke(app, [*base, "--kv-offloading-size", "0.5", "--kv-offloading-disk-size", "2",
                               "--kv-offloading-policy", "lfu", "--out", str(tmp_path / "b")]).exit_code == 0
    result = runner.invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines() if line.strip()}
    assert rows["kv_offloading_size"] == ["-", "0.50"]
    assert rows["kv_offloading_disk_size"] == ["-", "2.00"]
    assert rows["kv_offloading_policy"] == ["-", "lfu"]


@pytest.mark.parametrize(("args", "message"), [
    (["--kv-offloading-policy", "arc"], "--kv-offloading-policy must be one of lru, lfu, s3fifo"),
    (["--kv-offloading-block-size", "24"], "must be a multiple of --block-size 16"),
    (["-a", "contiguous-max"], "need the paged allocator"),
])
def test_bad_tier_options_exit_2(chat, args, message):
    result = runner.invoke(app, ["simulate", str(chat), "--capacity-tokens", "2560", "--max-model-len",
                                 "2048", "--kv-offloading-size", "1", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr


def test_replay_with_a_cpu_tier_loads_prefix_blocks_from_it(chat, tmp_path):
    out = tmp_path / "run"
    result = pagelab("replay", chat, "--limit", "10", "--max-model-len", "256", "--num-blocks", "24",
                     "--kv-offloading-size", "0.01", "--kv-offloading-store", "eager", "--time-scale", "0",
                     "--clock", "cpu", "--out", out, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Prompt tokens from CPU tier" in result.stdout
    tiers = json.loads((out / "paged" / "summary.json").read_text())["kv_tiers"]
    assert tiers["tokens_by_source"]["cpu_hit"] > 0 and tiers["store"] == "eager"
    config = json.loads((out / "paged" / "config.json").read_text())
    assert config["kv_offloading_size"] == 0.01


def test_replay_with_a_disk_tier_in_a_file_is_a_one_line_error(chat, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    result = pagelab("replay", chat, "--limit", "2", "--max-model-len", "256", "--num-blocks", "24",
                     "--kv-offloading-disk-size", "0.001", "--kv-offloading-disk-path", blocker)
    assert f"--kv-offloading-disk-path {blocker}: cannot create the disk tier's" in one_line_error(result)

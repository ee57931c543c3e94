"""`compare` and `calibrate` on run folders with a table cut short: every file that cannot be read is named,
and what can be compared or fitted still is, with a warning."""
from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from cli import app
from traces import SyntheticConfig, generate_trace, save_trace

runner = CliRunner()
# pyarrow's words for a file cut short
NOT_PARQUET = ("Parquet magic bytes not found in footer. Either the file is corrupted or this is not a "
               "parquet file.")
pytestmark = pytest.mark.usefixtures("single_thread", "wide_consoles")


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A CPU replay of a small trace and a simulation of the same trace."""
    tmp = tmp_path_factory.mktemp("runs")
    trace = generate_trace(SyntheticConfig(num_requests=10, arrival="poisson", rate=50.0, lengths="uniform",
                                           prompt_range=(8, 60), output_range=(4, 24), max_model_len=256,
                                           seed=2))
    save_trace(trace, tmp / "t.csv")
    result = run("replay", tmp / "t.csv", "--device", "cpu", "--backend", "torch", "--num-blocks", 16,
                 "--max-model-len", 256, "--time-scale", 0, "--out", tmp / "real")
    assert result.exit_code == 0, result.output
    result = run("simulate", tmp / "t.csv", "--config-from", tmp / "real",
                 "--out", tmp / "sim")
    assert result.exit_code == 0, result.output
    return tmp


def _copy(folders, tmp_path, name: str):
    return shutil.copytree(folders / name, tmp_path / name)


def _truncate(path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def _warnings(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("warning:")]


def test_compare_leaves_out_what_needs_an_unreadable_table(folders, tmp_path):
    real = _copy(folders, tmp_path, "real")
    _truncate(real / "paged" / "requests.parquet")
    result = run("compare", folders / "sim", real, "--out", tmp_path / "cmp")
    assert result.exit_code == 0, result.output
    assert _warnings(result.output) == [f"warning: {real / 'paged' / 'requests.parquet'}: cannot read table "
                                        f"({NOT_PARQUET}): compare leaves out what needs the requests table"]
    comparison = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert comparison["latency"]["e2e_s"]["count"] == 0 and comparison["num_requests"] is None
    assert comparison["step_time"]["count"] > 0  # memory and steps still compared
    assert len(comparison["warnings"]) == 1
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == ["comparison.json"]  # no latency overlay


def test_compare_without_a_memory_table_compares_the_latencies(folders, tmp_path):
    real = _copy(folders, tmp_path, "real")
    _truncate(real / "paged" / "memory.parquet")
    result = run("compare", folders / "sim", real)
    assert result.exit_code == 0, result.output
    assert f"{real / 'paged' / 'memory.parquet'}: cannot read table" in _warnings(result.output)[0]
    assert "memory breakdown: not compared (a memory table cannot be read)" in result.output


def test_calibrate_fits_the_runs_it_can_read(folders, tmp_path):
    good, bad = _copy(folders, tmp_path, "real"), shutil.copytree(folders / "real", tmp_path / "bad")
    _truncate(bad / "paged" / "steps.parquet")
    result = run("calibrate", good, bad, "--out", tmp_path / "profile.json", "--min-steps", 10)
    assert result.exit_code == 0, result.output
    assert _warnings(result.output) == [f"warning: {bad / 'paged' / 'steps.parquet'}: cannot read table "
                                        f"({NOT_PARQUET}): calibrate leaves out {bad}/paged"]
    assert (tmp_path / "profile.json").is_file()
    _truncate(good / "paged" / "steps.parquet")
    result = run("calibrate", good, bad, "--out", tmp_path / "again.json", "--min-steps", 10)
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: no steps table could be read ({good / 'paged' / 'steps.parquet'}, "
                      f"{bad / 'paged' / 'steps.parquet'})"]
    assert not (tmp_path / "again.json").exists()


def test_compare_names_a_steps_column_the_replay_lacks(folders, tmp_path):
    import pyarrow.parquet as pq

    real = _copy(folders, tmp_path, "real")
    steps = real / "paged" / "steps.parquet"
    pq.write_table(pq.read_table(steps).drop(["num_batched_tokens"]), steps)
    result = run("compare", folders / "sim", real, "--out", tmp_path / "cmp")
    assert result.exit_code == 2, (result.output, result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {real / 'paged'}: steps table has no column 'num_batched_tokens' (written by "
                      "pagelab replay)"]
    assert not (tmp_path / "cmp").exists()
    # calibrate says the same of the same table
    result = run("calibrate", real, "--out", tmp_path / "profile.json")
    assert [line for line in result.output.splitlines() if line.startswith("error:")] == errors

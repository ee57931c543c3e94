"""`pagelab bench engine --host`: host work per decode step, one row per model, batch and allocator."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from cli import app

runner = CliRunner()


def test_bench_engine_host_reports_rows_per_batch_and_allocator():
    result = runner.invoke(app, ["bench", "engine", "--host", "--batch", "2,3", "--steps", "3",
                                 "--allocator", "paged", "--allocator", "contiguous-max", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [(r["model"], r["num_seqs"], r["allocator"]) for r in rows] == [
        (m, n, a) for m in ("stub", "tiny") for n in (2, 3) for a in ("paged", "contiguous-max")]
    assert all(0 < r["p50_ms"] <= r["p90_ms"] and r["max_model_len"] == 4096 for r in rows)


def test_bench_engine_host_one_model_and_its_table_says_p50():
    result = runner.invoke(app, ["bench", "engine", "--host", "--host-model", "stub", "--batch", "2",
                                 "--steps", "2", "--allocator", "paged"])
    assert result.exit_code == 0, result.output
    assert "p50" in result.output and "tiny" not in result.output.split("\n", 2)[-1]


def test_bench_engine_host_rejects_bad_batch():
    result = runner.invoke(app, ["bench", "engine", "--host", "--batch", "x"])
    assert result.exit_code == 2
    assert "--batch" in result.output


def test_bench_engine_host_rejects_an_unknown_model():
    result = runner.invoke(app, ["bench", "engine", "--host", "--host-model", "huge"])
    assert result.exit_code == 2
    assert "--host-model must be stub, tiny or both" in result.output


def test_bench_engine_host_saves_its_rows_when_asked(tmp_path):
    result = runner.invoke(app, ["bench", "engine", "--host", "--host-model", "stub", "--batch", "2",
                                 "--steps", "2", "--allocator", "paged", "--json", "--save-result",
                                 "--result-dir", str(tmp_path), "--result-filename", "host.json"])
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "host.json").read_text())
    assert saved["result"] == json.loads(result.stdout)

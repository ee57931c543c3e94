"""`pagelab bench engine --host`: the stub-model host-time bench, one row per batch and allocator."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from cli import app

runner = CliRunner()


def test_bench_engine_host_reports_rows_per_batch_and_allocator():
    result = runner.invoke(app, ["bench", "engine", "--host", "--batch", "2,3", "--steps", "2",
                                 "--allocator", "paged", "--allocator", "contiguous-max", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [(r["num_seqs"], r["allocator"]) for r in rows] == [
        (2, "paged"), (2, "contiguous-max"), (3, "paged"), (3, "contiguous-max")]
    assert all(r["min_ms"] > 0 and r["p50_ms"] >= r["min_ms"] for r in rows)


def test_bench_engine_host_rejects_bad_batch():
    result = runner.invoke(app, ["bench", "engine", "--host", "--batch", "x"])
    assert result.exit_code == 2
    assert "--batch" in result.output

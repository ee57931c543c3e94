"""`pagelab trace reuse` and `trace gen --multi-turn` through typer's CliRunner."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli import app
from traces import load_trace
from traces.stats import trace_info

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("wide_consoles")


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    path = tmp_path_factory.mktemp("reuse") / "chat.parquet"
    result = runner.invoke(app, ["trace", "gen", "--multi-turn", "--num", "600", "--turns", "3",
                                 "--think-time", "30", "--prefix-block-size", "64", "-o", str(path)])
    assert result.exit_code == 0, result.output
    return path


def test_gen_multi_turn_writes_conversations(chat):
    trace = load_trace(chat)
    assert len(trace) == 600 and (trace["prefix_block_size"] == 64).all()
    assert trace_info(trace)["prefix"]["repeat_fraction"] > 0.3


def test_reuse_json_reports_every_capacity_and_policy(chat, tmp_path):
    plot = tmp_path / "curve.png"
    result = run("trace", "reuse", chat, "--capacity", "1e4,1e5,1e9", "--policy", "lru,lfu,s3fifo",
                 "--json", "--plot", plot)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    info = trace_info(load_trace(chat))["prefix"]
    assert report["recorded"]["repeat_fraction"] == info["repeat_fraction"]
    assert [r["capacity_tokens"] for r in report["capacities"]] == [10**4, 10**5, 10**9]
    lru = [r["lru"]["hit_ratio"] for r in report["capacities"]]
    assert lru[0] < lru[1] < lru[2] == report["infinite"]["hit_ratio"]
    assert report["capacities"][2]["s3fifo"]["hit_ratio"] == lru[2]
    ratios = report["lru_curve"]["hit_ratio"]
    assert ratios == sorted(ratios) and ratios[-1] == report["infinite"]["hit_ratio"]
    assert plot.stat().st_size > 0


def test_reuse_table_names_the_trace(chat):
    result = run("trace", "reuse", chat, "--capacity", "100000")
    assert result.exit_code == 0, result.output
    assert "100,000" in result.stdout and "infinite" in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--capacity", "1e4,lots"], "--capacity expects token counts"),
    (["--policy", "lru,arc"], "--policy expects names from lru, lfu, s3fifo"),
    (["--block-size", "48"], "block_size 48 cannot reuse prefix keys recorded at 64"),
    (["--plot", "curve.xyz"], "--plot curve.xyz: format 'xyz' is not one of png, svg, pdf"),
])
def test_bad_options_exit_2(chat, args, message):
    result = run("trace", "reuse", chat, *args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert result.stdout == ""  # refused before the trace is read


def test_a_trace_without_keys_is_refused(tmp_path):
    path = tmp_path / "plain.csv"
    assert run("trace", "gen", "--num", "20", "-o", path).exit_code == 0
    result = run("trace", "reuse", path)
    assert result.exit_code == 2 and "records no prefix keys" in result.stderr

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


def test_repeated_capacities_and_policies_add_up_as_commas_do(chat):
    commas = run("trace", "reuse", chat, "--capacity", "1e4,1e5", "--policy", "lru,lfu", "--json")
    repeated = run("trace", "reuse", chat, "--capacity", "1e4", "--capacity", "1e5", "--policy", "lru",
                   "--policy", "lfu", "--json")
    assert commas.exit_code == repeated.exit_code == 0, repeated.output
    report = json.loads(repeated.stdout)
    assert [r["capacity_tokens"] for r in report["capacities"]] == [10**4, 10**5]
    assert set(report["capacities"][0]) >= {"lru", "lfu"} and report == json.loads(commas.stdout)


def test_reuse_table_names_the_trace(chat):
    result = run("trace", "reuse", chat, "--capacity", "100000")
    assert result.exit_code == 0, result.output
    assert "100,000" in result.stdout and "infinite" in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--capacity", "1e4,lots"], "--capacity expects token counts"),
    (["--capacity", "inf"], "--capacity expects whole token counts from 1 to 1e+15 (got 'inf')"),
    (["--capacity", "1e30"], "--capacity expects whole token counts from 1 to 1e+15 (got '1e30')"),
    (["--policy", "lru,arc"], "--policy expects names from lru, lfu, s3fifo (got 'arc')"),
    (["--block-size", "48"], "block_size 48 cannot reuse prefix keys recorded at 64"),
    (["--plot", "curve.xyz"], "--plot curve.xyz: format 'xyz' is not one of png, svg, pdf"),
])
def test_bad_options_exit_2(chat, args, message):
    result = run("trace", "reuse", chat, *args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert result.stdout == ""  # refused before the trace is read
    assert "prefix caching" not in result.stderr  # trace reuse has no such option to point at


def test_a_trace_without_keys_is_refused(tmp_path):
    path = tmp_path / "plain.csv"
    assert run("trace", "gen", "--num", "20", "-o", path).exit_code == 0
    result = run("trace", "reuse", path)
    assert result.exit_code == 2 and "records no prefix keys" in result.stderr


def _parquet(path, keys, key_type):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"arrival_s": [0.0, 1.0], "prompt_len": [40, 40], "output_len": [5, 5],
                             "prefix_blocks": pa.array(keys, key_type), "prefix_block_size": [16, 16]}), path)
    return path


def test_keys_stored_as_text_are_parsed_as_trace_info_parses_them(tmp_path):
    import pyarrow as pa

    text = _parquet(tmp_path / "text.parquet", ["1 2", "1 3"], pa.large_string())
    lists = _parquet(tmp_path / "lists.parquet", [[1, 2], [1, 3]], pa.list_(pa.int64()))
    reports = [run("trace", "reuse", path, "--json") for path in (text, lists)]
    assert all(r.exit_code == 0 for r in reports), reports[0].output
    assert json.loads(reports[0].stdout) == json.loads(reports[1].stdout)
    assert json.loads(reports[0].stdout)["recorded"]["unique_blocks"] == 3


@pytest.mark.parametrize("command", [["info"], ["reuse"], ["convert", "out.csv"]])
def test_keys_beyond_int64_are_refused_by_every_command(tmp_path, command):
    import pyarrow as pa

    path = _parquet(tmp_path / "u64.parquet", [[1, 2**63], [1, 3]], pa.list_(pa.uint64()))
    result = run("trace", command[0], path, *(str(tmp_path / c) for c in command[1:]))
    assert result.exit_code == 2, result.output
    assert "u64.parquet row 1, field 'prefix_blocks': key 9223372036854775808 is outside" in result.stderr

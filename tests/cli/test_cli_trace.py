"""`pagelab trace gen | info | convert` through typer's CliRunner: exit codes, messages, files."""
from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from traces import load_trace

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("wide_consoles")


def run(*args: str):
    """Invoke `pagelab ARGS...`."""
    return runner.invoke(app, [str(a) for a in args])


def test_gen_writes_a_trace_that_matches_the_options(tmp_path):
    out = tmp_path / "g.parquet"
    result = run("trace", "gen", "--num", 400, "--arrival", "gamma", "--rate", 5, "--cv", 2,
                 "--lengths", "alpaca", "--shared-prefix", "2:64:0.5", "--n", 3, "--seed", 4, "--out", out)
    assert result.exit_code == 0, result.output
    assert "wrote 400 requests" in result.stdout
    df = load_trace(out)
    assert len(df) == 400 and set(df["n"]) == {3}
    assert df["prefix_blocks"].map(len).gt(0).mean() == pytest.approx(0.5, abs=0.1)
    again = tmp_path / "h.parquet"
    run("trace", "gen", "--num", 400, "--arrival", "gamma", "--rate", 5, "--cv", 2, "--lengths", "alpaca",
        "--shared-prefix", "2:64:0.5", "--n", 3, "--seed", 4, "--out", again)
    pd.testing.assert_frame_equal(load_trace(again), df)


def test_gen_fixed_and_uniform(tmp_path):
    assert run("trace", "gen", "--num", 10, "--lengths", "fixed", "--prompt-len", 9, "--output-len", 4,
               "--out", tmp_path / "f.csv").exit_code == 0
    assert set(load_trace(tmp_path / "f.csv")["prompt_len"]) == {9}
    assert run("trace", "gen", "--num", 300, "--lengths", "uniform", "--prompt-range", "5:6",
               "--output-range", "1:1", "--out", tmp_path / "u.jsonl").exit_code == 0
    assert set(load_trace(tmp_path / "u.jsonl")["prompt_len"]) == {5, 6}


def test_gen_resamples_a_trace_and_prints_the_warning_in_stderr(tmp_path):
    result = run("trace", "gen", "--num", 50, "--lengths", "azure-code", "--out", tmp_path / "r.csv")
    assert result.exit_code == 0, result.output
    assert "warning:" in result.stderr and "left out" in result.stderr


def test_gen_lengths_from_a_vidur_length_only_file(tmp_path):
    src = tmp_path / "lengths.csv"
    src.write_text("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n30,5,35,6\n8,2,10,4\n")
    result = run("trace", "gen", "--num", 20, "--lengths-from", src, "--arrival", "poisson", "--rate", 2,
                 "--out", tmp_path / "r.csv")
    assert result.exit_code == 0, result.output
    assert set(load_trace(tmp_path / "r.csv")["prompt_len"]) <= {30, 8}


def test_gen_multi_turn_defaults_to_the_conversation_traces_rate(tmp_path):
    from traces.multiturn import MultiTurnConfig, generate_multiturn

    out = tmp_path / "mt.csv"
    assert run("trace", "gen", "--multi-turn", "--num", 300, "--out", out).exit_code == 0
    expected = generate_multiturn(MultiTurnConfig(num_requests=300))  # the Mooncake-like rate, 3.4
    assert load_trace(out)["arrival_s"].to_numpy() == pytest.approx(expected["arrival_s"].to_numpy())
    given = tmp_path / "given.csv"
    assert run("trace", "gen", "--multi-turn", "--num", 300, "--rate", 2, "--out", given).exit_code == 0
    assert load_trace(given)["arrival_s"].max() > load_trace(out)["arrival_s"].max()


@pytest.mark.parametrize(("size", "warned"), [(100, True), (32, False), (8, False), (512, False)])
def test_gen_warns_of_prefix_keys_the_default_block_size_cannot_reuse(tmp_path, size, warned):
    result = run("trace", "gen", "--multi-turn", "--num", 20, "--prefix-block-size", size, "--out",
                 tmp_path / "mt.csv")
    assert result.exit_code == 0, result.output
    assert (f"--prefix-block-size {size}: a paged run reuses these keys only" in result.output) == warned


@pytest.mark.parametrize(("args", "message"), [
    # A generator's refusal names the option that gave the setting, not the configuration field.
    (["--arrival", "weekly"], "--arrival: must be one of poisson, gamma, burst (got 'weekly')"),
    (["--rate", "-1"], "--request-rate: must be > 0 (got -1.0)"),
    (["--multi-turn", "--prefix-block-size", "0"], "--prefix-block-size: must be >= 1 (got 0)"),
    (["--multi-turn", "--max-model-len", "1"], "--max-model-len: leaves no room for a user message"),
    (["--shared-prefix", "2:64"], "--shared-prefix expects K:L:F"),
    (["--prompt-range", "a:b", "--lengths", "uniform"], "--prompt-range expects LO:HI"),
    (["--lengths", "no-such-trace.csv"], "no-such-trace.csv: no such file"),
    (["--seed", "-1"], "--seed must be a whole number >= 0, got -1"),
    (["--shared-prefix", "0:10:0.5"], "K, the number of system prompts, must be >= 1"),
    # Options the chosen kind of trace would ignore are refused, by name.
    (["--multi-turn", "--arrival", "burst"], "--arrival does not apply with --multi-turn"),
    (["--multi-turn", "--burstiness", "2", "--n", "2", "--beam-width", "2"],
     "--burstiness, --n, --beam-width do not apply with --multi-turn"),
    (["--multi-turn", "--cv", "2"], "--cv does not apply with --multi-turn"),
    (["--cv", "2"], "--cv shapes gamma arrivals: it needs --arrival gamma (got --arrival poisson)"),
    (["--arrival", "burst", "--burstiness", "2"], "--burstiness makes gamma arrivals"),
    (["--arrival", "poisson", "--burstiness", "2"], "--burstiness makes gamma arrivals: it does not apply "
     "with --arrival poisson"),
    (["--arrival", "burst", "--rate", "3"], "--request-rate does not apply with --arrival burst"),
    (["--arrival", "gamma", "--rate", "inf"], "--request-rate inf puts every request at t=0: it does not "
     "apply with --arrival gamma"),
    (["--prefix-block-size", "32"], "--prefix-block-size records shared prefixes: it needs --shared-prefix"),
    (["--turns", "3", "--think-time", "5"], "--turns, --think-time do not apply without --multi-turn"),
    (["--prompt-len", "64"], "--prompt-len applies only with --lengths fixed (got --lengths sharegpt)"),
    (["--lengths", "uniform", "--output-len", "9"], "--output-len applies only with --lengths fixed"),
    (["--lengths", "fixed", "--prompt-range", "1:9"], "--prompt-range applies only with --lengths uniform"),
    (["--multi-turn", "--output-len", "9"], "--output-len does not apply with --multi-turn"),
    (["--multi-turn", "--turns", "inf"], "--turns must be a finite number in [1, 10,000], got inf"),
    (["--multi-turn", "--think-time", "inf"], "--think-time must be a finite number of seconds"),
    (["--multi-turn", "--think-time", "1e12"], "--think-time must be a finite number of seconds"),
])
def test_gen_bad_options_exit_2_without_traceback(tmp_path, args, message):
    result = run("trace", "gen", "--out", tmp_path / "x.csv", *args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "x.csv").exists()


def test_info_table_and_json_for_a_bundled_trace():
    table = run("trace", "info", "mooncake-conv")
    assert table.exit_code == 0, table.output
    for text in ("prompt_len", "12,031 requests", "36.6% repeats"):
        assert text in table.stdout
    as_json = run("trace", "info", "azure-conv", "--json")
    assert as_json.exit_code == 0
    info = json.loads(as_json.stdout)
    assert info["num_requests"] == 19_366 and info["prefix"] is None


def test_info_says_when_prefix_keys_are_recorded_at_several_block_sizes(tmp_path):
    mixed = tmp_path / "mixed.csv"
    mixed.write_text("arrival_s,prompt_len,output_len,prefix_blocks,prefix_block_size\n"
                     "0,64,5,1 2,32\n1,64,5,3,16\n2,64,5,1 2 4,16\n")
    result = run("trace", "info", mixed)
    assert result.exit_code == 0, result.output
    assert "prefix blocks (mixed sizes: 16, 32 tokens)" in result.stdout


def test_info_on_bad_file_names_file_line_and_field(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,5,0\n")
    result = run("trace", "info", bad)
    assert result.exit_code == 2
    assert f"{bad} line 2, field 'GeneratedTokens': zero output length" in result.stderr
    assert "Traceback" not in result.output


def test_info_prints_fix_warnings_in_stderr(tmp_path):
    src = tmp_path / "burst.csv"
    src.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                   "1,m,5,6,11,x\n2,m,5,0,5,x\n3,m,5,0,5,x\n0.5,m,7,1,8,x\n")
    result = run("trace", "info", src, "--json")
    assert result.exit_code == 0, result.output
    assert "dropped 2 failed requests" in result.stderr
    assert "sorted by arrival" in result.stderr
    assert json.loads(result.stdout)["num_requests"] == 2


def test_convert_between_formats(tmp_path):
    out = tmp_path / "m.jsonl"
    result = run("trace", "convert", "mooncake-conv", out)
    assert result.exit_code == 0, result.output
    assert "converted 12031 requests" in result.stdout
    pd.testing.assert_frame_equal(load_trace(out), load_trace("mooncake-conv"))


def test_convert_refuses_unknown_output_suffix_and_unknown_input(tmp_path):
    result = run("trace", "convert", "azure-code", tmp_path / "out.xml")
    assert result.exit_code == 2 and "use .csv, .jsonl or .parquet" in result.stderr
    odd = tmp_path / "odd.csv"
    odd.write_text("a,b\n1,2\n")
    result = run("trace", "convert", odd, tmp_path / "out.csv")
    assert result.exit_code == 2 and "unknown trace format" in result.stderr


@pytest.mark.parametrize(("name", "magic"), [("p.png", b"\x89PNG"), ("p.SVG", b"<?xml"), ("p", b"\x89PNG")])
def test_info_plot_writes_the_overview_into_the_file_named(tmp_path, name, magic):
    out = tmp_path / name  # as `trace reuse --plot`: an upper-case suffix or none (PNG) names a file too
    result = run("trace", "info", "azure-code", "--plot", out)
    assert result.exit_code == 0, result.output
    assert out.is_file() and out.read_bytes().startswith(magic)


def test_info_refuses_a_plot_format_before_reading_the_trace(tmp_path):
    result = run("trace", "info", "azure-code", "--plot", tmp_path / "p.xyz")
    assert result.exit_code == 2 and result.stdout == ""
    assert "format 'xyz' is not one of png, svg, pdf" in result.stderr

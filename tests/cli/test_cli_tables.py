"""Every table the CLI prints fits 80 columns with every cell whole: no "...", no cell broken over lines.

Each table builder is rendered with the widest values a run can give it (ten million requests, TTFTs of
hundreds of seconds, long config values), and the commands that print them run at COLUMNS=80.
"""
from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pandas as pd
import pytest
from clirun import pagelab
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cli.bench_tables import attention_table
from cli.compare import comparison_report, side_by_side, side_by_side_tables
from cli.presets import _table, preset_rows
from cli.report import memory_table, serving_table
from cli.sweep import max_rate_table
from simulator.metrics import METRICS

WIDTH = 80


def cells(table: Table) -> list[str]:
    """Every cell's text (headers included)."""
    out = []
    for column in table.columns:
        out.append(str(column.header))
        out += [c.plain if isinstance(c, Text) else str(c) for c in column._cells]
    return [c for c in out if c.strip()]


def render(table: Table, width: int = WIDTH) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None, legacy_windows=False)
    console.print(table)
    return console.file.getvalue()


def assert_fits(table: Table) -> None:
    text = render(table)
    lines = text.splitlines()
    assert max(map(len, lines)) <= WIDTH, text
    assert "…" not in text, text
    for cell in cells(table):
        assert any(cell in line for line in lines), f"cell {cell!r} is not whole on one line:\n{text}"


def _metrics(scale: float) -> dict:
    """A run's serving metrics with every latency statistic `scale` ms (and large counts)."""
    m = {"duration_s": 254_000.5, "completed": 9_999_999, "rejected": 12_345, "request_throughput": 39.37,
         "output_throughput": 123_456.7, "total_token_throughput": 2_345_678.9, "request_goodput": 12.5,
         "max_output_tokens_per_s": 234_567.0, "max_concurrent_requests": 1_234_567,
         "total_input_tokens": 12_345_678_901, "total_output_tokens": 2_345_678_901}
    for kind in METRICS:
        for stat in ("mean", "median", "std", "p50", "p90", "p99", "p99.9"):
            m[f"{stat}_{kind}_ms"] = scale * (1.7 if stat == "p99.9" else 1.0)
    return m


def _summary(name: str) -> dict:
    return {"memory": {"token_states": 0.231, "reservation": 0.164, "internal_fragmentation": 0.086,
                       "external_fragmentation": 0.218, "free": 0.298},
            "mean_batch_size": 153.56, "num_preemptions": 12_345_678, "num_rejected": 9_999_999,
            "prefix_cache_hit_rate": 0.123 if name == "paged" else None}


NAMES = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")


@pytest.mark.parametrize("scale", [0.012, 376_783.0, 3.2e9])
def test_the_serving_and_memory_tables_fit_with_four_allocators_and_any_values(scale):
    metrics = {n: _metrics(scale) for n in NAMES}
    summaries = {n: _summary(n) for n in NAMES}
    table = serving_table(metrics, METRICS, (50, 90, 99, 99.9), summaries)
    assert_fits(table)
    assert_fits(memory_table(summaries))
    rows = render(table)
    unit = "(s)" if scale >= 100_000 else "(ms)"  # the unit chosen per row, as the figures choose theirs
    assert f"Mean TTFT {unit}" in rows and "Prefix cache hit rate (%)" in rows


def test_the_memory_table_names_padding_and_window_blocks_only_for_runs_with_kv_cache_groups():
    summaries = {n: _summary(n) for n in NAMES}
    assert "padding" not in render(memory_table(summaries))
    summaries["paged"]["memory"].update(padding=0.0471, window_cached=0.2134)
    table = memory_table(summaries)
    assert_fits(table)
    assert ("paged: padding layers 4.7 of intern; window blocks kept for prefix caching 21.3 of free"
            in " ".join(render(table).split()))  # the caption wraps at the table's width


def test_a_run_that_rejected_every_request_shows_no_memory_shares():
    # No step ran, so no time weights the shares: the summary's are NaN and the table shows dashes.
    summary = _summary("contiguous-max")
    summary["memory"] = dict.fromkeys(summary["memory"], float("nan"))
    rows = render(memory_table({"contiguous-max": summary}))
    assert "nan" not in rows.lower() and rows.count(" - ") >= 4


def test_a_376_783_ms_ttft_is_shown_in_seconds_whole():
    rows = render(serving_table({"paged": _metrics(376_783.0)}, ("ttft",), (99,)))
    assert "Mean TTFT (s)" in rows and "376.8" in rows


def test_a_metrics_rows_share_one_unit_and_a_short_latency_beside_a_long_one_is_not_zero():
    long, short = _metrics(14.0), _metrics(14.0)
    long["p99_ttft_ms"] = 376_783.0  # one allocator's tail runs past 100 s
    rows = {line.split()[0] + " " + line.split()[1]: line.split()[3:] for line in
            render(serving_table({"a": short, "b": long}, ("ttft",), (99,)), width=120).splitlines()
            if "TTFT" in line}
    assert set(rows) == {"Mean TTFT", "Median TTFT", "P99 TTFT"}
    text = render(serving_table({"a": short, "b": long}, ("ttft",), (99,)), width=120)
    # one unit for every TTFT row: the mean is not in ms while its P99 is in s
    assert "Mean TTFT (s)" in text and "P99 TTFT (s)" in text and "(ms)" not in text
    assert rows["P99 TTFT"] == ["0.014", "376.8"] and rows["Mean TTFT"] == ["0.01", "0.01"]


def test_the_presets_tables_fit():
    rows = preset_rows()
    units = {"params_b": "params B", "kv_heads": "kv/q", "head_dim": "dim", "kv_kib_per_token": "KiB/tok",
             "max_model_len": "max len", "weights_gib": "wt GiB"}
    assert_fits(_table(rows["models"], "models", units))
    assert_fits(_table(rows["gpus"], "GPUs", {"memory_gib": "GiB", "hbm_tb_s": "HBM TB/s"}))


def test_the_max_rate_table_fits_with_three_swept_axes():
    rows = [{"allocator": a, "block_size": b, "kv_memory_gb": kv, "max_model_len": 2048, "max_rate": 12.345,
             "first_miss_rate": 13.02, "status": "found", "monotone": True, "runs": 14, "search_runs": 10,
             "paged_advantage": 2.13}
            for a in NAMES for b in (16, 32) for kv in (12.0, 24.0)]
    assert_fits(max_rate_table(pd.DataFrame(rows), "norm_latency <= 0.2 s/token"))


def test_the_max_rate_table_gives_a_contiguous_row_no_block_size():
    rows = [{"allocator": a, "block_size": b, "max_rate": 1.0, "first_miss_rate": 1.1, "status": "found",
             "monotone": True, "runs": 9, "search_runs": 5, "paged_advantage": 1.0}
            for a, b in (("paged", 8), ("paged", 16), ("contiguous-max", 8))]
    lines = render(max_rate_table(pd.DataFrame(rows), "norm_latency <= 0.2 s/token")).splitlines()
    assert [line.split()[:2] for line in lines if line.split()[:1] in (["paged"], ["max"])] == \
        [["paged", "8"], ["paged", "16"], ["max", "-"]]


def test_the_side_by_side_comparison_fits_with_long_config_values():
    config = {"model": "/data/checkpoints/Meta-Llama-3-8B-Instruct", "gpu": "h100-80gb", "allocator": "paged",
              "block_size": 16, "latency": "/home/me/profiles/h200-1b-fitted.json", "trace": "x.parquet"}
    latency = {"mean": 376.78, "p50": 1.2, "p90": 88.0, "p99": 4000.0}
    summary = {**_summary("paged"), "capacity_tokens": 2_251_088, "sim_duration_s": 254_000.5,
               "throughput_tokens_per_s": 123_456.7, **{k: latency for k in ("ttft_s", "tpot_s", "e2e_s")}}
    other = ({**config, "block_size": 32, "allocator": "contiguous-oracle"},
             {**summary, "capacity_tokens": 7})
    rows = side_by_side((config, summary), other)
    config, numbers = side_by_side_tables(rows)
    assert_fits(config)
    assert_fits(numbers)
    assert "Meta-Llama-3-8B-Instruct" in render(config)  # a path shows its last part
    assert "TTFT mean (s)" in render(numbers) and "376.8" in render(numbers)  # 376,780 ms, in seconds


def test_the_attention_benchmark_table_fits():
    def record(impl, batch, context, ms):
        return SimpleNamespace(impl=impl, batch=batch, context=context, num_heads=128, num_kv_heads=16,
                               head_dim=256, time_ms=ms, gb_per_s=1234.56, copy_bw_fraction=0.987,
                               vs_sdpa=219.79, rel_err_vs_sdpa=5.5e-7, dtype="bfloat16")
    records = [record(impl, b, c, ms) for impl in ("paged-triton-split-k", "paged-region-torch", "sdpa-dense")
               for b, c, ms in ((1, 64, 0.0123), (256, 131_072, 12_345.678))]
    assert_fits(attention_table(records))


def test_the_simulated_vs_measured_table_fits():
    stats = {"median_abs": 0.123, "p90_abs": 1.5, "median": -0.05, "count": 12_345}
    result = {"latency": {m: stats for m in ("ttft_s", "tpot_s", "e2e_s")},
              "step_time": {**stats, "basis": "latency model on the measured steps"},
              "throughput": {"rel_error": -0.031}}
    assert_fits(comparison_report(result))


def _command_output_fits(result) -> None:
    assert result.returncode == 0, result.stderr
    assert max(map(len, result.stdout.splitlines())) <= WIDTH, result.stdout
    assert "…" not in result.stdout, result.stdout


def test_commands_print_whole_tables_at_80_columns(tmp_path):
    # simulate (four allocators), presets, trace info, bench core and bench simulate, as a user runs them.
    for argv in (("simulate", "--limit", "300", "--kv-memory-gb", "2"), ("presets",),
                 ("trace", "info", "azure-conv"), ("bench", "core", "--num-tokens", "20000", "--repeat", "1"),
                 ("bench", "simulate", "--num", "200", "--repeat", "1", "--events", "both")):
        result = pagelab(*argv, cwd=tmp_path, COLUMNS="80")
        _command_output_fits(result)
    bench = pagelab("bench", "simulate", "--num", "200", "--repeat", "1", "--events", "both", "--json",
                    cwd=tmp_path)
    values = [str(v) for row in json.loads(bench.stdout) for v in row.values()]
    shown = pagelab("bench", "simulate", "--num", "200", "--repeat", "1", "--events", "both", cwd=tmp_path,
                    COLUMNS="80").stdout
    assert "azure-conv" in shown and "paged" in shown and len(values) > 10  # names whole, not "azur"/"e-co"


def test_compare_of_two_simulations_fits(tmp_path):
    for name, block in (("a", "16"), ("b", "32")):
        r = pagelab("simulate", "--limit", "100", "-a", "paged", "--block-size", block, "--out", name,
                    cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    _command_output_fits(pagelab("compare", "a", "b", cwd=tmp_path, COLUMNS="80"))

"""vllm-bench conventions and discoverability: metrics tables, goodput, saved results, aliases, warnings."""
from __future__ import annotations

import json

import pytest
from clirun import pagelab

SIM = ("simulate", "azure-conv", "--num-prompts", "30", "--kv-memory-gb", "2")


def test_tables_in_ms_fit_80_columns_and_show_goodput(tmp_path):
    r = pagelab(*SIM, "-a", "paged,contiguous-max", "--goodput", "ttft:200", "tpot:0.05s",
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "90,99",
                cwd=tmp_path, COLUMNS="80")
    assert r.returncode == 0, r.stderr
    for label in ("Mean TTFT (ms)", "Median TPOT (ms)", "P90 ITL (ms)", "P99 E2E latency (ms)",
                  "Request goodput (req/s)", "Total token throughput (tok/s)", "Completed requests",
                  "Total input tokens", "Total generated tokens", "Peak output throughput (tok/s)",
                  "Peak concurrent requests"):
        assert label in r.stdout
    assert "Goodput limits: ttft <= 200 ms, tpot <= 0.05 s\n" in r.stdout  # a bare number is ms
    assert "max" in r.stdout.split("Serving metrics")[1].splitlines()[2]  # one column per allocator
    assert max(map(len, r.stdout.splitlines())) <= 80
    for cmd in (("simulate", "-h"), ("replay", "-h"), ("trace", "gen", "-h"), ("-h",)):
        h = pagelab(*cmd, COLUMNS="80")
        assert h.returncode == 0 and max(map(len, h.stdout.splitlines())) <= 80 and "…" not in h.stdout


def test_goodput_limits_read_the_same_with_or_without_units(tmp_path):
    def goodput(*limits):
        name = f"g{len(list(tmp_path.iterdir()))}.json"
        r = pagelab(*SIM, "-a", "paged", "--goodput", *limits, "--save-result", "--result-filename", name,
                    cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        return json.loads((tmp_path / name).read_text())

    bare, units = goodput("ttft:100", "e2el:2000"), goodput("ttft:0.1s", "e2el:2000ms")
    assert 0 < bare["request_goodput"] == units["request_goodput"] < bare["request_throughput"]
    assert bare["goodput_slos_ms"] == units["goodput_slos_ms"] == {"ttft": 100.0, "e2el": 2000.0}


@pytest.mark.parametrize("argv, spread", [
    (["--goodput", "ttft:200", "tpot:50ms", "x.csv"],
     ["--goodput", "ttft:200", "--goodput", "tpot:50ms", "x.csv"]),
    (["--goodput", "e2el=2s", "tpot_p99:1s"], ["--goodput", "e2el=2s", "--goodput", "tpot_p99:1s"]),
    (["x.csv", "ttft:200"], ["x.csv", "ttft:200"]),  # no --goodput before it: left alone
    (["--goodput", "ttft:200", "--seed", "1", "tpot:5"], ["--goodput", "ttft:200", "--seed", "1", "tpot:5"]),
])
def test_words_after_goodput_that_read_as_limits_become_options(argv, spread):
    from cli.commands import spread_goodput
    assert spread_goodput(argv) == spread


def test_save_result_json_matches_the_run_folder(tmp_path):
    r = pagelab(*SIM, "-a", "paged", "--goodput", "e2el:5000", "--save-result", "--result-dir", "res",
                "--result-filename", "x.json", "--out", "run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    saved = json.loads((tmp_path / "res" / "x.json").read_text())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    m = summary["serving_metrics"]["paged"]
    assert (saved["completed"], saved["failed"], saved["duration"]) == (m["completed"], m["rejected"],
                                                                         m["duration_s"])
    for key in ("request_goodput", "request_throughput", "mean_ttft_ms", "p99_tpot_ms", "median_e2el_ms",
                "max_output_tokens_per_s", "max_concurrent_requests"):
        assert saved[key] == m[key], key
    # 30 requests over their run: some second holds several of them and more than one token
    assert 1 < saved["max_concurrent_requests"] <= 30 and saved["max_output_tokens_per_s"] > 1
    assert m["completed"] + m["rejected"] == 30 and saved["goodput_slos_ms"] == {"e2el": 5000.0}
    assert 0 < saved["request_goodput"] <= saved["request_throughput"]
    assert saved["backend"] == "pagelab-simulate" and saved["allocator"] == saved["label"] == "paged"
    assert saved["argv"][1] == "simulate"  # the command line that made it
    assert saved["kv_cache"] == summary["kv_cache"]
    bench = pagelab("bench", "core", "--num-tokens", "2000", "--repeat", "1", "--save-result", cwd=tmp_path)
    assert bench.returncode == 0, bench.stderr
    [path] = tmp_path.glob("pagelab-bench-core-*.json")
    assert json.loads(path.read_text())["result"]["tokens"] > 0


def test_request_rate_inf_sends_everything_at_zero_and_is_recorded(tmp_path):
    r = pagelab(*SIM, "-a", "paged", "--request-rate", "inf", "--out", "run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["trace"]["rate_override"] == "inf" and summary["trace"]["duration_s"] == 0


def test_burstiness_is_seeded_and_changes_the_arrivals(tmp_path):
    def arrivals(*extra):
        out = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
        r = pagelab(*SIM, "-a", "paged", "--request-rate", "5", *extra, "--out", out, "--table-format", "csv")
        assert r.returncode == 0, r.stderr
        return (out / "paged" / "requests.csv").read_text().splitlines()[1:]

    assert arrivals("--burstiness", "0.3", "--seed", "1") == arrivals("--burstiness", "0.3", "--seed", "1")
    assert arrivals("--burstiness", "0.3", "--seed", "1") != arrivals("--burstiness", "0.3", "--seed", "2")
    assert arrivals("--burstiness", "0.3") != arrivals()


def test_aliases_give_the_same_run(tmp_path):
    a = pagelab("simulate", "--trace", "azure-conv", "--limit", "30", "--kv-memory-gb", "2", "-a", "paged",
                "--rate", "3", "--save-result", "--result-filename", "a.json", cwd=tmp_path)
    b = pagelab(*SIM, "-a", "paged", "--request-rate", "3", "--save-result", "--result-filename", "b.json",
                cwd=tmp_path)
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    ma, mb = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    for key in ("date", "argv"):  # when and how it was asked: the rest is the run
        assert ma.pop(key) and mb.pop(key)
    assert ma == mb


def test_rejections_and_overload_are_warned_with_counts(tmp_path):
    r = pagelab("simulate", "azure-conv", "--limit", "300", "-a", "paged", "--max-model-len", "1024",
                "--request-rate", "300", "--kv-memory-gb", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rejected = [line for line in r.stderr.splitlines() if "were rejected" in line]
    assert len(rejected) == 1 and "longer than max_model_len 1,024" in rejected[0]
    assert "give --max-model-len 8192 (the model allows 8,192)" in rejected[0]  # what to change
    count = int(rejected[0].split("paged: ")[1].split(" of ")[0])
    assert f"Rejected requests {count}" in " ".join(r.stdout.split())
    assert "overloaded: the waiting queue grew" in r.stderr
    calm = pagelab(*SIM, "-a", "paged", "--max-model-len", "8192", cwd=tmp_path)
    assert "warning" not in calm.stderr


def test_a_pool_too_small_is_advised_by_the_option_that_sized_it(tmp_path):
    # --capacity-tokens and --kv-memory-gb override the GPU's options: only a larger value of theirs helps.
    for option, value in (("--capacity-tokens", "100"), ("--kv-memory-gb", "0.01")):
        r = pagelab("simulate", "azure-conv", "--limit", "30", "-a", "paged", option, value, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        rejected = [line for line in r.stderr.splitlines() if "need more KV memory" in line]
        assert len(rejected) == 1 and f"give a larger pool (a larger {option})" in rejected[0], r.stderr
    r = pagelab("simulate", "azure-conv", "--limit", "30", "-a", "paged", "--gpu", "a100-40gb",
                "--gpu-memory-utilization", "0.4", cwd=tmp_path)
    assert "give a larger pool (--kv-memory-gb, --gpu-memory-utilization or a larger --gpu)" in r.stderr


def test_progress_lines_in_logs(tmp_path):
    r = pagelab(*SIM, "-a", "paged,contiguous-pow2", cwd=tmp_path)
    assert "simulating paged: 30/30 (100%)" in r.stderr
    assert "simulating contiguous-pow2: 30/30 (100%)" in r.stderr
    # A run this short gets its last line only, not a line per tenth.
    assert [line for line in r.stderr.splitlines() if line.startswith("simulating paged:")] == [
        line for line in r.stderr.splitlines() if "simulating paged: 30/30 (100%)" in line]


def test_log_progress_prints_tenths_once_past_its_quiet_start(monkeypatch):
    import io

    from rich.console import Console

    import cli.common

    out = io.StringIO()
    monkeypatch.setattr(cli.common, "err_console", Console(file=out, width=200))
    for quiet_s in (0.0, 3600.0):
        log = cli.common.LogProgress("work", 100, quiet_s=quiet_s)
        for done in range(1, 101):
            log.update(done)
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 + 1  # every tenth once past a zero quiet start; the last line only otherwise
    assert lines[-1].startswith("work: 100/100 (100%)") and lines[-2].startswith("work: 100/100 (100%)")


@pytest.mark.parametrize("args, expect", [(("--version",), "pagelab "), (("-h",), "Usage: pagelab"),
                                          (("trace", "-h"), "Usage: pagelab trace"),
                                          (("presets",), "llama-3-8b")])
def test_discoverability(args, expect):
    r = pagelab(*args)
    assert r.returncode == 0, r.stderr
    assert expect in r.stdout


def test_presets_json_has_the_numbers():
    r = pagelab("presets", "--json")
    rows = json.loads(r.stdout)
    llama = next(m for m in rows["models"] if m["model"] == "llama-3-8b")
    assert llama["kv_kib_per_token"] == 128 and llama["max_model_len"] == 8192
    assert {g["gpu"] for g in rows["gpus"]} >= {"a100-80gb", "h100-80gb"}


def test_presets_say_what_replays_each_registry_model():
    rows = json.loads(pagelab("presets", "--json").stdout)
    by_name = {m["model"]: m for m in rows["models"]}
    assert "llama-1b-shape" in by_name["llama-3.2-1b"]["aliases"]
    assert by_name["llama-3.2-1b"]["replay"] == "llama-1b-shape"
    assert by_name["tiny-qwen2"]["replay"] == "tiny-qwen2"  # an engine preset is a registry entry too
    assert by_name["tiny-hybrid"]["replay"] == "tiny-hybrid"  # its engine config is not the entry's own
    assert by_name["llama-3-8b"]["replay"] == "checkpoint" and by_name["opt-13b"]["replay"] is None
    table = " ".join(pagelab("presets").stdout.split())  # the footer wraps at the console width
    assert "llama-1b-shape (= llama-3.2-1b)" in table and "cannot run opt-13b" in table
    assert "tiny-hybrid" not in table.split("checkpoint folder")[1].split(";")[0]
    assert by_name["llama-3-8b"]["hf_id"] == "meta-llama/Meta-Llama-3-8B"
    assert "meta-llama/Meta-Llama-3-8B or meta-llama/Meta-Llama-3-8B-Instruct (llama-3-8b)" in table
    assert "mistralai/Mistral-7B-v0.1 (mistral-7b-v0.1)" in table  # no Instruct id where none is registered
    # The models the roofline cannot time say so, by name.
    unknown = sorted(m["model"] for m in rows["models"] if m["params_b"] is None)
    assert unknown == ["deepseek-v3", "gpt-oss-120b", "gpt-oss-20b"]
    assert f"params -: {', '.join(by_name[m]['model'] for m in by_name if m in unknown)} give no parameter " \
           "count" in table and "simulate needs a fitted latency profile (--profile)" in table


def test_a_max_model_len_past_the_models_context_is_warned(tmp_path):
    long = pagelab("simulate", "--limit", "20", "-a", "paged", "--max-model-len", "100000", cwd=tmp_path)
    assert long.returncode == 0, long.stderr
    assert "--max-model-len 100,000 is longer than llama-3-8b's context of 8,192 tokens" in long.stderr
    own = pagelab("simulate", "--limit", "20", "-a", "paged", "--max-model-len", "8192", cwd=tmp_path)
    assert own.returncode == 0 and "context of" not in own.stderr


def test_replay_help_names_every_engine_preset():
    from gpu_backend.model_presets import ENGINE_PRESETS

    text = " ".join(pagelab("replay", "-h").stdout.split())
    assert f"Engine preset ({', '.join(ENGINE_PRESETS)})" in text

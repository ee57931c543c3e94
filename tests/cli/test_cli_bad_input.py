"""Bad input: each case exits 2 with a one-line message naming the problem."""
from __future__ import annotations

import json

import pandas as pd
import pytest
from clirun import one_line_error, pagelab

TINY = "arrival_s,prompt_len,output_len\n0,10,5\n1,20,6\n2,30,7\n"


@pytest.fixture
def files(tmp_path):
    """Small malformed traces, written in the test's folder."""
    (tmp_path / "tiny.csv").write_text(TINY)
    (tmp_path / "vidur.csv").write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n")
    (tmp_path / "wide.jsonl").write_text(json.dumps(
        {"timestamp": 0, "input_length": 10, "output_length": 5}) + "\n" +
        '{"timestamp": 1, "input_length": 99999999999999999999999, "output_length": 5}\n')
    (tmp_path / "bool.jsonl").write_text('{"timestamp": 0, "input_length": true, "output_length": 5}\n')
    pd.DataFrame({"arrival_s": [0.0, 1.0], "prompt_len": [8, 9], "output_len": [True, False]}).to_parquet(
        tmp_path / "bool.parquet")
    return tmp_path


CASES = [
    (("trace", "info", "vidur.csv"), "vidur.csv: no requests"),
    (("trace", "info", "wide.jsonl"), "wide.jsonl line 2, field 'input_length': value 1e+23 is too large"),
    (("trace", "info", "bool.jsonl"), "bool.jsonl line 1, field 'input_length': boolean value True is not"),
    (("trace", "info", "bool.parquet"), "bool.parquet row 1, field 'output_len': boolean value True is not"),
    (("simulate", "bool.jsonl"), "boolean value True is not a number"),
    (("trace", "info", "no[/b]such.csv"), "error: no[/b]such.csv: no such file"),
    (("trace", "info", "my:x:trace.csv"), "error: my:x:trace.csv: no such file"),
    (("trace", "gen", "--num", "1e11", "--out", "g.csv"), "Invalid value for '--num'"),
    (("trace", "gen", "--num", "100000000000", "--out", "g.csv"), "at most 100,000,000"),
    (("trace", "gen", "--burstiness", "0", "--out", "g.csv"), "--burstiness must be a finite number > 0"),
    (("simulate", "tiny.csv", "--kv-memory-gb", "inf"), "--kv-memory-gb must be a finite number, got inf"),
    (("simulate", "tiny.csv", "--kv-memory-gb", "nan"), "--kv-memory-gb must be a finite number, got nan"),
    (("simulate", "tiny.csv", "-a", "paged", "--kv-memory-gb", "1e6"),
     "this trace can never use more than"),
    (("simulate", "tiny.csv", "--max-model-len", "0"), "max_model_len must be > 0, got 0"),
    (("simulate", "tiny.csv", "-a", "paged", "--placement", "first-fit"),
     "--placement only applies to contiguous allocators"),
    (("simulate", "tiny.csv", "-a", "paged,nope"), "unknown allocator 'nope'"),
    (("simulate", "tiny.csv", "--rate", "nan"), "--request-rate/--rate must be > 0"),
    (("simulate", "tiny.csv", "--request-rate", "0"), "--request-rate/--rate must be > 0"),
    (("simulate", "tiny.csv", "--burstiness", "0.5"), "--burstiness shapes the gaps"),
    (("simulate", "tiny.csv", "--request-rate", "inf", "--burstiness", "1"), "--burstiness shapes the gaps"),
    (("simulate", "tiny.csv", "--limit", "2", "--num-prompts", "3"), "--limit/--num-prompts given twice"),
    (("simulate", "tiny.csv", "--num-prompts", "0"), "--limit/--num-prompts must be >= 1"),
    (("simulate", "tiny.csv", "--trace", "azure-conv"), "the trace (positional or --trace) given twice"),
    (("simulate", "tiny.csv", "--max-concurrency", "0"), "--max-concurrency must be >= 1"),
    (("simulate", "tiny.csv", "--goodput", "ttft:abc"), "--goodput 'ttft:abc': 'abc' is not a number"),
    (("simulate", "tiny.csv", "--goodput", "itl:5"), "unknown metric 'itl'; accepted: METRIC:VALUE[UNIT]"),
    (("simulate", "tiny.csv", "--goodput", "ttft:-1"), "the limit must be a positive, finite number"),
    (("simulate", "tiny.csv", "--goodput", "ttft:200", "ttft_p99:2s"), "it takes no percentile"),
    (("replay", "tiny.csv", "--goodput", "tpot:50ms/token"), "tpot is in s or ms, not 'ms/token'"),
    (("simulate", "tiny.csv", "--percentile-metrics", "ttft,foo"), "--percentile-metrics 'ttft,foo'"),
    (("simulate", "tiny.csv", "--metric-percentiles", "0,99"), "each percentile must be in (0, 100]"),
    (("replay", "tiny.csv", "--kv-memory-gb", "inf"), "--kv-memory-gb must be a finite number, got inf"),
    (("replay", "tiny.csv", "--time-scale", "nan"), "--time-scale must be a finite number"),
    (("replay", "tiny.csv", "--max-model-len", "0"), "max_model_len must be > 0"),
    (("replay", "tiny.csv", "--kv-memory-gb", "1e6"), "does not fit in this machine's memory"),
    (("bench", "engine", "--num-prompts", "0"), "--limit/--num-prompts must be >= 1, got 0"),
    (("bench", "engine", "--device", "tpu", "--limit", "2"), "unknown device 'tpu'"),
    # bench simulate reads the trace before it starts a benchmark process.
    (("bench", "simulate", "--trace", "nonexist.csv"), "nonexist.csv: no such file"),
    (("bench", "simulate", "--trace", "bool.jsonl"), "boolean value True is not a number"),
    (("bench", "simulate", "--trace", "tiny.csv", "--num", "5"), "tiny.csv has 3 requests, fewer than the 5"),
    (("replay", "tiny.csv", "--seed", "-1"), "--seed must be a whole number >= 0, got -1"),
    (("simulate", "tiny.csv", "--seed", "-1", "--rate", "2"), "--seed must be a whole number >= 0, got -1"),
    (("bench", "calibration", "--parts", "A,D"), "unknown part 'D'; choose from A, B, A-x2, C"),
    (("bench", "calibration", "--device", "tpu"), "--device must be one of cpu, cuda, got 'tpu'"),
    (("simulate", "--bogus"), "No such option: --bogus"),
]


@pytest.mark.parametrize("args, message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line_exit_2(files, args, message):
    line = one_line_error(pagelab(*args, cwd=files))
    assert message in line
    assert "❌" not in line  # :x: is not turned into an emoji


@pytest.mark.parametrize("at, message", [("nan", "--at must be a finite time >= 0 s (got nan)"),
                                         ("1e12", "--at 1e+12 s is after the end of the run(s)")])
def test_plot_at_outside_the_run(files, at, message):
    assert pagelab("simulate", "tiny.csv", "-a", "paged", "--kv-memory-gb", "1", "--out", "r",
                   cwd=files).returncode == 0
    assert message in one_line_error(pagelab("plot", "r", "--at", at, cwd=files))
    assert not (files / "r" / "figures").exists()

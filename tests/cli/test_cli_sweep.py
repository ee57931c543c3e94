"""`pagelab sweep` as a user runs it (subprocess): bad input exits 2 with one line and writes nothing;
an SLO no point meets is reported with exit 0; a small sweep writes its folder and figures."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from traces import SyntheticConfig, generate_trace, save_trace

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--model", "opt-13b", "--gpu", "a100-40gb", "--capacity-tokens", "8192", "--max-model-len", "2048"]


def pagelab(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `pagelab ARGS` in a fresh interpreter (stderr not a terminal: one log line per point)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", "from cli import main; main()", *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "small.parquet"
    save_trace(generate_trace(SyntheticConfig(num_requests=120, lengths="sharegpt", rate=1.0, seed=0)), path)
    return path


def closed_port() -> int:
    """A local port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, words", [
    (["--rate", "4:1:0.5"], "empty or inverted"),
    (["--rate", "1:4:0"], "STEP must be > 0"),
    (["--rate", "1:2", "--axis", "colour=red"], "unknown axis 'colour'"),
    (["--rate", "1:2", "-a", "paged,bogus"], "unknown allocator 'bogus'"),
    (["--rate", "1:2", "--block-size", "16,"], "empty value"),
    (["--rate", "1:2", "--slo", "speed=3s"], "--slo 'speed=3s': unknown metric 'speed'; accepted: "),
    (["--rate", "1:2", "--slo", "ttft_p99=0.2"], "'0.2' has no unit: write ttft_p99:0.2s or ttft_p99:0.2ms"),
    (["--rate", "1:2", "--slo", "norm_latency:0.2"], "write norm_latency:0.2s/token or"),
    (["--rate", "1:2", "--slo", "tpot:50ms"], "tpot needs a percentile"),
    (["--rate", "1:2", "--model", "gpt-9"], "gpt-9"),
    (["--rate", "1:2", "--jobs", "0"], "--jobs must be >= 1"),
    (["--rate", "1:2", "--tolerance", "0"], "--tolerance"),
    (["--rate", "1:2", "--address", "127.0.0.1:6379"], "--address needs --executor ray"),
    # Combinations only the scheduler or the pool would refuse are checked before the folder is made.
    (["--rate", "1:2", "--max-num-batched-tokens", "1"], "max_num_batched_tokens (1) must be >= max_num"),
    (["--rate", "1:2", "--axis", "enable_chunked_prefill=false", "--max-num-batched-tokens", "512"],
     "max_num_batched_tokens (512) must be >= max_model_len (2048) unless chunked prefill"),
    (["--rate", "1:2", "--capacity-tokens", "10"], "a KV pool of 10 slots holds no block of 16 tokens"),
    (["--rate", "1:2", "--capacity-tokens", "20000", "--kv-memory-gb", "1,2"],
     "--capacity-tokens sizes the pool, so the --kv-memory-gb values would all run the same pool"),
    (["--rate", "1:2", "-a", "paged", "--axis", "placement=buddy,first-fit"],
     "--axis placement=... only applies to contiguous allocators"),
    (["--rate", "1:2", "--seed", "-1"], "--seed must be a whole number >= 0, got -1"),
    (["--rate", "1:2", "--axis", "seed=-1,2"], "seed=-1: seed must be >= 0, got -1"),
    (["--rate", "1:2", "--axis", "max_num_seqs=0"], "max_num_seqs must be > 0, got 0"),
    (["--rate", "1:2", "--axis", "max_num_seqs=2", "--max-num-seqs", "4"],
     "--max-num-seqs and --axis max_num_seqs=... both set max_num_seqs"),
    (["--rate", "1e-12,2e-12"], "rates are kept to 9 decimals, so 1e-12 requests/s would be 0"),
    (["--rate", "1e-8:2"], "past 1e+09 s"),
    (["--rate", "1:2", "-a", "paged", "--placement", "first-fit"], "--placement only applies to contiguous"),
    (["--rate", "1:2", "--no-search", "--tolerance", "0.5"],
     "--tolerance and --search-runs shape the max-rate search: they do not apply with --no-search"),
    (["--rate", "1:2", "--axis", "kv_cache_dtype=fp8", "--axis", "kv_cache_dtype=auto"],
     "--axis kv_cache_dtype given twice: list its values in one, --axis kv_cache_dtype=A,B"),
    # A value list names the option it was typed in; --axis values name their axis.
    (["--rate", "a,b"], "error: --rate 'a,b': 'a' is not a number"),
    (["--rate", "1:2", "--block-size", "16,x"], "error: --block-size: 'x' is not an integer"),
    (["--rate", "1:2", "--axis", "max_num_seqs=x"], "error: axis max_num_seqs: 'x' is not an integer"),
    # The KV cache dtypes simulate --kv-cache-dtype takes, and no other (float32 is the CPU replays').
    (["--rate", "1:2", "--axis", "kv_cache_dtype=auto,float32"], "'float32' is not a KV cache dtype; "
     "choose from auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, trace_file, args, words):
    out = tmp_path / "sweep"
    result = pagelab("sweep", trace_file, *SMALL, *args, "--out", out)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_a_ray_address_that_does_not_answer_exits_2_and_writes_nothing(tmp_path, trace_file):
    pytest.importorskip("ray")
    out = tmp_path / "sweep"
    address = f"127.0.0.1:{closed_port()}"
    result = pagelab("sweep", trace_file, *SMALL, "--rate", "1:2", "--executor", "ray", "--address", address,
                     "--out", out)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"Ray cluster at {address} does not answer" in lines[0]
    assert not out.exists()


def test_an_slo_no_point_meets_is_reported_with_exit_0(tmp_path, trace_file):
    out = tmp_path / "sweep"
    result = pagelab("sweep", trace_file, *SMALL, "--rate", "0.5,1", "-a", "paged",
                     "--slo", "ttft_p99=0.1ms", "--jobs", "1", "--out", out)
    assert result.returncode == 0, result.stderr
    assert "no point meets the SLO ttft_p99 <= 0.1 ms" in result.stderr
    assert "Maximum sustainable request rate under ttft_p99 <= 0.1 ms" in result.stdout
    points = [ln for ln in result.stderr.splitlines() if ln.startswith("point ")]
    assert len(points) == 2 and all(" ms (> 0.1: misses the SLO); simulated in " in ln for ln in points)
    saved = json.loads((out / "summary.json").read_text())["slo"]
    assert saved == {"metric": "ttft_p99", "bound": 0.0001, "text": "ttft_p99 <= 0.1 ms",
                     "spec": "ttft_p99:0.1ms"}
    table = pd.read_parquet(out / "max_rates.parquet")
    assert list(table["status"]) == ["below_range"] and table["max_rate"].isna().all()


def test_a_request_too_long_for_every_rate_leaves_the_slo_to_the_others(tmp_path, trace_file):
    # One request longer than max_model_len is rejected at every rate: the others still find a max rate.
    trace = pd.read_parquet(trace_file)
    long = trace.iloc[[-1]].assign(request_id=len(trace), prompt_len=3000)
    save_trace(pd.concat([trace, long], ignore_index=True), tmp_path / "one-long.parquet")
    out = tmp_path / "sweep"
    result = pagelab("sweep", tmp_path / "one-long.parquet", *SMALL, "--rate", "0.2,0.4", "--no-search",
                     "-a", "paged", "--out", out)
    assert result.returncode == 0, result.stderr
    table = pd.read_parquet(out / "sweep.parquet")
    assert table["met_slo"].any() and (table["num_finished"] == len(trace)).all()
    point_lines = [ln for ln in result.stderr.splitlines() if ln.startswith("point ")]
    assert len(point_lines) == 2 and all("rejected at every rate: 1 " in ln for ln in point_lines)


def test_small_sweep_writes_tables_logs_each_point_and_resumes(tmp_path, trace_file):
    out = tmp_path / "sweep"
    args = ("sweep", trace_file, *SMALL, "--rate", "0.2:2.6:0.8", "-a", "paged,contiguous-max",
            "--jobs", "2", "--out", out, "--plot")
    first = pagelab(*args)
    assert first.returncode == 0, first.stderr
    table = pd.read_parquet(out / "sweep.parquet")
    point_lines = [ln for ln in first.stderr.splitlines() if ln.startswith("point ")]
    assert len(point_lines) == len(table) and all(" req/s: norm_latency " in ln for ln in point_lines)
    # The total is stated as the bound it is: 2 configurations x (4 grid rates + at most 10 search points).
    assert "at most 28 points" in first.stderr
    assert [int(ln.split()[1]) for ln in point_lines] == list(range(1, len(table) + 1))
    assert all(ln.split()[2:5] == ["of", "at", "most"] and int(ln.split()[5].rstrip(":")) == 28
               for ln in point_lines)
    assert all(ln.endswith(" s") and "simulated in" in ln for ln in point_lines)  # wall time, said so
    assert "Maximum sustainable request rate" in first.stdout
    assert sorted(p.name for p in (out / "figures").iterdir()) == ["sweep_fig12.png", "sweep_max_rates.png"]
    again = pagelab(*args, "--json")
    assert again.returncode == 0
    assert f"(0 points run, {len(table)} reused)" in again.stderr
    assert sum(ln.endswith("reused from an earlier run") for ln in again.stderr.splitlines()) == len(table)
    result = json.loads(again.stdout)  # --json: the max-rate results alone on stdout
    assert result["slo"] == "norm_latency:0.2s/token"
    max_rates = pd.read_parquet(out / "max_rates.parquet")
    assert [c["allocator"] for c in result["configurations"]] == list(max_rates["allocator"])
    assert [c["max_rate"] for c in result["configurations"]] == pytest.approx(list(max_rates["max_rate"]))
    assert json.loads((out / "summary.json").read_text())["points"]["reused"] == len(table)


def test_a_one_value_axis_applies_like_its_option(tmp_path, trace_file):
    out = tmp_path / "sweep"
    result = pagelab("sweep", trace_file, *SMALL, "--rate", "1", "--no-search", "-a", "paged", "--jobs", "1",
                     "--axis", "max_num_seqs=2", "--axis", "preemption_mode=swap", "--out", out)
    assert result.returncode == 0, result.stderr
    base = json.loads((out / "summary.json").read_text())["base"]
    assert base["max_num_seqs"] == 2 and base["preemption_mode"] == "swap"


def test_a_folder_that_is_not_a_sweeps_is_left_as_it_was(tmp_path, trace_file):
    run = tmp_path / "run"
    assert pagelab("simulate", trace_file, "-a", "paged", "--limit", "20", "--out", run).returncode == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    result = pagelab("sweep", trace_file, *SMALL, "--rate", "1,2", "--out", run)
    assert result.returncode == 2 and "is a folder that is not a sweep's (it holds paged" in result.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_trace_warnings_are_one_line_each(tmp_path, trace_file):
    extra = tmp_path / "extra.csv"
    pd.read_parquet(trace_file).assign(colour="red").to_csv(extra, index=False)
    result = pagelab("sweep", extra, *SMALL, "--rate", "1,2", "--out", tmp_path / "sweep")
    assert result.returncode == 0, result.stderr
    assert "warning: " in result.stderr and "colour" in result.stderr and "TraceWarning" not in result.stderr

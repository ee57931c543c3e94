"""Bad input: each case exits 2 with a one-line message naming the problem."""
from __future__ import annotations

import json
import shutil
import socket

import pandas as pd
import pytest
import typer
from clirun import one_line_error, pagelab

from cli.common import user_errors
from pagelab.atomic import atomic_write_bytes

TINY = "arrival_s,prompt_len,output_len\n0,10,5\n1,20,6\n2,30,7\n"


@pytest.fixture
def files(tmp_path):
    """Small malformed traces, written in the test's folder."""
    (tmp_path / "tiny.csv").write_text(TINY)
    (tmp_path / "late.csv").write_text("arrival_s,prompt_len,output_len\n0,10,5\n1e12,20,3\n")
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
    (("trace", "gen", "--multi-turn", "--think-dist", "foo", "--out", "g.csv"),
     "--think-dist: must be one of exponential, lognormal, fixed (got 'foo')"),
    (("trace", "info", "tiny.csv", "--plot", "tiny.csv/x.png"),
     "--plot tiny.csv/x.png: cannot create a file under"),
    (("trace", "convert", "tiny.csv", "tiny.csv/x.csv"), "tiny.csv/x.csv: cannot create a file under"),
    (("trace", "convert", "tiny.csv", "."), ".: expected the path of a file, got '.'"),
    (("trace", "info", "tiny.csv", "--format", "azure"),
     "tiny.csv: the header has pagelab's arrival_s, prompt_len, output_len, not this format's TIMESTAMP"),
    (("simulate", "tiny.csv", "--kv-offloading-policy", "lfu"),
     "--kv-offloading-policy applies to a KV tier: give --kv-offloading-size or --kv-offloading-disk-size"),
    (("simulate", "tiny.csv", "--kv-offloading-store", "eager", "--disk-offload-bandwidth-gbps", "3"),
     "--kv-offloading-store, --disk-offload-bandwidth-gbps apply to a KV tier"),
    (("replay", "tiny.csv", "--kv-offloading-block-size", "32"), "--kv-offloading-block-size applies to a KV "
     "tier"),
    (("simulate", "tiny.csv", "--kv-offloading-size", "1", "--kv-offloading-policy", "foo"),
     "--kv-offloading-policy must be one of lru"),
    (("trace", "gen", "--num", "100000000000", "--out", "g.csv"), "at most 100,000,000"),
    (("trace", "gen", "--burstiness", "0", "--out", "g.csv"), "--burstiness must be a finite number > 0"),
    (("simulate", "tiny.csv", "--kv-memory-gb", "inf"), "--kv-memory-gb must be a finite number, got inf"),
    (("simulate", "tiny.csv", "--kv-memory-gb", "nan"), "--kv-memory-gb must be a finite number, got nan"),
    (("simulate", "tiny.csv", "-a", "paged", "--kv-memory-gb", "1e6"),
     "this trace can never use more than"),
    (("simulate", "tiny.csv", "--max-model-len", "0"), "error: --max-model-len must be > 0, got 0"),
    # The configuration's checks speak of its fields; the user reads the options typed.
    (("simulate", "tiny.csv", "--max-num-batched-tokens", "10"),
     "--max-num-batched-tokens (10) must be >= --max-num-seqs (256)"),
    (("simulate", "tiny.csv", "-a", "paged", "--placement", "first-fit"),
     "--placement only applies to contiguous allocators"),
    (("simulate", "tiny.csv", "-a", "paged,nope"), "unknown allocator 'nope'"),
    (("simulate", "tiny.csv", "--rate", "nan"), "--request-rate/--rate must be > 0"),
    (("simulate", "late.csv"), "late.csv line 3, field 'arrival_s': arrival time 1e+12 s is past 1e+09 s"),
    (("simulate", "tiny.csv", "--rate", "1e-300"), "rate 1e-300 requests/s spreads 3 requests over 2e+300 s"),
    (("trace", "gen", "--num", "3", "--rate", "1e-12", "--out", "g.csv"),
     "--request-rate 1e-12: 3 requests at this rate arrive over about 3e+12 s, past the 1e+09 s"),
    (("trace", "gen", "--lengths", "bogus", "--out", "g.csv"), "--lengths bogus: expected fixed, uniform, "
     "sharegpt, alpaca, or a trace to resample lengths from; bogus: no such file"),
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
    (("replay", "tiny.csv", "--max-model-len", "0"), "--max-model-len must be > 0"),
    (("replay", "tiny.csv", "--device", "cpu", "--backend", "triton", "--max-model-len", "64"),
     "the triton attention backend needs a CUDA device (here: cpu)"),
    (("replay", "tiny.csv", "--kv-memory-gb", "1e6"), "does not fit in this machine's memory"),
    (("bench", "engine", "--num-prompts", "0"), "--limit/--num-prompts must be >= 1, got 0"),
    (("bench", "engine", "--device", "tpu", "--limit", "2"), "unknown device 'tpu'"),
    (("bench", "engine", "--max-model-len", "0"), "--max-model-len must be >= 1, got 0"),
    (("bench", "engine", "--host", "--max-model-len", "-5"), "--max-model-len must be >= 1, got -5"),
    # bench engine: an option of the other measurement is refused, not ignored; --host's KV cache must fit.
    (("bench", "engine", "--allocator", "foo"), "--allocator does not apply without --host"),
    (("bench", "engine", "--batch", "8", "--steps", "3"), "--batch, --steps do not apply without --host"),
    (("bench", "engine", "--host", "--limit", "3", "--model", "tiny"), "--limit, --model do not apply with "
     "--host"),
    (("bench", "engine", "--host", "--batch", "100000"), "--batch 100,000 at --max-model-len 4,096 needs a "
     "1562.5 GiB KV cache, more than half of this machine's"),
    (("bench", "simulate", "--repeat", "0"), "--repeat must be >= 1, got 0"),
    (("bench", "simulate", "--trace", "synthetic", "--num", "5", "--rate", "0"), "--rate must be a finite "
     "number > 0 requests/s, got 0.0"),
    (("bench", "core", "--chunk", "0"), "--chunk must be >= 1, got 0"),
    # An option the chosen measurement would not read, or a workload that times nothing, is refused.
    (("bench", "simulate", "--num", "300", "--rate", "5", "--repeat", "1", "--events", "off"),
     "--rate applies to --trace synthetic only (the trace 'azure-conv' keeps its own arrival times)"),
    (("bench", "core", "--num-tokens", "10", "--num-seqs", "256"),
     "--num-tokens 10 is fewer than --num-seqs 256"),
    (("bench", "attention", "--min-time", "-1"), "--min-time must be a finite number of seconds >= 0"),
    # bench simulate reads the trace before it starts a benchmark process.
    (("bench", "simulate", "--trace", "nonexist.csv"), "nonexist.csv: no such file"),
    (("bench", "simulate", "--trace", "bool.jsonl"), "boolean value True is not a number"),
    (("bench", "simulate", "--trace", "tiny.csv", "--num", "5"), "tiny.csv has 3 requests, fewer than the 5"),
    (("replay", "tiny.csv", "--seed", "-1"), "--seed must be a whole number >= 0, got -1"),
    (("simulate", "tiny.csv", "--seed", "-1", "--rate", "2"), "--seed must be a whole number >= 0, got -1"),
    (("bench", "calibration", "--parts", "A,D"), "unknown part 'D'; choose from A, B, A-x2, C"),
    (("bench", "calibration", "--device", "tpu"), "--device must be one of cpu, cuda, got 'tpu'"),
    (("simulate", "--bogus"), "No such option: --bogus"),
    # Where a result goes is checked before the run, not after it.
    (("simulate", "tiny.csv", "--save-result", "--result-dir", "tiny.csv"),
     "--result-dir tiny.csv is a file, not a folder"),
    (("simulate", "tiny.csv", "--save-result", "--result-filename", ""),
     "expected the name of a file, got ''"),
    (("simulate", "tiny.csv", "-a", "paged,contiguous-max", "--result-filename", "sub/"),
     "expected the name of a file, got 'sub/'"),
    (("bench", "core", "--save-result", "--result-dir", "tiny.csv"), "--result-dir tiny.csv is a file"),
    (("calibrate", "tiny.csv", "--out", ""), "expected the path of a file"),
    (("trace", "reuse", "tiny.csv", "--plot", ""), "--plot .: expected the path of a file"),
    (("bench", "simulate", "--trace", "synthetic", "--num", "99999999999"), "at most 100,000,000"),
    (("bench", "calibration", "--parts", "A", "--profile", "nope", "--out", "cal"),
     "latency profile 'nope' is neither a file nor a bundled profile"),
    (("bench", "calibration", "--parts", "", "--out", "cal"), "give at least one held-out run"),
    (("simulate", "tiny.csv", "--overwrite"), "--overwrite needs --out (a run folder)"),
    (("simulate", "tiny.csv", "--table-format", "csv"), "--table-format needs --out (a run folder)"),
    (("simulate", "tiny.csv", "--profile", "cpu-tiny", "--latency", "fit.json"),
     "give --profile or --latency PROFILE.json, not both"),
    # Pools past what a run can keep are refused by name, not left to a MemoryError.
    (("simulate", "tiny.csv", "--kv-offloading-size", "inf"),
     "--kv-offloading-size must be a finite number >= 0 GiB, got inf"),
    (("simulate", "tiny.csv", "-a", "paged", "--kv-offloading-size", "1e9"),
     "blocks is more than the 16,777,216 a run keeps"),
]


@pytest.mark.parametrize("args, message", [
    (("--kv-memory-gb", "1e9"), "configuration paged: the KV pool holds 8,192,000,000,000 token slots"),
    (("--model", "gpt-oss-20b", "--kv-memory-gb", "5"), "configuration paged: gpt-oss-20b: the roofline step "
     "time reads every weight"),
])
def test_a_sweep_refuses_an_unrunnable_configuration_before_writing(files, args, message):
    line = one_line_error(pagelab("sweep", "tiny.csv", "--rate", "2,4", "-a", "paged", "-j", "1", *args,
                                  "--out", "sw", cwd=files))
    assert message in line
    assert not (files / "sw").exists()


@pytest.mark.parametrize("args, message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line_exit_2(files, args, message):
    line = one_line_error(pagelab(*args, cwd=files))
    assert message in line
    assert "❌" not in line  # :x: is not turned into an emoji


@pytest.mark.parametrize("args, message", [
    (("--model", "gemma-3-27b", "--gpu", "h100-80gb", "--max-num-batched-tokens", "8192"),
     "--max-num-batched-tokens (8192) must be >= --max-model-len (131072) unless chunked prefill"),
    (("--model", "gpt-oss-20b", "--kv-memory-gb", "10"), "parameter count (num_params) is unknown"),
    (("--profile", "cpu-tiny", "--model", "llama-3-8b"), "was fitted for model 'tiny', not 'llama-3-8b'")])
def test_a_run_simulate_would_refuse_prints_no_capacity_header_first(files, args, message):
    result = pagelab("simulate", "tiny.csv", "-a", "paged", *args, cwd=files)
    assert message in one_line_error(result)
    assert result.stdout == ""


@pytest.mark.parametrize("at, message", [("nan", "--at must be a finite time >= 0 s (got nan)"),
                                         ("1e12", "--at 1e+12 s is after the end of the run(s)")])
def test_plot_at_outside_the_run(files, at, message):
    assert pagelab("simulate", "tiny.csv", "-a", "paged", "--kv-memory-gb", "1", "--out", "r",
                   cwd=files).returncode == 0
    assert message in one_line_error(pagelab("plot", "r", "--at", at, cwd=files))
    assert not (files / "r" / "figures").exists()


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    """A small run folder `r`, a file and a folder in the way of outputs, and a copy `cut` of the run with its
    request table cut short."""
    place = tmp_path_factory.mktemp("outs")
    (place / "tiny.csv").write_text(TINY)
    assert pagelab("simulate", "tiny.csv", "-a", "paged", "--kv-memory-gb", "1", "--out", "r",
                   cwd=place).returncode == 0
    (place / "afile").write_text("x")
    (place / "adir").mkdir()
    shutil.copytree(place / "r", place / "cut")
    requests = place / "cut" / "paged" / "requests.parquet"
    requests.write_bytes(requests.read_bytes()[:1000])
    return place


def _tree(place) -> list[str]:
    return sorted(str(p.relative_to(place)) for p in place.rglob("*"))


OUT_CASES = [
    (("plot", "r", "-o", "afile"), "--out afile is a file, not a folder"),
    (("compare", "r", "r", "--out", "afile"), "--out afile is a file, not a folder"),
    (("view", "r", "--out", "adir"), "--out adir is a folder, not a file"),
    (("export", "r", "--out", "adir"), "--out adir is a folder, not a file"),
    (("plot", "r", "-o", "/proc/pagelab-figs"), "--out /proc/pagelab-figs: cannot create files in /proc"),
    (("compare", "r", "r", "--out", "/proc/pagelab-c"), "--out /proc/pagelab-c: cannot create files in"),
    (("view", "r", "--out", "/proc/v.html"), "--out /proc/v.html: cannot create files in /proc"),
    (("export", "r", "--out", "/proc/t.json"), "--out /proc/t.json: cannot create files in /proc"),
    (("view", "r", "--serve", "--port", "99999"), "--port 99999: expected a port from 0 to 65535"),
    (("view", "r", "--serve", "--port", "-1"), "--port -1: expected a port from 0 to 65535"),
    (("view", "r", "--port", "8080"), "--port 8080 is where --serve listens: give --serve too"),
    (("plot", "afile"), "afile is a file, not a run folder"),
    (("trace", "gen", "--num", "5", "--out", "adir"), "--out adir is a folder, not a file"),
    (("trace", "gen", "--num", "5", "--out", "afile/x.csv"), "--out afile/x.csv: cannot create a file under"),
    (("compare", "r", "r", "--format", "gif", "--out", "c"), "--format gif: format 'gif' is not one of"),
    (("compare", "r", "r", "--format", "svg"), "--format svg is the format of the figures --out writes: give "
     "--out too"),
    (("plot", "r", "--only", "breakdown", "--at", "1"), "--at shapes the block_snapshot figure, which --only "
     "leaves out"),
    (("plot", "r", "--only", "latency_cdf", "--window", "1:2"), "--window shapes the block_map figure"),
    (("export", "cut"), "paged/requests.parquet: cannot read table (Parquet magic bytes not found"),
    # A run's own files are not a destination: writing one would corrupt the run.
    (("export", "r", "--out", "r/paged/config.json"), "--out r/paged/config.json is one of the files of the "
     "pagelab run in"),
    (("export", "r", "--out", "r/run.json"), "--out r/run.json is one of the files of the pagelab run"),
    (("calibrate", "r", "--out", "r/summary.json"), "--out r/summary.json is one of the files of the"),
    (("calibrate", "r", "--out", "adir/../r/paged/requests.parquet"), "is one of the files of the pagelab"),
    (("view", "r", "--out", "r/paged/summary.json"), "is one of the files of the pagelab run"),
    (("bench", "core", "--result-dir", "r", "--result-filename", "summary.json"),
     "--result-filename summary.json is one of the files of the pagelab run"),
]


@pytest.mark.parametrize("args, message", OUT_CASES, ids=[" ".join(a) for a, _ in OUT_CASES])
def test_an_output_that_cannot_be_written_is_refused_first(outs, args, message):
    before = _tree(outs)
    assert message in one_line_error(pagelab(*args, cwd=outs))
    assert _tree(outs) == before  # nothing written, no temporary file left


def test_one_allocators_page_and_timeline_are_written_in_its_folder(outs):
    # What view and export write by default beside the data of an allocator folder given alone.
    for args, name in ((("view", "r/paged"), "view.html"), (("export", "r/paged"), "trace.json")):
        result = pagelab(*args, cwd=outs)
        assert result.returncode == 0, result.stderr
        (outs / "r" / "paged" / name).unlink()


def test_view_on_a_busy_port_is_refused_before_the_page(outs):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_line_error(pagelab("view", "r", "--serve", "--port", port, cwd=outs))
    assert f"--port {port}: cannot listen on 127.0.0.1:{port} (Address already in use)" in line
    assert not (outs / "r" / "view.html").exists()


def test_a_path_refused_while_writing_is_one_line(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    with pytest.raises(typer.Exit) as stop:
        user_errors(lambda: atomic_write_bytes(tmp_path / "d", b"x"))()  # a rename over a folder
    assert stop.value.exit_code == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'd'}: Is a directory"
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_a_decode_workload_of_fewer_tokens_than_sequences_is_refused():
    from bench.core import DecodeWorkload

    with pytest.raises(ValueError, match=r"num_tokens \(10\) must be >= num_seqs \(256\)"):
        DecodeWorkload(num_seqs=256, num_tokens=10)


def test_beside_a_runs_data_an_export_may_still_go(outs, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(outs / "r", run)
    assert pagelab("export", "r", "--out", "r/trace.json", cwd=tmp_path).returncode == 0
    assert pagelab("export", "r", "--out", "r/figures/t.json", cwd=tmp_path).returncode == 0

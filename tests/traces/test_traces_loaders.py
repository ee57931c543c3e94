"""Loaders: bundled traces, every public format on small hand-written files, format detection."""
from __future__ import annotations

import hashlib
import re

import numpy as np
import pandas as pd
import pytest

import traces
from traces import BUNDLED, detect_format, load_length_pairs, load_trace
from traces.schema import CANONICAL_COLUMNS

DATA = BUNDLED["azure-conv"].parent


def write(tmp_path, name: str, text: str):
    """Write a small trace file and return its path."""
    path = tmp_path / name
    path.write_text(text)
    return path


# --- bundled traces -----------------------------------------------------------------------------------------
# Expected figures come from ../shared/traces/SOURCES.md (computed there with Python's csv/json modules).

@pytest.mark.parametrize(("name", "rows", "prompt_mean", "output_mean", "duration"), [
    ("azure-conv", 19_366, 1154.7, 211.1, 3502),
    ("azure-code", 8_819, 2047.8, 27.9, 3436),
    ("mooncake-conv", 12_031, 12_035, 343, 3537),
])
def test_bundled_traces_load_with_published_figures(name, rows, prompt_mean, output_mean, duration):
    warnings: list[str] = []
    df = load_trace(name, warnings=warnings)
    assert warnings == []
    assert len(df) == rows
    assert list(df.columns[:6]) == list(CANONICAL_COLUMNS)
    assert df["prompt_len"].mean() == pytest.approx(prompt_mean, abs=0.5)
    assert df["output_len"].mean() == pytest.approx(output_mean, abs=0.5)
    assert df["arrival_s"].iloc[0] == 0.0
    assert df["arrival_s"].is_monotonic_increasing
    assert df["arrival_s"].iloc[-1] == pytest.approx(duration, abs=1.0)
    assert (df.index == np.arange(rows)).all()
    assert df["request_id"].is_unique


def test_azure_timestamps_become_seconds_since_first():
    df = load_trace("azure-conv")
    # Vidur's splitwise_conv.csv holds the same requests with relative times: its first rows are these.
    assert df["arrival_s"].iloc[:3].tolist() == pytest.approx([0.0, 4.314579, 4.541877], abs=1e-9)
    assert df["prompt_len"].iloc[:3].tolist() == [374, 396, 879]


def test_mooncake_bundled_prefix_blocks_match_input_length():
    df = load_trace("mooncake-conv")
    assert (df["prefix_block_size"] == 512).all()
    counts = df["prefix_blocks"].map(len).to_numpy()
    assert (counts == -(-df["prompt_len"].to_numpy() // 512)).all()
    total = counts.sum()
    unique = len({k for keys in df["prefix_blocks"] for k in keys})
    assert (total, unique) == (288_500, 182_790)


def test_bundled_files_match_recorded_sha256():
    recorded = dict(re.findall(r"^([0-9a-f]{64})\s+(\S+)$", (DATA / "SOURCES.md").read_text(), re.M))
    assert set(recorded.values()) == {p.name for p in BUNDLED.values()}
    for digest, name in recorded.items():
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, name


def test_default_trace_path_is_the_azure_conversation_trace():
    assert traces.default_trace_path() == BUNDLED["azure-conv"]
    assert traces.default_trace_path().exists()


def test_load_bundled_azure_conv(benchmark):
    """Speed lives here (run with --benchmark-enable); by default this runs once as a plain test."""
    df = benchmark(load_trace, "azure-conv")
    assert len(df) == 19_366


# --- each public format on a small file ---------------------------------------------------------------

AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 18:15:46.6805900,374,44\n"
         "2023-11-16 18:15:50.9951690,396,109\n"
         "2023-11-16 18:15:51.2224670,879,55")  # no trailing newline, like the real files
VIDUR = "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,374,44\n4.314579,396,109\n4.541877,879,55\n"


def test_azure_and_vidur_versions_of_the_same_requests_agree(tmp_path):
    a = load_trace(write(tmp_path, "a.csv", AZURE))
    v = load_trace(write(tmp_path, "v.csv", VIDUR))
    pd.testing.assert_frame_equal(a, v, check_exact=False, atol=1e-6)
    assert a["n"].tolist() == [1, 1, 1] and a["beam_width"].tolist() == [1, 1, 1]


def test_vidur_relative_times_need_not_start_at_zero(tmp_path):
    df = load_trace(write(tmp_path, "v.csv", VIDUR.replace("0.0,374", "2.0,374")))
    assert df["arrival_s"].iloc[0] == 0.0  # shifted silently: Vidur times are offsets, not a contract


def test_mooncake_jsonl(tmp_path):
    path = write(tmp_path, "m.jsonl",
                 '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}\n'
                 '\n'
                 '{"timestamp": 1500, "input_length": 100, "output_length": 7, "hash_ids": [0]}\n')
    df = load_trace(path)
    assert df["arrival_s"].tolist() == [0.0, 1.5]
    assert df["prefix_blocks"].tolist() == [[0, 1], [0]]
    assert df["prefix_block_size"].tolist() == [512, 512]
    assert detect_format(path) == "mooncake"


@pytest.mark.parametrize("header", [
    "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
    "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type",
])
def test_burstgpt_drops_failed_requests_and_says_so(tmp_path, header):
    session = "," in header.split("Model")[0][len("Timestamp,"):]
    pre = "s1,0.5," if session else ""
    rows = [f"5,{pre}ChatGPT,100,20,120,Conversation log",
            f"7,{pre}GPT-4,50,0,50,Conversation log",
            f"9,{pre}ChatGPT,30,10,40,API log"]
    warnings: list[str] = []
    df = load_trace(write(tmp_path, "b.csv", "\n".join([header, *rows]) + "\n"), warnings=warnings)
    assert df["prompt_len"].tolist() == [100, 30]
    assert df["arrival_s"].tolist() == [0.0, 4.0]
    assert any("dropped 1 failed request" in w for w in warnings)


def test_pagelab_csv_with_space_and_json_prefix_blocks(tmp_path):
    path = write(tmp_path, "p.csv",
                 "request_id,arrival_s,prompt_len,output_len,n,beam_width,prefix_blocks,prefix_block_size\n"
                 '7,0.0,40,3,2,1,"[1, 2]",16\n'
                 "9,0.25,40,4,1,3,1 5,16\n"
                 "11,0.5,10,4,1,1,,\n")
    df = load_trace(path)
    assert df["request_id"].tolist() == [7, 9, 11]
    assert df["prefix_blocks"].tolist() == [[1, 2], [1, 5], []]
    assert df["prefix_block_size"].tolist() == [16, 16, 16]
    assert df["n"].tolist() == [2, 1, 1] and df["beam_width"].tolist() == [1, 3, 1]


def test_pagelab_csv_minimal_columns_get_defaults(tmp_path):
    df = load_trace(write(tmp_path, "p.csv", "arrival_s,prompt_len,output_len\n0,5,6\n1,7,8\n"))
    assert df["request_id"].tolist() == [0, 1]
    assert df["n"].tolist() == [1, 1]
    assert "prefix_blocks" not in df.columns


def test_pagelab_jsonl(tmp_path):
    path = write(tmp_path, "p.jsonl",
                 '{"arrival_s": 0.0, "prompt_len": 5, "output_len": 2, "prefix_blocks": [3], '
                 '"prefix_block_size": 4}\n'
                 '{"arrival_s": 0.5, "prompt_len": 9, "output_len": 1, "n": 4}\n')
    df = load_trace(path)
    assert df["prefix_blocks"].tolist() == [[3], []]
    assert df["n"].tolist() == [1, 4]


def test_unknown_columns_are_dropped_with_a_warning(tmp_path):
    warnings: list[str] = []
    df = load_trace(write(tmp_path, "p.csv", "arrival_s,prompt_len,output_len,tenant\n0,5,6,a\n"),
                    warnings=warnings)
    assert "tenant" not in df.columns
    assert any("tenant" in w for w in warnings)


@pytest.mark.parametrize(("name", "text", "fmt"), [
    ("a.csv", AZURE, "azure"),
    ("v.txt", VIDUR, "vidur"),
    ("b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,m,2,3,5,x\n",
     "burstgpt"),
    ("p.csv", "arrival_s,prompt_len,output_len\n0,1,1\n", "csv"),
    ("p.jsonl", '{"arrival_s": 0, "prompt_len": 1, "output_len": 1}\n', "jsonl"),
    ("m.json", '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n', "mooncake"),
    ("j.csv", '{"arrival_s": 0, "prompt_len": 1, "output_len": 1}\n', "jsonl"),  # content beats suffix
])
def test_format_detection(tmp_path, name, text, fmt):
    assert detect_format(write(tmp_path, name, text)) == fmt


def test_parquet_detected_by_magic_bytes(tmp_path):
    src = load_trace(write(tmp_path, "p.csv", "arrival_s,prompt_len,output_len\n0,1,1\n"))
    out = traces.save_trace(src, tmp_path / "x.parquet")
    renamed = out.rename(tmp_path / "x.bin")
    assert detect_format(renamed) == "parquet"
    pd.testing.assert_frame_equal(load_trace(renamed), src)


def test_explicit_format_overrides_detection(tmp_path):
    path = write(tmp_path, "v.csv", VIDUR)
    with pytest.raises(traces.TraceError, match="ContextTokens|TIMESTAMP"):
        load_trace(path, format="azure")


def test_length_pairs_accept_vidur_length_only_files(tmp_path):
    path = write(tmp_path, "lengths.csv",
                 "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n30,5,35,6.0\n8,2,10,4.0\n")
    pairs = load_length_pairs(path)
    assert pairs.to_dict("list") == {"prompt_len": [30, 8], "output_len": [5, 2]}
    with pytest.raises(traces.TraceError, match="trace gen --lengths"):
        load_trace(path)

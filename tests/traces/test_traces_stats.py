"""trace_info on small hand-computed traces and on the bundled traces."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces import load_trace, validate_trace
from traces.batches import FrameBatches
from traces.stats import PERCENTILES, trace_info


def test_trace_info_small_trace():
    df = validate_trace(pd.DataFrame({
        "arrival_s": [0.0, 1.0, 4.0],
        "prompt_len": [10, 20, 60],
        "output_len": [1, 2, 3],
        "n": [1, 4, 1],
        "beam_width": [1, 1, 2],
        "prefix_blocks": [[1, 2], [1, 3], []],
        "prefix_block_size": [4, 4, 4],
    }))
    info = trace_info(df)
    assert info["num_requests"] == 3
    assert info["duration_s"] == 4.0
    assert info["mean_rate_per_s"] == 0.5  # 2 gaps over 4 s
    assert info["prompt_len"]["mean"] == 30.0
    assert info["prompt_len"]["p50"] == 20.0
    assert info["prompt_len"]["max"] == 60
    assert info["output_len"]["p90"] == pytest.approx(2.8)
    assert info["total_tokens"] == 96
    assert info["n"] == {"mean": 2.0, "max": 4, "requests_above_1": 1}
    assert info["beam_width"]["requests_above_1"] == 1
    assert info["prefix"] == {"block_size": 4, "block_sizes": [4], "requests_with_prefix": 2, "references": 4,
                              "unique_blocks": 3, "repeat_fraction": 0.25}
    json.dumps(info)  # JSON-ready: plain Python numbers only


def test_trace_info_without_prefix_and_single_request():
    df = validate_trace(pd.DataFrame({"arrival_s": [0.0], "prompt_len": [5], "output_len": [6]}))
    info = trace_info(df)
    assert info["prefix"] is None
    assert info["mean_rate_per_s"] is None
    assert info["duration_s"] == 0.0


def test_keys_at_different_block_sizes_are_different_blocks():
    df = validate_trace(pd.DataFrame({
        "arrival_s": [0.0, 1.0], "prompt_len": [64, 64], "output_len": [1, 1],
        "prefix_blocks": [[1, 2], [1, 2]], "prefix_block_size": [16, 32],
    }))
    prefix = trace_info(df)["prefix"]
    assert prefix["unique_blocks"] == 4
    # Not labelled by one of the two sizes: the trace records both.
    assert prefix["block_size"] is None and prefix["block_sizes"] == [16, 32]


def test_mooncake_prefix_reuse_matches_the_published_count():
    # ../shared/traces/SOURCES.md: 288,500 references, 182,790 unique (36.6% repeats).
    prefix = trace_info(load_trace("mooncake-conv"))["prefix"]
    assert prefix["references"] == 288_500
    assert prefix["unique_blocks"] == 182_790
    assert prefix["repeat_fraction"] == pytest.approx(0.366, abs=0.001)


def test_azure_conv_figures():
    info = trace_info(load_trace("azure-conv"))
    assert info["prompt_len"]["p50"] == 1020
    assert info["prompt_len"]["max"] == 14_050
    assert info["output_len"]["max"] == 1000
    assert info["mean_rate_per_s"] == pytest.approx(5.53, abs=0.01)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), st.integers(1, 2**40)), min_size=1, max_size=300),
       st.integers(1, 64))
def test_length_statistics_read_in_blocks_are_numpys_on_the_whole_column(lengths, block):
    prompt = np.array([p for p, _ in lengths], np.int64)
    output = np.array([o for _, o in lengths], np.int64)
    df = validate_trace(pd.DataFrame({"arrival_s": np.arange(len(prompt), dtype=float),
                                      "prompt_len": prompt, "output_len": output}))
    info = trace_info(FrameBatches(df, max_rows=block))  # blocks cut anywhere
    for col, values in (("prompt_len", prompt), ("output_len", output)):
        expected = np.percentile(values, PERCENTILES)
        assert [info[col][f"p{q}"] for q in PERCENTILES] == expected.tolist()
        assert info[col]["max"] == int(values.max())
        assert info[col]["mean"] == pytest.approx(float(values.mean()), rel=1e-12)
    assert info["total_tokens"] == int(prompt.sum() + output.sum())
    assert info == trace_info(df)

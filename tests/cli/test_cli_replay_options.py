"""`pagelab replay` options that shape its steps, its run folder and its warnings, on the tiny CPU engine."""
from __future__ import annotations

import json

import pandas as pd
import pytest
from clirun import one_line_error, pagelab

from cli.replay import replay_capacity

CPU = ("--device", "cpu", "--clock", "cpu", "--time-scale", "0")


def write_trace(path, prompt_len: list[int], output_len: list[int]):
    """A CSV trace of requests all arriving at 0."""
    pd.DataFrame({"arrival_s": [0.0] * len(prompt_len), "prompt_len": prompt_len,
                  "output_len": output_len}).to_csv(path, index=False)
    return path


def test_replay_chunked_prefill_steps_below_max_model_len(tmp_path):
    trace = write_trace(tmp_path / "t.csv", [300, 200, 40], [5, 6, 4])
    out = tmp_path / "run"
    result = pagelab("replay", trace, *CPU, "--max-model-len", "512", "--max-num-batched-tokens", "64",
                     "--max-num-seqs", "8", "--chunked-prefill", "--out", out, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((out / "paged" / "config.json").read_text())["enable_chunked_prefill"] is True
    requests = pd.read_parquet(out / "paged" / "requests.parquet")
    assert not requests["rejected"].any() and requests["finish_s"].notna().all()
    steps = pd.read_parquet(out / "paged" / "steps.parquet")
    assert steps["num_batched_tokens"].max() <= 64
    assert steps["num_prefill_tokens"].sum() == 540  # every prompt token, over several steps


@pytest.mark.parametrize("flag", [["--overwrite"], ["--table-format", "csv"]])
def test_replay_refuses_run_folder_options_without_out(flag):
    line = one_line_error(pagelab("replay", "--limit", "2", *CPU, *flag))
    assert line == f"error: {flag[0]} needs --out (a run folder)"


def test_replay_capacity_steps_by_the_engine_token_budget():
    config = {"model": "tiny-hybrid", "capacity_tokens": 192, "dtype": "float32", "block_size": 16,
              "max_model_len": 128, "capacity_source": "num_blocks", "device": "cpu", "max_num_seqs": 8,
              "max_num_batched_tokens": None}
    assert replay_capacity(config).max_num_batched_tokens == 2048 + 8  # max(max_model_len, 2048) + seqs
    assert replay_capacity({**config, "enable_chunked_prefill": True}).max_num_batched_tokens == 512
    assert replay_capacity({**config, "max_num_batched_tokens": 160}).max_num_batched_tokens == 160


def test_replay_warns_of_outputs_longer_than_max_model_len(tmp_path):
    # The first prompt is clipped to fit; the second request's output alone is past max_model_len.
    trace = write_trace(tmp_path / "t.csv", [500, 20, 30], [4, 200, 3])
    result = pagelab("replay", trace, *CPU, "--max-model-len", "128", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    err = " ".join(result.stderr.split())
    assert ("1 of 3 requests (33.3%) were rejected (1 with an output longer than max_model_len 128 (prompts "
            "are clipped, outputs are not): the longest needs 200; give --max-model-len 256 (the model "
            "allows 4,096))") in err
    assert "prompt + output" not in err

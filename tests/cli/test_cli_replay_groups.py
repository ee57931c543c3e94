"""`pagelab replay --model tiny-hybrid [--disable-hybrid-kv-cache-manager]`: the grouped pool or one group,
recorded in the run folder and reported by the capacity header as the engine ran it."""
from __future__ import annotations

import json

import pandas as pd
import pytest
from clirun import pagelab

from pagelab import __version__


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("groups") / "t.csv"
    pd.DataFrame({"arrival_s": [0.0, 0.0, 0.0], "prompt_len": [60, 70, 50],
                  "output_len": [40, 30, 45]}).to_csv(path, index=False)
    return path


@pytest.mark.parametrize("grouped", [True, False])
def test_replay_runs_a_hybrid_model_grouped_or_in_one_group(trace, tmp_path, grouped):
    out = tmp_path / "run"
    flag = [] if grouped else ["--disable-hybrid-kv-cache-manager"]
    result = pagelab("replay", trace, "--model", "tiny-hybrid", "--num-blocks", "12", "--max-model-len",
                     "128", "--time-scale", "0", "--clock", "cpu", *flag, "--out", out, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    config = json.loads((out / "paged" / "config.json").read_text())
    assert config.get("disable_hybrid_kv_cache_manager", False) is not grouped
    assert config["pagelab_version"] == __version__
    header = " ".join(result.stdout.split())
    # 12 blocks of 16 tokens on all 4 layers: 192 tokens either way; grouped, a block is one page of each
    # group's 2 layers, so the same bytes hold 24 of them.
    if grouped:
        assert "KV cache groups: 1 x sliding_window 32 (2 layers), 1 x full (2 layers)" in header
        assert "(steps of 2,304 tokens)" in header  # the engine's budget: max(128, 2048) + 256 seqs
        assert "KV cache size: 192 tokens (24 blocks of 16)" in header
    else:
        assert "KV cache groups" not in header
        assert "KV cache size: 192 tokens (12 blocks of 16)" in header

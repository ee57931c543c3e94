"""bench.hybrid: its shares split internal fragmentation and free memory without exceeding them."""
from __future__ import annotations

import dataclasses

import pytest

from bench.hybrid import BASE, _trace, main, run_one, study, timing


def test_padding_and_window_blocks_are_parts_of_their_states():
    trace = _trace(12)
    config = dataclasses.replace(BASE, max_model_len=32768)
    hybrid = run_one(trace, config)
    flat = run_one(trace, dataclasses.replace(config, disable_hybrid_kv_cache_manager=True))
    assert 0 < hybrid["padding"] <= hybrid["internal_fragmentation"]
    assert 0 < hybrid["window_cached"] <= hybrid["free"]
    assert flat["padding"] == flat["window_cached"] == 0
    # 0.9 x 80 GiB - 2 x 27,009,346,304 bytes of weights - 1 GiB = 22,216,976,896 bytes of KV, in blocks of
    # 10 x 128 KiB (hybrid) or 62 x 128 KiB (one group).
    pool = int(0.9 * 80 * 2**30) - 2 * 27_009_346_304 - 2**30
    assert hybrid["num_blocks"] == pool // (10 * 131072) == 16950
    assert flat["num_blocks"] == pool // (62 * 131072) == 2733


def test_timing_gives_both_runs_and_their_ratio():
    out = timing(3, 1)
    assert out["hybrid cpu_s"] > 0 and out["one group cpu_s"] > 0
    assert out["ratio_cpu"] == out["hybrid cpu_s"] / out["one group cpu_s"]
    assert out["ratio_wall"] == out["hybrid wall_s"] / out["one group wall_s"]


def test_chunked_prefill_serves_the_long_prompt_the_hybrid_layout_refuses_whole():
    trace = _trace(12)  # request 11: 87,169 prompt tokens, 5,449 blocks in each of the 7 groups at once
    assert trace["prompt_len"].max() == 87169
    whole = run_one(trace, BASE)
    chunked = study(12, 8192)["hybrid"]
    assert whole["finished"] == 11 and chunked["finished"] == 12


def test_a_chunk_of_no_tokens_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--chunk", "0", "--out", "unused"])
    assert exc.value.code == 2 and "--chunk must be >= 1 token, got 0" in capsys.readouterr().err

"""bench.hybrid: its shares split internal fragmentation and free memory without exceeding them."""
from __future__ import annotations

import dataclasses

from bench.hybrid import BASE, _trace, run_one, timing


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

"""The multi-turn generator: turns extend their history, keys show the reuse, defaults match Mooncake."""
from __future__ import annotations

import numpy as np
import pytest

from traces import load_trace
from traces.errors import TraceError
from traces.multiturn import MultiTurnConfig, generate_multiturn
from traces.stats import trace_info


def _conversations(trace):
    """Rows grouped by the conversation their keys belong to (the first key past the system prompt)."""
    groups: dict[int, list[int]] = {}
    for i, keys in enumerate(trace["prefix_blocks"]):
        if len(keys) > 1:
            groups.setdefault(keys[1], []).append(i)
    return groups


def test_each_turn_extends_the_last_prompt_plus_answer():
    config = MultiTurnConfig(num_requests=400, mean_turns=4, think_time_s=5, seed=1)
    trace = generate_multiturn(config)
    size = config.prefix_block_size
    checked = 0
    for rows in _conversations(trace).values():
        for a, b in zip(rows[:-1], rows[1:], strict=False):
            prev, cur = trace.iloc[a], trace.iloc[b]
            assert cur.prompt_len > prev.prompt_len + prev.output_len
            assert cur.arrival_s >= prev.arrival_s
            full = prev.prompt_len // size  # the full blocks of the last prompt keep their keys
            assert cur.prefix_blocks[:full] == prev.prefix_blocks[:full]
            if prev.prompt_len % size:  # its partial block was filled with other tokens: a new key
                assert cur.prefix_blocks[full] != prev.prefix_blocks[full]
            checked += 1
    assert checked > 100
    assert (trace["prompt_len"] + trace["output_len"] <= config.max_model_len).all()


def test_defaults_match_the_mooncake_conversation_trace():
    mooncake = trace_info(load_trace("mooncake-conv"))
    ours = trace_info(generate_multiturn(MultiTurnConfig(num_requests=20000)))
    assert ours["num_requests"] == 20000
    assert ours["prompt_len"]["mean"] == pytest.approx(mooncake["prompt_len"]["mean"], rel=0.1)
    assert ours["prefix"]["repeat_fraction"] == pytest.approx(mooncake["prefix"]["repeat_fraction"], rel=0.1)
    assert ours["mean_rate_per_s"] == pytest.approx(mooncake["mean_rate_per_s"], rel=0.1)


@pytest.mark.parametrize("dist", ["exponential", "lognormal", "fixed"])
def test_think_times_have_the_given_mean(dist):
    config = MultiTurnConfig(num_requests=3000, mean_turns=6, think_time_s=40, think_time=dist, rate=0.05)
    trace = generate_multiturn(config)
    gaps = [np.diff(trace["arrival_s"].to_numpy()[rows]) for rows in _conversations(trace).values()]
    gaps = np.concatenate([g for g in gaps if len(g)])
    assert gaps.mean() == pytest.approx(40, rel=0.15)
    assert (gaps.std() < 1e-6) == (dist == "fixed")


def test_same_seed_same_trace_and_bad_fields_are_named():
    a = generate_multiturn(MultiTurnConfig(num_requests=50, seed=7))
    b = generate_multiturn(MultiTurnConfig(num_requests=50, seed=7))
    assert a.equals(b)
    with pytest.raises(TraceError, match="'mean_turns'"):
        MultiTurnConfig(mean_turns=0.5)
    with pytest.raises(TraceError, match="'think_time'"):
        MultiTurnConfig(think_time="weibull")
    with pytest.raises(TraceError, match="'mean_turns'"):
        MultiTurnConfig(mean_turns=float("inf"))
    with pytest.raises(TraceError, match="'think_time_s'"):
        MultiTurnConfig(think_time_s=float("inf"))


def test_long_think_times_keep_the_start_times():
    # Think times far longer than the whole arrival span: every conversation's first turn arrives before
    # any later turn, at the Poisson start times, which must survive next to the huge think times.
    config = MultiTurnConfig(num_requests=2000, think_time_s=2e7, rate=3.4)
    arrival = generate_multiturn(config)["arrival_s"].to_numpy()
    firsts = arrival[arrival < 1e4]
    gaps = np.diff(firsts)
    assert (gaps > 0).all()
    assert gaps.mean() == pytest.approx(config.mean_turns / config.rate, rel=0.2)

"""The ITL: every token's gap since the request's previous token, pooled over the run as vLLM pools them,
checked against each token's time read off the run step by step."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagelab.column_stats import GAP_BITS
from simulator.config import SimConfig
from simulator.loop import simulate
from simulator.metrics import latency_stats
from traces import SyntheticConfig, generate_trace


class TokenClock:
    """An observer of a step-mode run: each sequence's new tokens and when they came out."""

    def __init__(self) -> None:
        self.seqs: dict[int, object] = {}  # request id -> its sequence (plain requests: one)
        self.seen: dict[int, int] = {}  # request id -> tokens generated when last looked
        self.last: dict[int, float] = {}  # request id -> its last token's time
        self.gaps: dict[int, list[float]] = {}

    def __call__(self, run) -> None:
        sched = run.sched
        for g in [*sched.running, *sched.swapped, *sched.waiting]:
            self.seqs.setdefault(g.request_id, g.seqs[0])
        for i, s in self.seqs.items():
            made = s.num_generated - self.seen.get(i, 0)
            assert made in (0, 1)  # a step samples one token per sequence at most
            if made:
                if i in self.last:
                    self.gaps.setdefault(i, []).append(run.now - self.last[i])
                self.last[i] = run.now
                self.seen[i] = s.num_generated


def _check(trace, config: SimConfig) -> None:
    clock = TokenClock()
    res = simulate(trace, dataclasses.replace(config, mode="step"), observer=clock)
    req = res.requests
    finished = req.loc[req["finish_s"].notna(), "request_id"].tolist()
    rows = dict(zip(req["request_id"], range(len(req)), strict=True))
    pooled = np.array([g for i in finished for g in clock.gaps.get(rows[i], [])])
    count, mean, std = res.itl.moments()
    assert count == len(pooled) == int((req["output_len"][req["finish_s"].notna()] - 1).sum())
    if not count:
        return
    assert mean == pytest.approx(pooled.mean(), rel=1e-9)
    assert std == pytest.approx(pooled.std(), rel=1e-6, abs=1e-9)
    stats = latency_stats(req, "itl", (50, 90, 99), res.itl)
    width = 2.0 ** -GAP_BITS
    expect = [np.median(pooled), *np.percentile(pooled, [50, 90, 99])]
    for got, want in zip([stats["median"], stats["p50"], stats["p90"], stats["p99"]], expect, strict=True):
        assert abs(got / 1e3 - want) <= width * want + 1e-12


CONFIGS = {
    "plain": dict(model="opt-13b", max_model_len=2048),
    "recompute": dict(model="opt-13b", capacity_tokens=3000, max_model_len=2048),
    "swap": dict(model="opt-13b", capacity_tokens=3000, max_model_len=2048, preemption_mode="swap",
                 swap_space_gb=1.0),
    "chunked": dict(model="opt-13b", capacity_tokens=4000, max_model_len=2048, enable_chunked_prefill=True,
                    max_num_batched_tokens=256),
    "contiguous": dict(model="opt-13b", capacity_tokens=6000, max_model_len=2048, allocator="contiguous-max"),
}


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(sorted(CONFIGS)), st.sampled_from(["burst", "poisson"]))
def test_pooled_gaps_are_every_tokens_gap(seed, name, arrival):
    trace = generate_trace(SyntheticConfig(num_requests=30, rate=20, arrival=arrival, lengths="sharegpt",
                                           seed=seed))
    _check(trace, SimConfig(**CONFIGS[name]))


def test_preempted_requests_gaps_span_their_wait():
    trace = generate_trace(SyntheticConfig(num_requests=40, arrival="burst", lengths="sharegpt", seed=3))
    config = SimConfig(**CONFIGS["recompute"])
    res = simulate(trace, config)
    assert res.summary["num_preemptions"] > 0
    _check(trace, config)
    # A recomputed request waits: its longest gap is longer than any step.
    assert res.itl.moments()[0] and latency_stats(res.requests, "itl", (100,), res.itl)["p100"] > \
        1e3 * res.summary["sim_duration_s"] / res.summary["num_steps"] * 5

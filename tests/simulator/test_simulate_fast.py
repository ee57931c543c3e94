"""Fast mode (decode batch, fast steps, spans) makes step mode's decisions bit for bit, events included."""
from __future__ import annotations

import dataclasses
import gc
import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.config import SimConfig
from simulator.loop import simulate
from traces import SyntheticConfig, generate_trace, load_trace

EXACT = ["admitted_s", "first_token_s", "finish_s", "num_preemptions", "rejected", "prefix_hit_tokens"]


def _trace(**kw) -> pd.DataFrame:
    return generate_trace(SyntheticConfig(**kw))


def assert_identical(fast, step):
    """Same decisions, same times to the last bit, same block tenures (ids included), same summary."""
    for col in EXACT:
        np.testing.assert_array_equal(fast.requests[col].to_numpy(), step.requests[col].to_numpy(),
                                      err_msg=col)
    pd.testing.assert_frame_equal(fast.events, step.events)
    assert fast.summary["num_steps"] == step.summary["num_steps"]
    assert fast.summary["allocator_stats"] == step.summary["allocator_stats"]
    for name in ("counts", "sums", "squares"):  # every inter-token gap, added in the same order
        np.testing.assert_array_equal(getattr(fast.itl, name), getattr(step.itl, name), err_msg=name)
    for state, value in fast.summary["memory"].items():
        assert value == pytest.approx(step.summary["memory"][state], rel=1e-9, abs=1e-12), state


def run_both(trace, **kw):
    cfg = SimConfig(**kw)
    return simulate(trace, cfg), simulate(trace, dataclasses.replace(cfg, mode="step"))


CASES = {
    "memory pressure, recompute": (dict(num_requests=40, arrival="burst", lengths="sharegpt", seed=3),
                                   dict(model="opt-13b", capacity_tokens=3000, max_model_len=2048)),
    "memory pressure, swap": (dict(num_requests=40, arrival="burst", lengths="sharegpt", seed=3),
                              dict(model="opt-13b", capacity_tokens=3000, max_model_len=2048,
                                   preemption_mode="swap", swap_space_gb=1.0)),
    "prefix cache with evictions": (dict(num_requests=50, rate=20, lengths="sharegpt", num_prefix_groups=3,
                                         prefix_len=200, prefix_fraction=0.7, seed=1),
                                    dict(model="opt-13b", capacity_tokens=3000, max_model_len=2048)),
    "chunked prefill": (dict(num_requests=30, rate=30, lengths="sharegpt", seed=5),
                        dict(model="opt-13b", capacity_tokens=5000, max_model_len=2048,
                             enable_chunked_prefill=True, max_num_batched_tokens=256)),
    "parallel sampling": (dict(num_requests=40, rate=5, lengths="alpaca", n=2, seed=2),
                          dict(model="opt-13b", capacity_tokens=3000, max_model_len=2048)),
    "beam search": (dict(num_requests=20, rate=5, lengths="alpaca", beam_width=3, seed=2),
                    dict(model="opt-13b", capacity_tokens=3000, max_model_len=2048)),
    "samples recomputed": (dict(num_requests=40, arrival="burst", lengths="alpaca", n=4, seed=2),
                           dict(model="opt-13b", capacity_tokens=1500, max_model_len=2048)),
    "first-fit placement": (dict(num_requests=40, rate=20, lengths="sharegpt", seed=4),
                            dict(model="opt-13b", capacity_tokens=4000, max_model_len=2048,
                                 placement="first-fit")),
}


@pytest.mark.parametrize("allocator", ["paged", "contiguous-pow2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_is_step_bit_for_bit_with_invariant_checks(case, allocator):
    trace_kw, sim_kw = CASES[case]
    # debug=True runs the allocator's invariant checker after every mutation, in both modes.
    fast, step = run_both(_trace(**trace_kw), allocator=allocator, debug=True, **sim_kw)
    assert_identical(fast, step)
    assert fast.summary["num_finished"] + fast.summary["num_rejected"] == trace_kw["num_requests"]


def test_pressure_cases_really_preempt_and_evict():
    """The cases above exercise what they claim (so the equality is not vacuous)."""
    trace_kw, sim_kw = CASES["memory pressure, recompute"]
    assert simulate(_trace(**trace_kw), SimConfig(**sim_kw)).summary["num_preemptions"] > 0
    trace_kw, sim_kw = CASES["samples recomputed"]
    assert simulate(_trace(**trace_kw), SimConfig(**sim_kw)).summary["num_preemptions"] > 0
    trace_kw, sim_kw = CASES["prefix cache with evictions"]
    stats = simulate(_trace(**trace_kw), SimConfig(**sim_kw)).summary["allocator_stats"]
    assert stats["evictions"] > 0 and stats["prefix_hits"] > 0


@pytest.mark.parametrize("allocator", ["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"])
def test_fast_is_step_bit_for_bit_on_azure(allocator):
    trace = load_trace("azure-conv").iloc[:500].reset_index(drop=True)
    fast, step = run_both(trace, allocator=allocator)
    assert len(fast.memory) < len(step.memory) / 2  # most steps were batched
    assert_identical(fast, step)


@given(seed=st.integers(0, 10_000), cap=st.integers(900, 8000), bs=st.sampled_from([1, 5, 7, 16]),
       allocator=st.sampled_from(["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"]),
       rate=st.floats(0.5, 80), max_num_seqs=st.sampled_from([4, 16, 64]), n=st.sampled_from([1, 1, 2]))
@settings(max_examples=30, deadline=None)
def test_fast_is_step_bit_for_bit_on_random_traces(seed, cap, bs, allocator, rate, max_num_seqs, n):
    trace = _trace(num_requests=40, rate=rate, lengths="uniform", prompt_range=(1, 300),
                   output_range=(1, 200), max_model_len=512, n=n, seed=seed)
    fast, step = run_both(trace, allocator=allocator, model="opt-13b", capacity_tokens=cap, block_size=bs,
                          max_model_len=512, max_num_seqs=max_num_seqs)
    assert_identical(fast, step)


def test_fast_is_step_bit_for_bit_with_real_prefix_hits_and_chunked_prefill():
    trace = load_trace("mooncake-conv").iloc[:60].reset_index(drop=True)
    fast, step = run_both(trace, allocator="paged", model="llama-3-8b", capacity_tokens=400_000,
                          max_model_len=131072, enable_chunked_prefill=True, max_num_batched_tokens=2048)
    assert fast.summary["prefix_cache_hit_rate"] > 0.02
    assert (fast.requests["prefix_hit_tokens"] > 0).any()
    assert_identical(fast, step)


def test_events_off_changes_nothing_else():
    trace = load_trace("azure-conv").iloc[:200].reset_index(drop=True)
    on = simulate(trace, SimConfig())
    off = simulate(trace, SimConfig(record_events=False))
    assert len(off.events) == 0 and len(on.events) > 0
    pd.testing.assert_frame_equal(on.requests, off.requests)
    pd.testing.assert_frame_equal(on.memory, off.memory)


def test_simulate_restores_the_cyclic_collector():
    """The loop runs without the cyclic GC; it is back on afterwards, after a failed run too."""
    trace = pd.DataFrame({"request_id": [0, 1], "arrival_s": [0.0, 0.1], "prompt_len": [5, 7],
                          "output_len": [3, 4], "n": [1, 1], "beam_width": [1, 1]})
    assert gc.isenabled()
    simulate(trace, SimConfig(record_events=True))
    assert gc.isenabled()

    def boom(run):
        raise RuntimeError("observer failed")

    with pytest.raises(RuntimeError, match="observer failed"):
        simulate(trace, SimConfig(record_events=True), observer=boom)
    assert gc.isenabled()


GPT_OSS_PROFILE = {"kind": "fitted", "model": "gpt-oss-20b", "gpu": "a100-80gb",
                   "coefficients": {"step_overhead_s": 0.003, "s_per_token": 2e-6, "s_per_attn_pair": 1e-9,
                                    "s_per_kv_token_read": 5e-8}}
HYBRID = {  # models whose layers form several KV cache groups (or one sliding one), under memory pressure
    "gpt-oss-20b, blocks of 48": dict(model="gpt-oss-20b", kv_memory_gb=0.1, block_size=48),
    "gemma-3-27b": dict(model="gemma-3-27b", gpu="h100-80gb", kv_memory_gb=0.4),
    "mistral-7b sliding, swap": dict(model="mistral-7b-v0.1", kv_memory_gb=0.2, preemption_mode="swap",
                                     swap_space_gb=0.5),
    "gemma-3-27b fp8, chunked": dict(model="gemma-3-27b", gpu="h100-80gb", kv_cache_dtype="fp8",
                                     kv_memory_gb=0.2, enable_chunked_prefill=True,
                                     max_num_batched_tokens=256),
}


@pytest.mark.parametrize("case", sorted(HYBRID))
def test_fast_is_step_bit_for_bit_on_hybrid_models(case, tmp_path):
    """Grouped pools take the decode batch too (decode_groups.py), with the same decisions and blocks."""
    kw = dict(HYBRID[case])
    if kw["model"] == "gpt-oss-20b":  # no parameter count for the roofline: a fitted profile times it
        profile = tmp_path / "gpt-oss.json"
        profile.write_text(json.dumps(GPT_OSS_PROFILE))
        kw["latency"] = str(profile)
    trace = _trace(num_requests=16, rate=20, lengths="sharegpt", num_prefix_groups=3, prefix_len=300,
                   prefix_fraction=0.7, max_model_len=2048, seed=7)
    cfg = SimConfig(max_model_len=2048, debug=True, **kw)
    assert cfg.kv_layout() is not None
    batched = []
    fast = simulate(trace, cfg, observer=lambda run: batched.append(run.sched.decode.active))
    step = simulate(trace, dataclasses.replace(cfg, mode="step"))
    assert sum(batched) > len(batched) / 10  # the decode batch took many steps (none while swapped)
    assert_identical(fast, step)
    assert fast.summary["num_preemptions"] > 0 or fast.summary["allocator_stats"]["prefix_hits"] > 0


@given(seed=st.integers(0, 10_000), model=st.sampled_from(["gemma-3-27b", "mistral-7b-v0.1", "gpt-oss-20b"]),
       kv_gb=st.floats(0.05, 0.4), bs=st.sampled_from([8, 16, 48]), rate=st.floats(1, 80),
       max_num_seqs=st.sampled_from([4, 16, 64]), swap=st.booleans(), chunk=st.sampled_from([None, 64, 256]),
       n=st.sampled_from([1, 1, 3]))
@settings(max_examples=25, deadline=None)
def test_fast_is_step_bit_for_bit_on_random_hybrid_traces(seed, model, kv_gb, bs, rate, max_num_seqs, swap,
                                                          chunk, n, tmp_path_factory):
    """Random traces with shared prefixes on hybrid models and block sizes whose windows do not end on a
    block boundary (48), with swap or recompute preemption, prompts whole or chunk by chunk, parallel
    samples recomputed after they diverged."""
    trace = _trace(num_requests=25, rate=rate, lengths="uniform", prompt_range=(1, 500),
                   output_range=(1, 300), max_model_len=1024, num_prefix_groups=2, prefix_len=200,
                   prefix_fraction=0.6, n=n, seed=seed)
    kw = dict(model=model, gpu="h100-80gb", kv_memory_gb=kv_gb, block_size=bs, max_model_len=1024,
              max_num_seqs=max_num_seqs)
    if swap:
        kw.update(preemption_mode="swap", swap_space_gb=0.2)
    if chunk:
        kw.update(enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    if model == "gpt-oss-20b":
        profile = tmp_path_factory.mktemp("profile") / "gpt-oss.json"
        profile.write_text(json.dumps({**GPT_OSS_PROFILE, "gpu": "h100-80gb"}))
        kw["latency"] = str(profile)
    assert SimConfig(**kw).kv_layout() is not None
    fast, step = run_both(trace, **kw)
    assert_identical(fast, step)

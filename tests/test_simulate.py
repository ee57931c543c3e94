"""The simulation loop: fast mode equals the step-by-step reference, and the paper's mechanisms show."""
from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.config import SimConfig
from simulator.simulate import simulate
from traces import SyntheticConfig, generate_trace, load_trace

TIMES = ["admitted_s", "first_token_s", "finish_s"]


def _trace(**kw) -> pd.DataFrame:
    return generate_trace(SyntheticConfig(**kw))


def assert_same_run(a, b):
    """Same scheduling decisions and per-request times, up to floating-point rounding."""
    ra, rb = a.requests, b.requests
    for col in ("num_preemptions", "rejected", "prefix_hit_tokens"):
        assert (ra[col].to_numpy() == rb[col].to_numpy()).all(), col
    for col in TIMES:
        np.testing.assert_allclose(ra[col].to_numpy(), rb[col].to_numpy(), rtol=1e-9, atol=1e-9,
                                   equal_nan=True, err_msg=col)
    assert a.summary["num_steps"] == b.summary["num_steps"]
    for state, value in a.summary["memory"].items():
        assert value == pytest.approx(b.summary["memory"][state], rel=1e-6, abs=1e-9), state
    assert a.summary["mean_batch_size"] == pytest.approx(b.summary["mean_batch_size"], rel=1e-9)


def both_modes(trace, **kw):
    cfg = SimConfig(**kw)
    fast = simulate(trace, dataclasses.replace(cfg, mode="fast"))
    step = simulate(trace, dataclasses.replace(cfg, mode="step"))
    return fast, step


@pytest.mark.parametrize("allocator", ["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"])
def test_fast_mode_equals_step_mode_on_azure(allocator):
    trace = load_trace("azure-conv").iloc[:400].reset_index(drop=True)
    fast, step = both_modes(trace, allocator=allocator)
    assert fast.summary["num_finished"] == 400
    assert len(fast.memory) < len(step.memory)  # spans really were taken
    assert_same_run(fast, step)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_fast_equals_step_under_memory_pressure(preemption):
    trace = _trace(num_requests=120, arrival="burst", lengths="sharegpt", seed=3)
    fast, step = both_modes(trace, allocator="paged", model="opt-13b", capacity_tokens=6000,
                            max_model_len=2048, preemption_mode=preemption, swap_space_gb=2.0)
    assert fast.summary["num_preemptions"] > 0
    assert fast.summary["num_finished"] == 120
    assert_same_run(fast, step)


def test_fast_equals_step_with_prefix_caching_and_chunked_prefill():
    trace = load_trace("mooncake-conv").iloc[:60].reset_index(drop=True)
    fast, step = both_modes(trace, allocator="paged", model="llama-3-8b", capacity_tokens=400_000,
                            max_model_len=131072, enable_chunked_prefill=True, max_num_batched_tokens=2048)
    assert fast.summary["prefix_cache_hit_rate"] > 0.02
    assert (fast.requests["prefix_hit_tokens"] > 0).any()
    assert_same_run(fast, step)


@given(seed=st.integers(0, 10_000), cap=st.integers(900, 8000), bs=st.sampled_from([1, 7, 16]),
       allocator=st.sampled_from(["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"]),
       n=st.sampled_from([1, 1, 2]), rate=st.floats(0.5, 50))
@settings(max_examples=25, deadline=None)
def test_fast_equals_step_on_random_traces(seed, cap, bs, allocator, n, rate):
    trace = _trace(num_requests=40, rate=rate, lengths="uniform", prompt_range=(1, 300),
                   output_range=(1, 200), max_model_len=512, n=n, seed=seed)
    fast, step = both_modes(trace, allocator=allocator, model="opt-13b", capacity_tokens=cap, block_size=bs,
                            max_model_len=512, max_num_seqs=16)
    assert_same_run(fast, step)


def test_memory_rows_sum_to_one_and_counts_are_sane():
    trace = _trace(num_requests=200, rate=20, lengths="sharegpt", seed=1)
    res = simulate(trace, SimConfig(allocator="contiguous-pow2", model="opt-13b", kv_memory_gb=12,
                                    max_model_len=2048))
    m = res.memory
    states = ["token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free"]
    total = m[states].sum(axis=1)
    np.testing.assert_allclose(total, 1.0, atol=1e-9)
    assert (m["dt_s"] > 0).all()
    assert res.summary["num_finished"] + res.summary["num_rejected"] == 200
    r = res.requests.dropna(subset=["finish_s"])
    assert (r["first_token_s"] >= r["admitted_s"]).all() and (r["finish_s"] >= r["first_token_s"]).all()
    assert (r["admitted_s"] >= r["arrival_s"]).all()


def test_orca_max_holds_exactly_seven_requests_under_load():
    trace = _trace(num_requests=300, arrival="burst", lengths="sharegpt", seed=0)
    # A token budget of 4096 keeps long prompts from blocking admission (a separate effect).
    res = simulate(trace, SimConfig(allocator="contiguous-max", model="opt-13b", kv_memory_gb=12,
                                    max_model_len=2048, max_num_batched_tokens=4096))
    m = res.memory
    assert m["num_running"].max() == 7
    assert (m.loc[m["num_waiting"] > 0, "num_running"] == 7).all()  # full whenever someone waits
    assert res.summary["memory"]["external_fragmentation"] == pytest.approx(0.0885, abs=0.002)


def test_paged_batches_more_requests_than_contiguous_under_load():
    trace = _trace(num_requests=300, arrival="burst", lengths="sharegpt", seed=0)
    batch = {}
    for name in ("contiguous-max", "contiguous-pow2", "contiguous-oracle", "paged"):
        res = simulate(trace, SimConfig(allocator=name, model="opt-13b", kv_memory_gb=12, max_model_len=2048))
        batch[name] = res.summary["mean_batch_size"]
    assert batch["contiguous-max"] < batch["contiguous-pow2"] < batch["contiguous-oracle"] < batch["paged"]


def test_requests_that_never_fit_are_rejected_not_crashed():
    trace = pd.DataFrame({"request_id": [0, 1, 2], "arrival_s": [0.0, 0.1, 0.2],
                          "prompt_len": [100, 5000, 100], "output_len": [10, 10, 10]})
    for name in ("paged", "contiguous-max", "contiguous-oracle"):
        res = simulate(trace, SimConfig(allocator=name, model="opt-13b", capacity_tokens=4096,
                                        max_model_len=2048))
        assert res.requests["rejected"].tolist() == [False, True, False]
        assert res.summary["num_finished"] == 2


def test_parallel_sampling_and_beams_share_blocks():
    trace = _trace(num_requests=30, rate=5, lengths="alpaca", seed=2)
    used = {}
    for label, kw in (("n1", {}), ("n4", {"n": 4}), ("beam4", {"beam_width": 4})):
        t = trace.copy()
        for col, v in kw.items():
            t[col] = v
        res = simulate(t, SimConfig(allocator="paged", model="opt-13b", kv_memory_gb=12, max_model_len=2048,
                                    enable_prefix_caching=False))
        assert res.summary["num_finished"] == 30
        used[label] = res
    assert used["n4"].summary["allocator_stats"]["cow_copies"] > 0
    assert used["beam4"].summary["allocator_stats"]["cow_copies"] > 0


def test_same_seed_same_result_and_seed_matters_for_beams():
    trace = _trace(num_requests=20, rate=5, lengths="alpaca", beam_width=4, seed=5)
    cfg = SimConfig(allocator="paged", model="opt-13b", kv_memory_gb=12, max_model_len=2048)
    a, b = simulate(trace, cfg), simulate(trace, cfg)
    pd.testing.assert_frame_equal(a.requests, b.requests)
    pd.testing.assert_frame_equal(a.memory.drop(columns=[]), b.memory)
    c = simulate(trace, dataclasses.replace(cfg, seed=99))
    assert c.summary["allocator_stats"] != a.summary["allocator_stats"]


def test_events_cover_allocations():
    trace = load_trace("azure-conv").iloc[:100].reset_index(drop=True)
    fast, step = both_modes(trace, allocator="paged")
    for res in (fast, step):
        ev = res.events
        assert len(ev) == res.summary["allocator_stats"]["allocated_blocks"]
        assert (ev["t_end_s"] >= ev["t_start_s"]).all()
        assert (ev["size"] == 16).all()
    # Block tenures start at the step that writes their first token, in both modes.
    key = ["request_id", "start"]
    f = fast.events.sort_values(key + ["t_start_s"]).reset_index(drop=True)
    s = step.events.sort_values(key + ["t_start_s"]).reset_index(drop=True)
    np.testing.assert_allclose(np.sort(f["t_start_s"]), np.sort(s["t_start_s"]), rtol=1e-9)


def test_request_whose_final_length_never_fits_is_rejected_not_livelocked():
    # The prompt fits the pool, but prompt + output does not: it would preempt itself forever.
    trace = pd.DataFrame({"request_id": [0, 1], "arrival_s": [0.0, 0.0],
                          "prompt_len": [100, 100], "output_len": [2000, 50]})
    res = simulate(trace, SimConfig(allocator="paged", model="opt-13b", capacity_tokens=1024, block_size=16,
                                    max_model_len=4096, watermark=0.0))
    assert res.requests["rejected"].tolist() == [True, False]
    assert res.summary["num_finished"] == 1


@pytest.mark.parametrize("chunked", [False, True])
def test_swap_preemption_on_a_tiny_pool_never_overcommits(chunked):
    # Tiny pool, swap preemption (and chunked prefill): swapped groups must come back with room to decode.
    trace = _trace(num_requests=40, arrival="burst", lengths="uniform", prompt_range=(8, 60),
                   output_range=(5, 60), max_model_len=256, seed=7)
    for mode in ("fast", "step"):
        res = simulate(trace, SimConfig(allocator="paged", model="opt-13b", capacity_tokens=72, block_size=8,
                                        max_model_len=256, preemption_mode="swap", swap_space_gb=1.0,
                                        watermark=0.0, enable_chunked_prefill=chunked,
                                        max_num_batched_tokens=64 if chunked else None, max_num_seqs=16,
                                        debug=True, mode=mode))
        assert res.summary["num_finished"] + res.summary["num_rejected"] == 40
        assert res.summary["num_preemptions"] > 0


def test_sharing_savings_order_like_the_paper():
    from simulator.sharing import sharing_saving
    cfg = SimConfig(allocator="paged", model="opt-13b", kv_memory_gb=12, max_model_len=2048,
                    enable_prefix_caching=False)
    saving = {}
    for label, kw in (("single", {}), ("n4", {"n": 4}), ("beam4", {"beam_width": 4})):
        trace = _trace(num_requests=80, arrival="burst", lengths="alpaca", seed=4, **kw)
        saving[label] = sharing_saving(trace, cfg)["saving"]
    assert saving["single"] == 0.0  # nothing is shared without samples, beams or prefix hits
    assert 0.0 < saving["n4"] < saving["beam4"] < 1.0

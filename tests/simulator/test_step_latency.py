"""Step-latency models: roofline sanity against published expectations, vectorization, fitting."""
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.core.errors import ConfigError
from simulator.core.models import MODELS, get_model
from simulator.presets import GPUS, get_gpu
from simulator.timing.latency_fit import fit_latency, nnls
from simulator.timing.step_latency import (
    LATENCY_MODELS,
    FittedLatency,
    RooflineLatency,
    load_fitted,
    make_latency_model,
    step_features,
)

OPT, A100 = get_model("opt-13b"), get_gpu("a100-40gb")
TRUE_COEFS = (2.5e-3, 1.2e-4, 3.0e-9, 4.0e-7)


def _random_steps(rng, n):
    tokens = rng.integers(0, 4096, n)
    tokens[rng.random(n) < 0.1] = 0
    kv = tokens + rng.integers(0, 200_000, n)
    pairs = tokens * rng.integers(1, 4096, n)
    return tokens, pairs, kv


def test_decode_batch1_is_weight_bandwidth_bound():
    # Batch 1, ~500 tokens of context: published A100 numbers for 13B decode are ~20-30 ms per token.
    roof = RooflineLatency(OPT, A100)
    tokens, pairs, kv = step_features([1], [501])
    compute, memory = roof.terms(tokens, pairs, kv)
    assert memory > 50 * compute
    assert 0.010 < roof.step_time(tokens, pairs, kv) < 0.040
    # Nearly all of the memory term is the weights: 13B fp16 params over ~1.24 TB/s.
    weights_s = OPT.weight_bytes / (A100.hbm_bandwidth * A100.bandwidth_efficiency)
    assert weights_s < memory < 1.03 * weights_s


def test_long_prefill_is_compute_bound():
    roof = RooflineLatency(OPT, A100)
    compute, memory = roof.terms(*step_features([2048], [2048]))
    assert compute > memory
    assert 0.1 < roof.prefill_time(2048) < 1.0


def test_kv_read_slope_is_bytes_over_bandwidth():
    roof = RooflineLatency(OPT, A100)
    slope = (roof.step_time(8, 8_000, 10_000) - roof.step_time(8, 8_000, 9_000)) / 1000
    assert slope == pytest.approx(OPT.bytes_per_token / (A100.hbm_bandwidth * A100.bandwidth_efficiency))


def test_faster_gpu_and_smaller_model_are_faster():
    step = (64, 64 * 1000, 64 * 1000)
    baseline = RooflineLatency(OPT, A100).step_time(*step)
    assert RooflineLatency(OPT, get_gpu("h100-80gb")).step_time(*step) < baseline
    assert RooflineLatency(get_model("llama-3.2-1b"), A100).step_time(*step) < baseline
    assert RooflineLatency(OPT, A100).step_time(1, 1, 1) >= A100.step_overhead_s


@pytest.mark.parametrize("latency", [RooflineLatency(OPT, A100), FittedLatency(OPT, A100, TRUE_COEFS)],
                         ids=["roofline", "fitted"])
def test_empty_step_costs_nothing(latency):
    assert latency.step_time(0, 0, 0) == 0.0
    assert latency.step_time(0, 0, 5000) == 0.0
    times = latency.step_times(np.zeros(3, int), np.zeros(3, int), np.array([0, 10, 10_000]))
    assert times.tolist() == [0.0] * 3
    assert latency.step_time(1, 1, 1) > 0


@pytest.mark.parametrize("kind", ["roofline", "fitted"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_vectorized_equals_scalar(kind, model_name):
    model = get_model(model_name)
    latency = RooflineLatency(model, A100) if kind == "roofline" else FittedLatency(model, A100, TRUE_COEFS)
    if kind == "roofline" and model.num_params is None:  # quantized MoE checkpoints: no weight bytes
        with pytest.raises(ConfigError, match=r"num_params\) is unknown: give a fitted latency profile"):
            latency.step_time(1, 1, 1)
        return
    tokens, pairs, kv = _random_steps(np.random.default_rng(7), 2000)
    vector = latency.step_times(tokens, pairs, kv)
    rows = zip(tokens, pairs, kv, strict=True)
    scalar = np.array([latency.step_time(int(t), int(p), int(k)) for t, p, k in rows])
    assert vector.dtype == np.float64 and vector.shape == tokens.shape
    np.testing.assert_array_equal(vector, scalar)
    assert (vector[tokens == 0] == 0).all() and (vector[tokens > 0] > 0).all()


@settings(max_examples=200, deadline=None)
@given(model=st.sampled_from([n for n, m in MODELS.items() if m.num_params is not None]),
       gpu=st.sampled_from(list(GPUS)), num_seqs=st.integers(0, 512), context=st.integers(0, 10**6),
       num_steps=st.integers(0, 300), coefs=st.sampled_from([TRUE_COEFS, (*TRUE_COEFS, 1e-5, 2e-4, 3e-3)]))
def test_decode_times_are_the_steps_times_one_by_one(model, gpu, num_seqs, context, num_steps, coefs):
    for latency in (RooflineLatency(get_model(model), get_gpu(gpu)),
                    FittedLatency(get_model(model), get_gpu(gpu), coefs)):
        one_by_one, ctx = [], context
        for _ in range(num_steps):
            ctx += num_seqs
            one_by_one.append(latency.step_time(num_seqs, ctx, ctx, num_seqs))
        assert latency.decode_times(num_seqs, context, num_steps) == one_by_one  # the same floats


_counts = st.integers(min_value=0, max_value=10**7)


@settings(max_examples=200, deadline=None)
@given(model=st.sampled_from([n for n, m in MODELS.items() if m.num_params is not None]),
       gpu=st.sampled_from(list(GPUS)), tokens=st.integers(1, 65536), pairs=_counts, kv=_counts,
       more_tokens=st.integers(0, 65536), more_pairs=_counts, more_kv=_counts)
def test_more_work_is_never_faster(model, gpu, tokens, pairs, kv, more_tokens, more_pairs, more_kv):
    for latency in (RooflineLatency(get_model(model), get_gpu(gpu)),
                    FittedLatency(get_model(model), get_gpu(gpu), TRUE_COEFS)):
        base = latency.step_time(tokens, pairs, kv)
        assert latency.step_time(tokens + more_tokens, pairs, kv) >= base
        assert latency.step_time(tokens, pairs + more_pairs, kv) >= base
        assert latency.step_time(tokens, pairs, kv + more_kv) >= base
        assert latency.step_time(tokens + more_tokens, pairs + more_pairs, kv + more_kv) >= base


def test_swap_time_is_bytes_over_pcie():
    roof = RooflineLatency(OPT, A100)
    assert roof.swap_time(0, 16) == 0.0
    assert roof.swap_time(1, 16) == pytest.approx(16 * 819_200 / 32e9)
    assert roof.swap_time(10, 16) == pytest.approx(10 * roof.swap_time(1, 16))
    assert RooflineLatency(OPT, get_gpu("h100-80gb")).swap_time(10, 16) < roof.swap_time(10, 16)


def test_recompute_is_a_prefill():
    roof = RooflineLatency(OPT, A100)
    assert roof.prefill_time(300) == roof.step_time(300, 300 * 300, 300)
    assert roof.prefill_time(600) > roof.prefill_time(300)


def test_step_features():
    # One 5-token prefill and two decodes at contexts 10 and 20.
    assert step_features([5, 1, 1], [5, 10, 20]) == (7, 25 + 10 + 20, 35)


def test_nnls_clips_a_coefficient_that_least_squares_makes_negative():
    # Unconstrained least squares gives (1, -1); with x2 >= 0 the optimum is (0.5, 0).
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    np.testing.assert_allclose(nnls(a, np.array([1.0, -1.0, 0.0])), [0.5, 0.0], atol=1e-12)


def _measured(rng, n, coefs=TRUE_COEFS, noise=0.0):
    tokens, pairs, kv = _random_steps(rng, n)
    step_s = coefs[0] + coefs[1] * tokens + coefs[2] * pairs + coefs[3] * kv
    step_s = np.where(tokens > 0, step_s * (1 + noise * rng.standard_normal(n)), 0.0)
    return {"num_batched_tokens": tokens, "attn_pairs": pairs, "kv_tokens_read": kv, "step_s": step_s}


def test_fit_recovers_known_coefficients():
    data = pd.DataFrame(_measured(np.random.default_rng(0), 500))
    fitted = fit_latency(data, OPT, A100)
    np.testing.assert_allclose(fitted.coefficients, TRUE_COEFS, rtol=1e-6)
    assert fitted.rms_residual_s < 1e-9
    assert fitted.num_samples == int((data["num_batched_tokens"] > 0).sum()) < len(data)


def test_fit_with_noise_and_a_zero_coefficient_stays_non_negative():
    coefs = (1e-3, 2e-4, 0.0, 5e-7)
    fitted = fit_latency(_measured(np.random.default_rng(1), 2000, coefs, noise=0.02), OPT, A100)
    assert all(c >= 0 for c in fitted.coefficients)
    assert fitted.coefficients[1] == pytest.approx(coefs[1], rel=0.05)
    assert fitted.coefficients[3] == pytest.approx(coefs[3], rel=0.05)


def test_relative_fit_keeps_the_total_time_and_recovers_exact_coefficients():
    exact = pd.DataFrame(_measured(np.random.default_rng(4), 500))
    fitted = fit_latency(exact, OPT, A100, relative=True)
    np.testing.assert_allclose(fitted.coefficients, TRUE_COEFS, rtol=1e-6)
    # With noise, unscaled relative least squares prices the steps short in total; the fit must not.
    rng = np.random.default_rng(5)
    noisy = _measured(rng, 3000)
    noisy["step_s"] = noisy["step_s"] * np.exp(0.3 * rng.standard_normal(3000))
    fitted = fit_latency(noisy, OPT, A100, relative=True)
    busy = noisy["num_batched_tokens"] > 0
    predicted = fitted.step_times(noisy["num_batched_tokens"], noisy["attn_pairs"], noisy["kv_tokens_read"])
    assert predicted[busy].sum() == pytest.approx(noisy["step_s"][busy].sum(), rel=1e-9)
    assert all(c >= 0 for c in fitted.coefficients)


def test_fit_rejects_bad_measurements():
    data = _measured(np.random.default_rng(2), 20)
    with pytest.raises(ConfigError, match="missing column 'step_s'"):
        fit_latency({k: v for k, v in data.items() if k != "step_s"}, OPT, A100)
    bad = dict(data, attn_pairs=data["attn_pairs"].astype(float))
    bad["attn_pairs"][3] = np.nan
    with pytest.raises(ConfigError, match="row 3, column 'attn_pairs'"):
        fit_latency(bad, OPT, A100)
    with pytest.raises(ConfigError, match="at least 4 steps"):
        fit_latency({k: v[:3] for k, v in data.items()}, OPT, A100)


def test_fitted_json_round_trip(tmp_path):
    fitted = fit_latency(_measured(np.random.default_rng(3), 100), OPT, A100)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(fitted.to_dict()))
    assert load_fitted(path) == fitted
    assert make_latency_model("fitted", "opt-13b", "a100-40gb", path=path) == fitted
    with pytest.raises(ConfigError, match="fitted for model 'opt-13b', not 'llama-3-8b'"):
        make_latency_model("fitted", "llama-3-8b", "a100-40gb", path=path)


def test_bad_fitted_profiles(tmp_path):
    with pytest.raises(ConfigError, match="negative"):
        FittedLatency(OPT, A100, (1e-3, -1e-4, 0.0, 0.0))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="broken.json: not valid JSON"):
        load_fitted(broken)
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"model": "opt-13b", "gpu": "a100-40gb"}))
    with pytest.raises(ConfigError, match="partial.json: missing or invalid field"):
        load_fitted(partial)
    with pytest.raises(ConfigError, match="absent.json' is neither a file nor a bundled profile"):
        load_fitted(tmp_path / "absent.json")
    with pytest.raises(ConfigError, match="bundled: .*cpu-tiny"):
        load_fitted("no-such-profile")


def test_registry_and_factory():
    assert set(LATENCY_MODELS) == {"roofline", "fitted"}
    assert make_latency_model("roofline", "opt-13b", "a100-40gb") == RooflineLatency(OPT, A100)
    with pytest.raises(ConfigError, match="needs the path"):
        make_latency_model("fitted", "opt-13b", "a100-40gb")
    with pytest.raises(ConfigError, match="unknown latency model 'vidur'"):
        make_latency_model("vidur", "opt-13b", "a100-40gb")


def test_importing_the_simulator_stays_light():
    code = ("import sys, simulator, simulator.presets, simulator.timing.step_latency; "
            "print([m for m in ('torch', 'triton', 'matplotlib') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

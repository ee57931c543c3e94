"""Calibration (fit a profile to measured steps), measured step times, and the sim-vs-real comparison."""
import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from simulator.config import SimConfig
from simulator.core.errors import ConfigError
from simulator.core.models import get_model
from simulator.loop import simulate
from simulator.presets import get_gpu
from simulator.timing.calibrate import calibrate, fit_quality
from simulator.timing.compare import (
    RunTables,
    compare_runs,
    memory_difference,
    per_step_times,
    rel_error_stats,
    request_mismatch,
    stalls,
)
from simulator.timing.measured_steps import MeasuredSteps
from simulator.timing.step_latency import STALL_FACTOR, STALL_MIN_S, FittedLatency, load_fitted
from traces import SyntheticConfig, generate_trace

TRUE = (2e-3, 3e-6, 1e-9, 2e-8, 5e-4)  # overhead, per token, per attention pair, per KV token, per decode
CONFIG = {"source": "replay", "model": "tiny", "device": "cpu", "backend": "torch", "dtype": "float32",
          "block_size": 16}


def _steps(rng: np.random.Generator, num: int, coefs=TRUE, noise: float = 0.02) -> pd.DataFrame:
    """Steps shaped like a serving run's: many decode batches, some with a prefill, timed by `coefs`."""
    batch = rng.integers(1, 40, num)
    ctx = rng.integers(20, 1500, num) * batch
    prefill = np.where(rng.random(num) < 0.3, rng.integers(16, 1500, num), 0)
    tokens = batch + prefill
    pairs = ctx + prefill * prefill
    kv = ctx + prefill
    exact = FittedLatency(get_model("tiny"), get_gpu("cpu"), coefs).step_times(tokens, pairs, kv, batch)
    dt = exact * (1 + noise * rng.standard_normal(num))
    return pd.DataFrame({"step": np.arange(num), "t_s": np.cumsum(dt), "dt_s": dt,
                         "num_batched_tokens": tokens, "attn_pairs": pairs, "kv_tokens_read": kv,
                         "num_decode_seqs": batch})


def test_fit_recovers_known_coefficients_from_noisy_steps():
    rng = np.random.default_rng(0)
    runs = [("a", CONFIG, _steps(rng, 1500)), ("b", CONFIG, _steps(rng, 1500))]
    profile = calibrate(runs)
    np.testing.assert_allclose(profile.coefficients, TRUE, rtol=0.1)
    fit = profile.meta["fit"]
    assert fit["num_steps"] == 3000 and fit["r2"] > 0.99
    assert 0.005 < fit["median_abs_rel_error"] < 0.03  # the 2% noise, not less, not much more
    assert profile.model.name == "tiny" and profile.gpu.name == "cpu" and profile.block_size == 16
    assert profile.meta["fitted_on"] == ["a", "b"]


def test_fit_without_noise_is_exact_and_clips_negative_coefficients():
    rng = np.random.default_rng(1)
    exact = calibrate([("a", CONFIG, _steps(rng, 200, noise=0.0))])
    np.testing.assert_allclose(exact.coefficients, TRUE, rtol=1e-6)
    assert exact.meta["fit"]["r2"] == pytest.approx(1.0)
    no_pairs = (TRUE[0], TRUE[1], 0.0, TRUE[3], TRUE[4])
    fitted = calibrate([("a", CONFIG, _steps(rng, 400, coefs=no_pairs, noise=0.01))])
    assert all(c >= 0 for c in fitted.coefficients)
    assert fitted.coefficients[2] < 1e-11


def test_profile_round_trips_through_json_and_checks_block_size(tmp_path):
    profile = calibrate([("a", CONFIG, _steps(np.random.default_rng(2), 100))])
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile.to_dict()))
    again = load_fitted(path, get_model("tiny"), get_gpu("cpu"), block_size=16)
    assert again == profile and again.meta["fit"] == profile.meta["fit"]
    with pytest.raises(ConfigError, match="fitted for block size 16, not 32"):
        load_fitted(path, block_size=32)
    with pytest.raises(ConfigError, match="fitted for model 'tiny', not 'llama-3-8b'"):
        load_fitted(path, get_model("llama-3-8b"))


@pytest.mark.parametrize("change,match", [
    (lambda c, s: ({**c, "block_size": 32}, s), "block_size 32 differs"),
    (lambda c, s: ({**c, "source": None}, s), "not a measured run"),
    (lambda c, s: (c, s.drop(columns="attn_pairs")), "no column 'attn_pairs'"),
    (lambda c, s: ({**c, "device": "cuda:0"}, s), "device 'cuda:0' differs"),
])
def test_inconsistent_runs_are_refused(change, match):
    steps = _steps(np.random.default_rng(3), 100)
    config, bad = change(CONFIG, steps)
    with pytest.raises(ConfigError, match=match):
        calibrate([("first", CONFIG, steps), ("second", config, bad)])


def test_too_few_steps_and_gpu_runs_without_a_preset_are_errors():
    steps = _steps(np.random.default_rng(4), 30)
    steps.loc[12:, "num_batched_tokens"] = 0  # idle-looking rows do not count
    with pytest.raises(ConfigError, match="too few steps to fit: 12 steps"):
        calibrate([("a", CONFIG, steps)])
    with pytest.raises(ConfigError, match="name its GPU preset with --gpu"):
        calibrate([("a", {**CONFIG, "device": "cuda:0"}, _steps(np.random.default_rng(5), 100))])
    gpu = calibrate([("a", {**CONFIG, "device": "cuda:0"}, _steps(np.random.default_rng(5), 100))],
                    gpu="h100-80gb")
    assert gpu.gpu.name == "h100-80gb"
    with pytest.raises(ConfigError, match="at least one"):
        calibrate([])


def test_fit_quality_measures_a_wrong_profile():
    steps = _steps(np.random.default_rng(6), 300, noise=0.0)
    slow = FittedLatency(get_model("tiny"), get_gpu("cpu"), tuple(2 * c for c in TRUE))
    q = fit_quality(slow, steps)
    assert q["median_abs_rel_error"] == pytest.approx(1.0) and q["total_time_rel_error"] == pytest.approx(1.0)


def test_rel_error_stats_and_per_step_times():
    s = rel_error_stats(np.array([1.1, 2.0, np.nan, 5.0]), np.array([1.0, 2.5, 1.0, 0.0]))
    assert s["count"] == 2 and s["median_abs"] == pytest.approx(0.15) and s["median"] == pytest.approx(-0.05)
    memory = pd.DataFrame({"step": [0, 0, 1, 4], "num_steps": [0, 1, 3, 1], "dt_s": [9.0, 1.0, 6.0, 0.5]})
    assert per_step_times(memory).tolist() == [1.0, 2.0, 2.0, 2.0, 0.5]


def _trace(**kw):
    """Two Poisson bursts with an idle gap between them (steps, idle rows and arrivals mid-run)."""
    base = dict(num_requests=30, arrival="poisson", rate=100.0, lengths="uniform", prompt_range=(5, 60),
                output_range=(2, 40), max_model_len=128, seed=3)
    trace = generate_trace(SyntheticConfig(**{**base, **kw}))
    trace.loc[len(trace) // 2:, "arrival_s"] += 5.0
    return trace


CFG = SimConfig(model="tiny", gpu="cpu", allocator="paged", capacity_tokens=400, block_size=16,
                max_model_len=128, mode="step", enable_prefix_caching=False)


def test_runs_of_other_requests_are_not_compared_as_one_workload():
    trace = _trace()
    run = simulate(trace, CFG)
    tables = RunTables(run.summary, run.requests, run.memory)
    assert request_mismatch(tables, tables) is None
    fewer = RunTables(run.summary, run.requests.iloc[: len(trace) // 2], run.memory)
    assert "different requests" in request_mismatch(tables, fewer)
    assert request_mismatch(tables, fewer, partial=True) is None  # a run stopped early lacks some ids
    other = run.requests.assign(output_len=run.requests["output_len"] + 1)
    message = request_mismatch(tables, RunTables(run.summary, other, run.memory), partial=True)
    assert f"{len(trace):,} of the {len(trace):,} request ids in common have other prompt" in message


def test_measured_step_times_drive_the_clock_and_keep_the_decisions():
    trace = _trace()
    reference = simulate(trace, CFG)
    measured = MeasuredSteps.from_memory(reference.memory)
    assert reference.summary["num_preemptions"] > 0  # a pool tight enough for decisions to matter
    assert (reference.memory["num_steps"] == 0).sum() > 0  # and an idle gap
    # The run's own step times: the same run exactly.
    again = simulate(trace, CFG, step_times=measured)
    pd.testing.assert_frame_equal(again.memory, reference.memory)
    pd.testing.assert_frame_equal(again.requests, reference.requests)
    result = compare_runs(RunTables(again.summary, again.requests, again.memory),
                          RunTables(reference.summary, reference.requests, reference.memory))
    assert result["memory"]["equal"] and result["latency"]["e2e_s"]["median_abs"] == 0.0
    # Slower steps (a fast-mode config is forced to step mode): each step takes its given time (arrivals
    # then fall elsewhere relative to steps, so decisions may change).
    slow = MeasuredSteps(tuple(2 * t for t in measured.start_s), tuple(2 * d for d in measured.dt_s))
    slowed = simulate(trace, dataclasses.replace(CFG, mode="fast"), step_times=slow)
    steps = slowed.memory[slowed.memory["num_steps"] > 0]
    n = len(steps)
    assert (steps["num_steps"] == 1).all() and 0 < n <= len(slow)
    np.testing.assert_array_equal(steps["dt_s"], slow.dt_s[:n])
    # A step never starts before its recorded start, nor before the arrival an idle gap waited for.
    assert (steps["t_s"].to_numpy() >= np.asarray(slow.start_s[:n])).all()
    assert steps["t_s"].iloc[0] == slow.start_s[0]
    assert slowed.summary["sim_duration_s"] > 1.5 * reference.summary["sim_duration_s"] - 5.0


def test_measured_steps_errors():
    trace = _trace(num_requests=10)
    reference = simulate(trace, CFG)
    short = MeasuredSteps.from_memory(reference.memory.iloc[:5])
    with pytest.raises(ConfigError, match="needs step 5 but only 5 were measured; the runs diverged"):
        simulate(trace, CFG, step_times=short)
    fast = simulate(trace, SimConfig(model="tiny", gpu="cpu", capacity_tokens=4000, block_size=16,
                                     max_model_len=128, enable_prefix_caching=False))
    if (fast.memory["num_steps"] > 1).any():
        with pytest.raises(ConfigError, match="multi-step rows"):
            MeasuredSteps.from_memory(fast.memory)
    with pytest.raises(ConfigError, match="2 step starts, 1 durations"):
        MeasuredSteps((0.0, 1.0), (1.0,))


def test_memory_difference_finds_a_changed_step():
    a = simulate(_trace(num_requests=10), CFG).memory
    b = a.copy()
    busy = np.flatnonzero(b["num_steps"].to_numpy() == 1)
    b.loc[busy[3], "free"] += 0.25
    d = memory_difference(a, b)
    assert d["step_aligned"] and not d["equal"] and d["num_steps_differing"] == 1
    assert d["max_abs_difference"]["free"] == pytest.approx(0.25)
    assert memory_difference(a, a)["equal"]


SIX = (*TRUE, 1.5e-3)  # and per sqrt(decode sequences): a batch's per-sequence cost falls as it grows


def test_the_sqrt_decode_term_is_fitted_only_when_asked_and_recovered():
    rng = np.random.default_rng(6)
    steps = [("a", CONFIG, _steps(rng, 400, coefs=SIX, noise=0.0))]
    six = calibrate(steps, sqrt_decode=True)
    np.testing.assert_allclose(six.coefficients, SIX, rtol=1e-6)
    assert six.to_dict()["coefficients"]["s_per_sqrt_decode_seq"] == pytest.approx(SIX[5], rel=1e-6)
    five = calibrate(steps)
    assert len(five.coefficients) == 5 and five.meta["fit"]["r2"] < six.meta["fit"]["r2"]
    # The relative objective keeps the measured total with six terms too.
    noisy = calibrate([("a", CONFIG, _steps(rng, 600, coefs=SIX, noise=0.2))], relative=True,
                      sqrt_decode=True)
    assert noisy.meta["fit"]["total_time_rel_error"] == pytest.approx(0.0, abs=1e-9)


SEVEN = (*SIX, 9e-3)  # and per step that prefills: a GPU's eager prefill against its graphed decodes


def test_the_prefill_step_term_is_fitted_only_when_asked_and_recovered():
    rng = np.random.default_rng(16)
    steps = [("a", CONFIG, _steps(rng, 400, coefs=SEVEN, noise=0.0))]
    seven = calibrate(steps, sqrt_decode=True, prefill_step=True)
    np.testing.assert_allclose(seven.coefficients, SEVEN, rtol=1e-6)
    assert seven.to_dict()["coefficients"]["s_per_prefill_step"] == pytest.approx(SEVEN[6], rel=1e-6)
    six = calibrate(steps, sqrt_decode=True)
    assert len(six.coefficients) == 6 and six.meta["fit"]["r2"] < seven.meta["fit"]["r2"]
    # Without the sqrt term the sixth coefficient is held at 0, and the seventh still recovered.
    no_sqrt = (*TRUE, 0.0, 9e-3)
    fitted = calibrate([("a", CONFIG, _steps(rng, 400, coefs=no_sqrt, noise=0.0))], prefill_step=True)
    np.testing.assert_allclose(fitted.coefficients, no_sqrt, rtol=1e-6, atol=1e-15)


def test_only_steps_that_prefill_pay_the_prefill_step_term():
    six = FittedLatency(get_model("tiny"), get_gpu("cpu"), SIX)
    seven = FittedLatency(get_model("tiny"), get_gpu("cpu"), SEVEN)
    # (tokens, pairs, kv, decode seqs): decode only, prefill only, mixed, recompute's prefill_time
    for tokens, pairs, kv, decode, pays in ((8, 900, 900, 8, False), (300, 90_000, 300, 0, True),
                                            (308, 90_900, 1200, 8, True)):
        extra = seven.step_time(tokens, pairs, kv, decode) - six.step_time(tokens, pairs, kv, decode)
        assert extra == pytest.approx(SEVEN[6] if pays else 0.0, abs=1e-15)
    assert seven.prefill_time(300) - six.prefill_time(300) == pytest.approx(SEVEN[6])


def test_runs_with_and_without_cuda_graphs_are_not_fitted_together():
    rng = np.random.default_rng(17)
    graphs, eager = dict(CONFIG, enforce_eager=False), dict(CONFIG, enforce_eager=True)
    with pytest.raises(ConfigError, match="enforce_eager True differs from a's False"):
        calibrate([("a", graphs, _steps(rng, 100)), ("b", eager, _steps(rng, 100))])
    assert calibrate([("a", graphs, _steps(rng, 100))]).meta["enforce_eager"] is False


@pytest.mark.parametrize("coefs", [SIX, SEVEN], ids=["six", "seven"])
def test_six_and_seven_term_profiles_round_trip_and_time_scalar_and_vector_alike(tmp_path, coefs):
    profile = calibrate([("a", CONFIG, _steps(np.random.default_rng(7), 300, coefs=coefs))], sqrt_decode=True,
                        prefill_step=len(coefs) == 7)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile.to_dict()))
    loaded = load_fitted(path)
    assert loaded.coefficients == profile.coefficients and len(loaded.coefficients) == len(coefs)
    steps = _steps(np.random.default_rng(8), 500, coefs=coefs)
    cols = [steps[c].to_numpy()
            for c in ("num_batched_tokens", "attn_pairs", "kv_tokens_read", "num_decode_seqs")]
    vector = loaded.step_times(*cols)
    scalar = [loaded.step_time(int(t), int(p), int(k), int(d)) for t, p, k, d in zip(*cols, strict=True)]
    np.testing.assert_array_equal(vector, scalar)  # spans (vector) and steps (scalar) must agree to the bit
    # A sixth coefficient without the fifth is not a profile this code writes: it is read as four.
    data = profile.to_dict()
    del data["coefficients"]["s_per_decode_seq"]
    assert len(FittedLatency.from_dict(data).coefficients) == 4


@pytest.mark.parametrize("coefs", [SIX, SEVEN], ids=["six", "seven"])
def test_fast_mode_equals_step_mode_under_six_and_seven_term_profiles(tmp_path, coefs):
    path = tmp_path / "profile.json"
    profile = FittedLatency(get_model("tiny"), get_gpu("cpu"), coefs, block_size=16)
    path.write_text(json.dumps(profile.to_dict()))
    trace = generate_trace(SyntheticConfig(num_requests=120, rate=30, lengths="sharegpt", max_model_len=2048,
                                           seed=9))
    cfg = SimConfig(model="tiny", gpu="cpu", capacity_tokens=20000, block_size=16, max_model_len=2048,
                    latency=str(path))
    fast, step = simulate(trace, cfg), simulate(trace, dataclasses.replace(cfg, mode="step"))
    for col in ("admitted_s", "first_token_s", "finish_s"):
        np.testing.assert_array_equal(fast.requests[col].to_numpy(), step.requests[col].to_numpy(),
                                      err_msg=col)
    assert (fast.memory["num_steps"] > 1).any()  # spans ran


def test_stalls_are_steps_far_over_their_price_by_a_real_margin():
    predicted = np.array([0.01, 0.01, 0.002, 0.01, 0.003])
    # step 1: 40x and 0.39 s over; step 2: 20x but only 0.038 s over (a fast step's jitter); step 4: just
    # under the factor.
    measured = np.array([0.011, 0.40, 0.040, 0.009, STALL_FACTOR * 0.003 - 1e-6])
    got = stalls(np.array([10, 11, 12, 13, 14]), predicted, measured)
    assert got["count"] == 1 and got["steps"] == [11]
    assert got["excess_s"] == pytest.approx(0.39)
    assert got["busy_share"] == pytest.approx(0.39 / measured.sum())
    assert STALL_MIN_S > 0.040 - 0.002  # the jitter case is excluded by the margin, not the factor
    assert stalls(np.arange(5), predicted, predicted)["count"] == 0


def test_stalls_are_left_out_of_the_fit_and_counted():
    rng = np.random.default_rng(18)
    steps = _steps(rng, 500, coefs=SEVEN, noise=0.0)
    stalled = [0, 7, 120, 333]  # first uses of new kernel variants: half a second each
    steps.loc[stalled, "dt_s"] += 0.5
    profile = calibrate([("a", CONFIG, steps)], relative=True, sqrt_decode=True, prefill_step=True)
    np.testing.assert_allclose(profile.coefficients, SEVEN, rtol=1e-6)  # as if they never happened
    assert profile.meta["stalls_excluded"]["count"] == len(stalled)
    assert profile.meta["stalls_excluded"]["seconds"] == pytest.approx(steps.loc[stalled, "dt_s"].sum())
    assert profile.meta["fit"]["num_steps"] == 500 - len(stalled)
    # Kept in, they would price every step ~17 % long (the relative fit is scaled to the measured total).
    clean = calibrate([("a", CONFIG, _steps(np.random.default_rng(18), 500, coefs=SEVEN, noise=0.0))],
                      relative=True, sqrt_decode=True, prefill_step=True)
    assert clean.meta["stalls_excluded"] == {"count": 0, "seconds": 0.0}

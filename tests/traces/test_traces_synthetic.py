"""Synthetic generators: determinism, arrival processes, length presets, shared prefixes, rescale_rate."""
from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from traces import SyntheticConfig, TraceError, generate_trace, load_trace, rescale_rate
from traces.errors import TraceFieldError
from traces.lengths import LENGTH_PRESETS, calibrate, sample_preset
from traces.prefix import block_keys
from traces.stats import trace_info
from traces.synthetic import gamma_gaps


def gen(**kw) -> pd.DataFrame:
    """A synthetic trace from keyword overrides of SyntheticConfig."""
    return generate_trace(SyntheticConfig(**kw))


def test_same_seed_same_trace_different_seed_different():
    kw = dict(num_requests=500, arrival="gamma", rate=3.0, cv=2.0, num_prefix_groups=3, prefix_len=64,
              prefix_fraction=0.5)
    a, b, c = gen(seed=7, **kw), gen(seed=7, **kw), gen(seed=8, **kw)
    pd.testing.assert_frame_equal(a, b)
    assert not a["arrival_s"].equals(c["arrival_s"])
    assert not a["prompt_len"].equals(c["prompt_len"])
    assert not a["prefix_blocks"].equals(c["prefix_blocks"])


def test_arrivals_do_not_depend_on_the_length_distribution():
    a = gen(num_requests=300, seed=5, lengths="sharegpt")
    b = gen(num_requests=300, seed=5, lengths="uniform")
    assert a["arrival_s"].equals(b["arrival_s"])
    assert not a["prompt_len"].equals(b["prompt_len"])


def test_poisson_rate_and_exponential_gaps():
    df = gen(num_requests=40_000, arrival="poisson", rate=4.0, lengths="fixed", seed=1)
    gaps = np.diff(df["arrival_s"].to_numpy())
    assert df["arrival_s"].iloc[0] == 0.0
    assert trace_info(df)["mean_rate_per_s"] == pytest.approx(4.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_gaps_have_the_requested_cv(cv):
    df = gen(num_requests=40_000, arrival="gamma", rate=2.0, cv=cv, lengths="fixed", seed=2)
    gaps = np.diff(df["arrival_s"].to_numpy())
    assert 1.0 / gaps.mean() == pytest.approx(2.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


@pytest.mark.parametrize("shape", [1e-4, 1e-2])
def test_gamma_gaps_that_underflow_to_zero_are_warned_about(shape):
    warnings: list[str] = []
    gaps = gamma_gaps(np.random.default_rng(3), shape, 2.0, 2_000, warnings)
    zeros = int((gaps == 0).sum())
    assert (2 * zeros > len(gaps)) == (shape == 1e-4)  # most draws of shape 1e-4 are below the float range
    assert len(warnings) == (1 if shape == 1e-4 else 0)
    assert all(f"{zeros:,} of 2,000 gaps underflow to 0 s" in w for w in warnings)
    # the trace generator warns through the same draw
    trace_warnings: list[str] = []
    generate_trace(SyntheticConfig(num_requests=200, arrival="gamma", rate=2.0, cv=shape ** -0.5,
                                   lengths="fixed"), warnings=trace_warnings)
    assert len([w for w in trace_warnings if "underflow" in w]) == len(warnings)


def test_burst_puts_everything_at_zero():
    df = gen(num_requests=50, arrival="burst", lengths="fixed")
    assert (df["arrival_s"] == 0).all()
    assert trace_info(df)["mean_rate_per_s"] is None


@pytest.mark.parametrize("name", ["sharegpt", "alpaca"])
@pytest.mark.parametrize("max_model_len", [2048, 4096])
def test_presets_match_published_means_after_clipping(name, max_model_len):
    preset = LENGTH_PRESETS[name]
    df = gen(num_requests=200_000, lengths=name, max_model_len=max_model_len, seed=11)
    prompt, output = df["prompt_len"].to_numpy(), df["output_len"].to_numpy()
    assert prompt.mean() == pytest.approx(preset.mean_prompt, rel=0.03)
    assert output.mean() == pytest.approx(preset.mean_output, rel=0.03)
    assert (prompt + output).max() <= max_model_len
    assert prompt.min() >= 1 and output.min() >= 1
    # Heavy tails: the top percent lies far above the median, the maximum far above the mean.
    for values in (prompt, output):
        assert np.percentile(values, 99) > 3 * np.median(values)
        assert values.max() > 6 * values.mean()


def test_sharegpt_tail_actually_reaches_the_clip():
    prompt, output = sample_preset("sharegpt", 100_000, 2048, np.random.default_rng(3))
    assert ((prompt + output) == 2048).sum() > 100


def test_preset_too_large_for_max_model_len_is_refused():
    with pytest.raises(TraceError, match="max_model_len 300 is too small"):
        calibrate(LENGTH_PRESETS["sharegpt"], 300)


def test_fixed_and_uniform_lengths():
    fixed = gen(num_requests=20, lengths="fixed", prompt_len=33, output_len=7)
    assert set(fixed["prompt_len"]) == {33} and set(fixed["output_len"]) == {7}
    uni = gen(num_requests=5000, lengths="uniform", prompt_range=(10, 20), output_range=(1, 3), seed=4)
    assert set(uni["prompt_len"]) == set(range(10, 21))
    assert set(uni["output_len"]) == {1, 2, 3}


def test_resample_draws_existing_pairs_that_fit(tmp_path):
    warnings: list[str] = []
    df = generate_trace(SyntheticConfig(num_requests=3000, lengths="resample", lengths_from="azure-conv",
                                        max_model_len=2048, seed=9), warnings=warnings)
    src = load_trace("azure-conv")
    fitting = src[src["prompt_len"] + src["output_len"] <= 2048]
    pairs = set(zip(fitting["prompt_len"], fitting["output_len"], strict=True))
    assert set(zip(df["prompt_len"], df["output_len"], strict=True)) <= pairs
    assert any("left out" in w and "2048" in w for w in warnings)


def test_resample_from_a_given_frame():
    source = pd.DataFrame({"prompt_len": [5, 6], "output_len": [1, 2]})
    df = generate_trace(SyntheticConfig(num_requests=200, lengths="resample", lengths_from="mine"),
                        source=source)
    assert set(zip(df["prompt_len"], df["output_len"], strict=True)) == {(5, 1), (6, 2)}


def test_shared_prefix_groups():
    cfg = SyntheticConfig(num_requests=4000, num_prefix_groups=3, prefix_len=100, prefix_fraction=0.25,
                          prefix_block_size=16, seed=12)
    df = generate_trace(cfg)
    keyed = df[df["prefix_blocks"].map(len) > 0]
    assert len(keyed) / len(df) == pytest.approx(0.25, abs=0.03)
    assert (keyed["prefix_blocks"].map(len) == 100 // 16).all()
    assert keyed["prefix_blocks"].map(tuple).nunique() == 3
    assert (keyed["prompt_len"] > 100).all()
    assert (df["prompt_len"] + df["output_len"]).max() <= cfg.max_model_len
    assert (df["prefix_block_size"] == 16).all()
    # The keys are usable at the simulator's block size: same group, same keys.
    first = keyed.iloc[0]
    same = keyed[keyed["prefix_blocks"].map(tuple) == tuple(first["prefix_blocks"])]
    keys = {tuple(block_keys(r.prefix_blocks, 16, 8, r.prompt_len)) for r in same.itertuples()}
    assert len(keys) == 1 and len(next(iter(keys))) == 2 * (100 // 16)


def test_n_and_beam_width_columns():
    df = gen(num_requests=10, n=4, beam_width=2)
    assert set(df["n"]) == {4} and set(df["beam_width"]) == {2}


@pytest.mark.parametrize(("field", "value", "match"), [
    ("num_requests", 0, "num_requests"),
    ("arrival", "uniform", "arrival"),
    ("rate", 0.0, "rate"),
    ("lengths", "bogus", "lengths"),
    ("n", 0, "'n'"),
    ("prefix_len", 8, "prefix_len"),
])
def test_bad_config_is_refused(field, value, match):
    kw = {"num_prefix_groups": 2, "prefix_len": 64, "prefix_fraction": 0.5}
    kw[field] = value
    with pytest.raises(TraceError, match=match):
        SyntheticConfig(**kw)


def test_fixed_lengths_that_exceed_max_model_len_are_refused():
    with pytest.raises(TraceError, match="max_model_len"):
        SyntheticConfig(lengths="fixed", prompt_len=2000, output_len=100)
    with pytest.raises(TraceError, match="lengths_from"):
        SyntheticConfig(lengths="resample")


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SyntheticConfig().rate = 3.0


def test_rescale_rate():
    df = gen(num_requests=1000, rate=1.0, lengths="fixed", seed=3)
    out = rescale_rate(df, 8.0)
    assert trace_info(out)["mean_rate_per_s"] == pytest.approx(8.0, rel=1e-12)
    gaps_before, gaps_after = np.diff(df["arrival_s"]), np.diff(out["arrival_s"])
    np.testing.assert_allclose(gaps_after / gaps_before, gaps_after[0] / gaps_before[0])
    assert out["prompt_len"].equals(df["prompt_len"])
    assert trace_info(df)["mean_rate_per_s"] != pytest.approx(8.0, rel=0.1)  # the input is untouched


@pytest.mark.parametrize(("frame", "rate", "match"), [
    (gen(num_requests=5, arrival="burst", lengths="fixed"), 1.0, "same time"),
    (gen(num_requests=1, lengths="fixed"), 1.0, "fewer than 2"),
    (gen(num_requests=5, lengths="fixed"), 0.0, "rate must be > 0"),
])
def test_rescale_rate_refuses_what_it_cannot_do(frame, rate, match):
    with pytest.raises(TraceError, match=match):
        rescale_rate(frame, rate)


@pytest.mark.parametrize("field,value,why", [("seed", -1, ">= 0"), ("num_requests", 2.5, "an integer"),
                                             ("n", True, "an integer"), ("prompt_len", "8", "an integer")])
def test_a_setting_of_the_wrong_kind_is_refused_naming_the_field(field, value, why):
    with pytest.raises(TraceFieldError, match=f"field '{field}': must be {why}"):
        SyntheticConfig(**{field: value})

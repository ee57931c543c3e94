"""simulator.metrics: vllm-bench style statistics from a per-request table."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagelab.column_stats import GapHistogram
from simulator.metrics import (
    bench_metrics,
    latency_stats,
    overload_warning,
    peak_metrics,
    queue_lengths,
    rejection_warning,
    request_batches,
)
from simulator.peaks import Seconds, per_second
from simulator.slo import parse_goodput


def table(rows: list[tuple]) -> pd.DataFrame:
    """A request table from (arrival, admitted, first_token, finish, prompt, output) rows."""
    df = pd.DataFrame(rows, columns=["arrival_s", "admitted_s", "first_token_s", "finish_s", "prompt_len",
                                     "output_len"], dtype=float)
    df["n"] = 1
    df["beam_width"] = 1
    df["rejected"] = df["admitted_s"].isna()
    df["ttft_s"] = df["first_token_s"] - df["arrival_s"]
    out = df["output_len"]
    df["tpot_s"] = np.where(out > 1, (df["finish_s"] - df["first_token_s"]) / (out - 1), np.nan)
    df["e2e_s"] = df["finish_s"] - df["arrival_s"]
    return df


NAN = float("nan")
REQS = table([(0, 0, 0.1, 1.1, 10, 11),   # ttft 100 ms, tpot 100 ms (10 gaps)
              (0, 0, 0.3, 0.5, 20, 3),    # ttft 300 ms, tpot 100 ms (2 gaps)
              (1, 1, 1.05, 1.05, 5, 1),   # ttft 50 ms, no tpot (1 token)
              (2, NAN, NAN, NAN, 9000, 5)])  # rejected


def test_counts_throughputs_and_latencies_in_ms():
    m = bench_metrics(REQS, duration_s=2.0, metrics=("ttft", "tpot", "itl", "e2el"), percentiles=(50, 99))
    assert (m["completed"], m["rejected"]) == (3, 1)
    assert m["total_output_tokens"] == 15 and m["total_input_tokens"] == 35
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 7.5
    assert m["total_token_throughput"] == 25.0
    assert m["mean_ttft_ms"] == pytest.approx(150) and m["median_ttft_ms"] == pytest.approx(100)
    assert m["mean_tpot_ms"] == pytest.approx(100)
    assert m["mean_e2el_ms"] == pytest.approx((1100 + 500 + 50) / 3)


def _gaps(*pairs: tuple[float, int]) -> GapHistogram:
    h = GapHistogram()
    for gap, count in pairs:
        h.add(gap, count)
    return h


def test_itl_pools_every_gap_of_the_run_as_vllm_does():
    # 10 gaps of 100 ms and 3 of 1 s: the mean is the total over the number of gaps, the percentiles
    # np.percentile's of the 13 pooled gaps.
    s = latency_stats(REQS, "itl", (90, 99), _gaps((0.1, 10), (1.0, 3)))
    pooled = [100] * 10 + [1000] * 3
    assert s["mean"] == pytest.approx(4000 / 13) and s["std"] == pytest.approx(np.std(pooled))
    assert s["median"] == pytest.approx(100)
    assert [s["p90"], s["p99"]] == pytest.approx([np.percentile(pooled, 90), np.percentile(pooled, 99)])
    # Two gaps of 10 ms and two of 20 ms: the median is their midpoint.
    assert latency_stats(REQS, "itl", (90,), _gaps((0.01, 2), (0.02, 2)))["median"] == pytest.approx(15)


def test_itl_is_unknown_without_the_runs_gaps():
    m = bench_metrics(REQS, 2.0, metrics=("ttft", "itl"))
    assert m["mean_ttft_ms"] == pytest.approx(150)
    assert m["mean_itl_ms"] is None and m["p99_itl_ms"] is None
    m = bench_metrics(REQS, 2.0, metrics=("itl",), gaps=_gaps((0.05, 4)))
    assert m["p99_itl_ms"] == pytest.approx(50)


def test_peak_tokens_and_requests_per_whole_second_from_the_first_finished_arrival():
    reqs = table([(0, NAN, NAN, NAN, 50, 4),            # rejected: not where the seconds start
                  (0.25, 0.25, 0.25, 1.75, 8, 7),       # tokens 0.25 s apart: 4 in second 0, 3 in second 1
                  (0.5, 0.5, 0.5, 1.5, 8, 3),           # n = 2: 2 x 2 tokens in second 0, 2 x 1 in second 1
                  (2.5, 2.5, 2.75, 2.75, 8, 1)])        # one token in second 2
    reqs.loc[2, "n"] = 2
    peaks = peak_metrics(reqs)
    assert peaks == {"max_output_tokens_per_s": 8.0, "max_concurrent_requests": 2}
    assert bench_metrics(reqs, 2.5)["max_output_tokens_per_s"] == 8.0


def _vllm_per_second(df: pd.DataFrame) -> tuple[list[float], list[int]]:
    """vLLM's peak loops (benchmarks/serve.py), request by request, over the same evenly spaced tokens."""
    done = df[df["finish_s"].notna()]
    if done.empty:
        return [], []
    start = done["arrival_s"].min()
    num_seconds = math.ceil(done["finish_s"].max() - start) + 1
    tokens, active = [0.0] * num_seconds, [0] * num_seconds
    for r in done.itertuples():
        count = max(int(r.output_len), 1)
        rel = r.first_token_s - start
        gap = (r.finish_s - start - rel) / (count - 1) if count > 1 else 0.0
        for k in range(count):
            second = int(rel + k * gap)
            if 0 <= second < num_seconds:
                tokens[second] += r.n if r.beam_width <= 1 else 1
        for second in range(int(r.arrival_s - start), int(r.finish_s - start) + 1):
            active[second] += 1
    return tokens, active


TENTHS = lambda top: st.integers(0, top).map(lambda x: x / 10)  # noqa: E731 (times on seconds' edges)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(TENTHS(300), TENTHS(50), TENTHS(200), st.integers(1, 300),
                          st.integers(1, 3), st.booleans(), st.booleans()), min_size=1, max_size=25))
def test_peaks_equal_vllms_loops(rows):
    frame = table([(a, a, a + ttft, a + ttft + decode, 1, out) if not rejected else (a, NAN, NAN, NAN, 1, out)
                   for a, ttft, decode, out, _, _, rejected in rows])
    frame["n"] = [n for *_, n, _, _ in rows]
    frame["beam_width"] = [2 if beam else 1 for *_, beam, _ in rows]
    tokens, active = _vllm_per_second(frame)
    got_tokens, got_active = per_second(lambda names: request_batches(frame, names))
    assert got_tokens.tolist() == tokens and got_active.tolist() == active
    assert peak_metrics(frame) == {"max_output_tokens_per_s": max(tokens, default=0.0),
                                   "max_concurrent_requests": max(active, default=0)}


def test_peaks_of_requests_years_apart_cost_what_their_tokens_do():
    # Tokens 1e10 s apart, and requests that last for years: counted token by token and in chunks of
    # seconds (a dense count per second would need terabytes).
    reqs = table([(0, 0, 0, 4, 1, 5),                        # tokens at 0, 1, 2, 3, 4 s
                  (0.5, 0.5, 0.5, 0.5, 1, 1),                # one token in second 0
                  (5, 5, 5, 5e11, 1, 2),                     # two tokens ~5e11 s apart
                  (1e11, 1e11, 1e11, 1.2e11, 1, 3),          # tokens at 1e11, 1.1e11, 1.2e11 s
                  (1e11 + 0.5, 1e11 + 0.5, 1e11 + 0.7, 1e11 + 0.7, 1, 1)])  # two samples in that second
    reqs.loc[4, "n"] = 2
    assert peak_metrics(reqs) == {"max_output_tokens_per_s": 3.0, "max_concurrent_requests": 3}


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, (5 << 16) - 1), st.integers(-3, 3)), min_size=1, max_size=60))
def test_chunked_seconds_count_as_numpy_does(pairs):
    index = np.array([i for i, _ in pairs], np.int64)
    weights = np.array([w for _, w in pairs], np.float64)  # token counts come as floats
    seconds = Seconds(5 << 16, np.float64)
    half = len(pairs) // 2
    seconds.add_at(index[:half], weights[:half]) if half else None
    seconds.add_at(index[half:], weights[half:])
    expect = np.zeros(5 << 16)
    np.add.at(expect, index, weights)
    np.testing.assert_array_equal(seconds.dense(), expect)
    assert seconds.max() == max(float(expect.max()), 0.0)
    assert seconds.cumulative_max() == max(int(np.cumsum(expect).max()), 0)
    ones = Seconds(5 << 16, np.int64)  # requests: +1 or -1 each
    ones.add_at(index, 1)
    np.testing.assert_array_equal(ones.dense(), np.bincount(index, minlength=5 << 16))


def test_goodput_counts_requests_within_every_slo():
    m = bench_metrics(REQS, 2.0, goodput=parse_goodput(["ttft:200", "tpot:100"]))
    assert m["request_goodput"] == 1.0  # the 100 ms and the 50 ms TTFT requests (no TPOT: passes)
    assert m["goodput_slos_ms"] == {"ttft": 200.0, "tpot": 100.0}
    m = bench_metrics(REQS, 2.0, goodput=parse_goodput(["e2el:600"]))
    assert m["request_goodput"] == 1.0  # 500 ms and 50 ms


def test_goodput_limits_with_units_count_the_same_requests():
    for ms, other in ((["ttft:200", "tpot:100"], ["ttft:0.2s", "tpot:100ms"]), (["e2el:600"], ["e2el:0.6s"]),
                      (["ttft:300"], ["ttft:0.3s"])):
        a, b = (bench_metrics(REQS, 2.0, goodput=parse_goodput(x)) for x in (ms, other))
        assert a["request_goodput"] == b["request_goodput"]
        assert a["goodput_slos_ms"] == pytest.approx(b["goodput_slos_ms"])
    # 300 ms is the second request's TTFT exactly: it counts, whichever unit the limit is written in
    assert bench_metrics(REQS, 2.0, goodput=parse_goodput(["ttft:0.3s"]))["request_goodput"] == 1.5


def test_rejection_warning_gives_reasons_and_counts():
    text = rejection_warning(REQS, max_model_len=2048, pool="6,250 blocks of 16 tokens")
    assert text.startswith("1 of 4 requests (25.0%) were rejected (1 longer than max_model_len 2,048")
    assert rejection_warning(REQS, max_model_len=10_000, pool="100 token slots").startswith(
        "1 of 4 requests (25.0%) were rejected (1 need more KV memory than the pool's 100 token slots: "
        "give a larger pool (--kv-memory-gb, --gpu-memory-utilization or a larger --gpu)")
    assert rejection_warning(REQS.iloc[:3], 2048, "100 token slots") is None


def test_a_request_whose_kv_fits_max_model_len_exactly_is_not_called_too_long():
    # prompt 1,000 + output 1,049 holds 2,048 tokens of KV (the last output token is never stored).
    reqs = REQS.assign(prompt_len=[10, 20, 30, 1000], output_len=[5, 5, 5, 1049], rejected=[0, 0, 0, 1])
    text = rejection_warning(reqs, max_model_len=2048, pool="6 blocks of 16 tokens")
    assert "1 need more KV memory than the pool's" in text and "longer than" not in text
    text = rejection_warning(reqs.assign(output_len=[5, 5, 5, 1050]), 2048, "6 blocks of 16 tokens")
    assert "1 longer than max_model_len 2,048 (prompt + output - 1): the longest needs 2,049" in text


def test_rejection_warning_names_the_fix():
    longest = int((REQS["prompt_len"] + REQS["output_len"]).max()) - 1  # the last token is never stored
    # The model allows more than the run's max_model_len: raise it, to a power of two that holds the longest.
    text = rejection_warning(REQS, max_model_len=2048, pool="6,250 blocks of 16 tokens", model_limit=32_768)
    assert f"the longest needs {longest:,}; give --max-model-len 16384 (the model allows 32,768)" in text
    # It does not: the registry checkpoints whose context holds the longest request, shortest context first.
    text = rejection_warning(REQS, max_model_len=2048, pool="6,250 blocks of 16 tokens", model_limit=2048)
    assert "use a model whose context holds it, mistral-7b-v0.1 (32,768), qwen2.5-7b (32,768)" in text
    assert "qwen3-32b (40,960) or " in text and "more (pagelab presets)" in text  # three named, then a count
    assert "llama-3-8b" not in text  # 8,192 positions: too short
    assert "tiny" not in text  # engine test models are no advice


def test_overload_warning_only_when_the_queue_keeps_growing():
    n = 200
    arrival = np.arange(n, dtype=float)
    # Service admits one request every 2 s: the queue grows linearly (overload) ...
    slow = table([(a, 2 * i, 2 * i + 0.1, 2 * i + 1, 5, 5) for i, a in enumerate(arrival)])
    assert queue_lengths(slow, np.array([100.0]))[0] == 101 - 51
    text = overload_warning(slow, duration_s=2 * n)
    assert text is not None and "overloaded" in text
    # ... one every 0.5 s keeps up: no warning.
    fast = table([(a, a + 0.5, a + 0.6, a + 1, 5, 5) for a in arrival])
    assert overload_warning(fast, duration_s=n + 1) is None
    assert not math.isnan(fast["tpot_s"].iloc[0])


def test_queue_lengths_count_directly_for_few_times_as_the_sorted_search_does():
    rng = np.random.default_rng(5)
    n = 500
    arrival = np.sort(rng.random(n) * 100)
    admitted = arrival + rng.random(n) * 20
    admitted[rng.random(n) < 0.1] = np.nan  # never admitted
    reqs = table([(a, d, d + 0.1, d + 1, 5, 5) for a, d in zip(arrival, admitted, strict=True)])
    reqs["rejected"] = rng.random(n) < 0.05  # some never-admitted rows are kept: still waiting
    many = np.linspace(-1, 130, 40)  # more than a few times: sorted per block
    few = many[[0, 7, 21, 39]]
    by_search = queue_lengths(reqs, many)
    np.testing.assert_array_equal(queue_lengths(reqs, few), by_search[[0, 7, 21, 39]])
    kept = ~reqs["rejected"].to_numpy()
    expect = [int((arrival[kept] <= t).sum() - (admitted[kept] <= t).sum()) for t in many]
    np.testing.assert_array_equal(by_search, expect)

"""simulator.slo: the one latency-limit grammar of --goodput and sweep --slo."""
from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator.slo import (
    DEFAULT_SLO,
    GOODPUT,
    METRICS,
    SLO,
    SUMMARY_PERCENTILES,
    Limit,
    LimitError,
    parse_goodput,
    parse_limit,
    parse_slo,
    starts_limit,
)

values = st.floats(min_value=0, exclude_min=True, allow_infinity=False, allow_nan=False)


@st.composite
def limits(draw, option):
    """Any limit `option` accepts."""
    metric = draw(st.sampled_from(option.metrics))
    timed = METRICS[metric].column is not None
    percentile = None if option.per_request or not timed else draw(st.sampled_from(SUMMARY_PERCENTILES))
    return Limit(metric, percentile, draw(values), draw(st.sampled_from(METRICS[metric].units)))


@given(limits(GOODPUT))
def test_goodput_limits_round_trip(limit):
    assert parse_limit(limit.format(), GOODPUT) == limit


@given(limits(SLO))
def test_slo_limits_round_trip(limit):
    assert parse_slo(limit.format()) == limit


@given(limits(SLO), st.sampled_from([":", "=", " : "]), st.booleans(), st.booleans())
def test_other_spellings_of_a_limit_read_the_same(limit, sep, upper, hyphen):
    name, value = limit.format().split(":")
    name = name.replace("_", "-") if hyphen else name
    text = f"{name}{sep}{value}"
    assert parse_slo(text.upper() if upper else text) == limit


@given(limits(SLO))
def test_seconds_and_the_written_unit_agree(limit):
    assert limit.in_unit(limit.unit) == limit.value
    assert limit.seconds == pytest.approx(limit.value / (1e3 if limit.unit.startswith("ms") else 1.0))
    assert limit.describe() == f"{limit.name} <= {limit.value:g} {limit.unit}"


def test_examples_read_as_documented():
    assert parse_limit("ttft:200ms", GOODPUT) == Limit("ttft", None, 200.0, "ms")
    assert parse_slo("ttft_p99:0.2s") == Limit("ttft", 99, 0.2, "s")
    assert parse_limit("tpot:50ms", GOODPUT).seconds == 0.05
    assert parse_limit("e2el:2s", GOODPUT).describe() == "e2el <= 2 s"
    assert parse_slo("norm_latency:0.2s/token") == parse_slo(DEFAULT_SLO) == Limit("norm_latency", None, 0.2,
                                                                                   "s/token")
    assert parse_slo("e2el_p90=1500ms").describe() == "e2el_p90 <= 1500 ms"  # `=` may stand for `:`
    assert parse_slo("tpot_p50:1e-3s").format() == "tpot_p50:0.001s"


def test_a_bare_goodput_number_is_milliseconds_as_in_vllm():
    assert parse_limit("ttft:200", GOODPUT) == parse_limit("ttft:200ms", GOODPUT)
    assert parse_limit("ttft:200", GOODPUT).seconds == 0.2


def test_goodput_items_are_split_and_the_last_of_a_metric_wins():
    got = parse_goodput(["ttft:200 tpot:0.05s,ttft:300", "e2el:2s"])
    assert [x.format() for x in got] == ["ttft:300ms", "tpot:0.05s", "e2el:2s"]
    assert parse_goodput(None) == ()


GOODPUT_REFUSED = [
    ("ttft", "expected METRIC:VALUE"),
    ("itl:5", "unknown metric 'itl'"),
    ("norm_latency:0.2s/token", "--goodput takes no 'norm_latency'"),
    ("ttft_p99:200", "each request's own value: it takes no percentile"),
    ("ttft:abc", "'abc' is not a number with a unit"),
    ("ttft:", "'' is not a number with a unit"),
    ("ttft:-1", "positive, finite"),
    ("ttft:0ms", "positive, finite"),
    ("tpot:inf", "positive, finite"),
    ("tpot:nan", "positive, finite"),
    ("ttft:200ms/token", "ttft is in s or ms, not 'ms/token'"),
    ("ttft:200us", "ttft is in s or ms, not 'us'"),
]


@pytest.mark.parametrize("text, problem", GOODPUT_REFUSED)
def test_goodput_refusals_name_the_option_the_text_and_the_forms(text, problem):
    with pytest.raises(LimitError) as exc:
        parse_limit(text, GOODPUT)
    message = str(exc.value)
    assert message.startswith(f"--goodput {text!r}: ") and problem in message
    assert "accepted: METRIC:VALUE[UNIT] with METRIC ttft, tpot or e2el" in message and "\n" not in message


SLO_REFUSED = [
    ("ttft_p99=0.2", "'0.2' has no unit: write ttft_p99:0.2s or ttft_p99:0.2ms"),
    ("ttft_p99:200", "'200' has no unit: write ttft_p99:200s or ttft_p99:200ms"),
    ("norm_latency=0.2", "has no unit: write norm_latency:0.2s/token or norm_latency:0.2ms/token"),
    ("ttft:0.2s", "ttft needs a percentile: ttft_p50, ttft_p90 or ttft_p99"),
    ("tpot_p95:10ms", "a run summary keeps no p95 of tpot"),
    ("ttft_p99.9:1s", "a run summary keeps no p99.9 of ttft"),
    ("norm_latency_p99:0.2s/token", "norm_latency in --slo is a mean over the requests"),
    ("norm_latency:0.2s", "norm_latency is in s/token or ms/token, not 's'"),
    ("ttft_p99:0.2s/token", "ttft is in s or ms, not 's/token'"),
    ("speed=3s", "unknown metric 'speed'"),
    ("norm_latency", "expected METRIC:VALUE"),
    ("ttft_p99:x", "'x' is not a number with a unit"),
    ("ttft_p99:2s,tpot_p99:1s", "give one limit"),
]


@pytest.mark.parametrize("text, problem", SLO_REFUSED)
def test_slo_refusals_name_the_option_the_text_and_the_forms(text, problem):
    with pytest.raises(LimitError) as exc:
        parse_slo(text)
    message = str(exc.value)
    assert message.startswith(f"--slo {text!r}: ") and problem in message
    assert "accepted: METRIC_pPCT:VALUE UNIT" in message and "norm_latency:0.2s/token" in message


def test_a_run_meets_an_slo_only_with_every_request_it_can_serve_finished():
    slo = parse_slo("tpot_p99:50ms")
    ok = {"tpot_s": {"p99": 0.04}, "num_finished": 10, "num_requests": 10}
    assert slo.summary_value(ok) == 0.04 and slo.met(ok)
    assert not slo.met({**ok, "num_finished": 9})
    # A request rejected as longer than max_model_len (or the pool) is rejected at every rate.
    assert slo.met({**ok, "num_finished": 9, "num_rejected": 1})
    assert not slo.met({**ok, "num_finished": 8, "num_rejected": 1})
    assert not slo.met({**ok, "tpot_s": {"p99": 0.06}})
    assert not slo.met({**ok, "tpot_s": {"p99": None}}) and math.isnan(slo.summary_value({}))
    mean = parse_slo("norm_latency:0.2s/token")
    assert mean.met({"normalized_latency_s_per_token": 0.2, "num_finished": 1, "num_requests": 1})
    assert not mean.met({"normalized_latency_s_per_token": 0.21, "num_finished": 1, "num_requests": 1})


def test_a_per_request_limit_has_no_summary_value():
    with pytest.raises(ValueError, match="each request's own value"):
        parse_limit("ttft:200", GOODPUT).summary_value({"ttft_s": {"p99": 0.1}})


def test_limits_compare_in_the_unit_they_were_written_in():
    ms = parse_limit("ttft:300", GOODPUT)
    assert ms.within(0.3) and not ms.within(0.30000000000000004)
    assert ms.column == "ttft_s" and parse_limit("e2el:1s", GOODPUT).column == "e2e_s"


@pytest.mark.parametrize("word, expected", [("ttft:200", True), ("tpot=50ms", True), ("ttft_p99:2s", True),
                                            ("norm-latency:1s/token", True), ("trace.csv", False),
                                            ("c:/traces/x.csv", False), ("200", False), ("--seed", False),
                                            ("itl:13", True), ("ttfx=0.2s", True), ("run:x", False)])
def test_words_that_start_a_limit(word, expected):
    assert starts_limit(word) is expected


@given(st.one_of(st.text(), st.text(alphabet="tpfonrmlaeg_2:=.9s/ek-0 \n", max_size=30)),
       st.sampled_from([GOODPUT, SLO]))
def test_any_text_is_a_limit_or_a_one_line_limit_error(text, option):
    try:
        limit = parse_limit(text, option)
    except LimitError as exc:
        assert "\n" not in str(exc) and str(exc).startswith(f"{option.flag} {text!r}: ")
    else:
        assert limit.metric in option.metrics and limit.value > 0

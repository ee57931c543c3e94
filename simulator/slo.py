"""Latency limits: the one grammar of `simulate/replay --goodput` and `sweep --slo`.

    METRIC[_pPCT]:VALUE[UNIT]     ttft:200ms  ttft_p99:0.2s  tpot:50ms  e2el:2s  norm_latency:0.2s/token

METRIC is `ttft` (time to first token), `tpot` (time per output token), `e2el` (end-to-end latency) or
`norm_latency` (end-to-end latency / output tokens); UNIT is `ms` or `s`, for norm_latency `ms/token` or
`s/token`. `=` may stand for `:` (`ttft_p99=0.2s`). The two options read a limit differently:

- `--goodput` limits each request's own value, as `vllm bench serve --goodput` does: no percentile, and a
  number without a unit is in milliseconds, vLLM's unit (`ttft:200` = `ttft:200ms`).
- `--slo` limits one statistic of a run's summary: a percentile the summary keeps (p50, p90, p99) of
  ttft, tpot or e2el, or the mean norm_latency. A number without a unit is refused: `--goodput` reads one
  as milliseconds while sweep limits are mostly seconds, so either guess would be 1000x off for someone.

A limit keeps its value in the unit it was written in and compares in that unit, so `--goodput ttft:200`
counts exactly the requests whose TTFT in milliseconds is at most 200.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pagelab.errors import PagelabError

TIME_UNITS = {"ms": 1e3, "s": 1.0}  # unit -> units per second
PER_TOKEN_UNITS = {"ms/token": 1e3, "s/token": 1.0}
UNITS = TIME_UNITS | PER_TOKEN_UNITS
SUMMARY_PERCENTILES = (50, 90, 99)  # what a run summary keeps of each latency (simulator/metrics.py)


class LimitError(PagelabError, ValueError):
    """A latency limit that does not follow the grammar (bad metric, unit, percentile or number)."""


@dataclass(frozen=True)
class Metric:
    """A latency a limit can bound: what it means and where requests and run summaries keep it."""

    meaning: str
    units: tuple[str, ...]  # the first is the unit it is stored in (seconds)
    column: str | None  # the per-request table's column (None: requests have no such value)
    summary_key: str  # the run summary's entry


METRICS = {
    "ttft": Metric("time to first token", ("s", "ms"), "ttft_s", "ttft_s"),
    "tpot": Metric("time per output token", ("s", "ms"), "tpot_s", "tpot_s"),
    "e2el": Metric("end-to-end latency", ("s", "ms"), "e2e_s", "e2e_s"),
    "norm_latency": Metric("mean normalized latency (end-to-end latency / output tokens, the paper's "
                           "Fig. 12)", ("s/token", "ms/token"), None, "normalized_latency_s_per_token"),
}


@dataclass(frozen=True)
class Limit:
    """`metric` (its `percentile` over the run's requests, or None) must stay <= `value` `unit`."""

    metric: str
    percentile: int | None
    value: float  # as written, in `unit`
    unit: str

    @property
    def name(self) -> str:
        """'ttft_p99', or 'ttft' for a per-request limit."""
        return self.metric if self.percentile is None else f"{self.metric}_p{self.percentile}"

    @property
    def seconds(self) -> float:
        """The bound in seconds (seconds per token for norm_latency)."""
        return self.value / UNITS[self.unit]

    @property
    def column(self) -> str | None:
        """The per-request table's column this limit reads (in seconds)."""
        return METRICS[self.metric].column

    def in_unit(self, unit: str) -> float:
        """The bound in `unit` (exactly as written when that is its own unit)."""
        return self.value if unit == self.unit else self.seconds * UNITS[unit]

    def within(self, seconds):
        """Whether values in seconds (a float or a numpy array) are within the bound."""
        return seconds * UNITS[self.unit] <= self.value

    def summary_value(self, summary: dict) -> float:
        """This limit's statistic of one run summary in seconds (NaN when the run has none)."""
        info = METRICS[self.metric]
        if self.percentile is None and info.column is not None:
            raise ValueError(f"{self.name} limits each request's own value, not a run summary's")
        v = summary.get(info.summary_key)
        if self.percentile is not None:
            v = (v or {}).get(f"p{self.percentile}")
        return float(v) if isinstance(v, (int, float)) else math.nan

    def met(self, summary: dict) -> bool:
        """Whether a run keeps the limit and finished every request it could serve (one that left requests
        unfinished has not served its load; one longer than max_model_len or the pool is rejected at every
        rate, so it takes no part); a missing statistic is a miss."""
        value = self.summary_value(summary)
        served = (summary.get("num_finished") or 0) + (summary.get("num_rejected") or 0)
        finished_all = served == summary.get("num_requests")
        return finished_all and math.isfinite(value) and bool(self.within(value))

    def describe(self) -> str:
        """'ttft_p99 <= 0.2 s', for messages and table titles."""
        return f"{self.name} <= {self.value:g} {self.unit}"

    def format(self) -> str:
        """The limit in the grammar, 'ttft_p99:0.2s'; parsing it gives this limit back."""
        text = repr(float(self.value))
        return f"{self.name}:{text.removesuffix('.0')}{self.unit}"


@dataclass(frozen=True)
class LimitOption:
    """How one command-line option reads limits: which metrics, per request or per run, bare numbers."""

    flag: str
    metrics: tuple[str, ...]
    per_request: bool  # True: each request's own value, no percentile; False: a run summary's statistic
    bare_unit: str | None  # the unit of a number written without one (None: refused)

    def forms(self) -> str:
        """The accepted forms, for error messages and help."""
        if self.per_request:
            return (f"METRIC:VALUE[UNIT] with METRIC {_or(self.metrics)} and UNIT ms or s (a bare number is "
                    f"{self.bare_unit}), e.g. ttft:200 or tpot:0.05s")
        timed = [m for m in self.metrics if METRICS[m].column is not None]
        pcts = _or([str(p) for p in SUMMARY_PERCENTILES])
        return (f"METRIC_pPCT:VALUE UNIT with METRIC {_or(timed)}, PCT {pcts} and UNIT ms or s "
                "(e.g. ttft_p99:0.2s), or norm_latency:VALUE s/token or ms/token "
                "(e.g. norm_latency:0.2s/token)")


GOODPUT = LimitOption("--goodput", ("ttft", "tpot", "e2el"), per_request=True, bare_unit="ms")
SLO = LimitOption("--slo", tuple(METRICS), per_request=False, bare_unit=None)
# 0.2 s/token: several times the unloaded normalized latency of the presets (~0.015-0.05) and far below
# the values past the knee, where the queue grows for the whole trace (seconds per token).
DEFAULT_SLO = "norm_latency:0.2s/token"

_NAME = re.compile(r"(?P<metric>.+?)(?:_p(?P<pct>[0-9]+(?:\.[0-9]*)?))?")
_VALUE = re.compile(r"(?P<number>.*?)\s*(?P<unit>[a-z/]*)", re.DOTALL)
_HEAD = re.compile(r"\s*[a-z0-9_-]+\s*[:=]", re.IGNORECASE)


def _or(words) -> str:
    """'a, b or c'."""
    words = list(words)
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _error(option: LimitOption, text: str, problem: str) -> LimitError:
    """One line: the option, the text as given, what is wrong, and what is accepted."""
    return LimitError(f"{option.flag} {text!r}: {problem}; accepted: {option.forms()}")


def parse_limit(text: str, option: LimitOption) -> Limit:
    """One `METRIC[_pPCT]:VALUE[UNIT]` as `option` reads it; LimitError names the option and the text."""
    parts = re.fullmatch(r"([^:=]*)[:=](.*)", text, re.DOTALL)
    if parts is None:
        raise _error(option, text, "expected METRIC:VALUE")
    head, value_text = parts[1].strip(), parts[2].strip()
    name = _NAME.fullmatch(head.lower().replace("-", "_"))
    metric = name["metric"] if name else head
    if metric not in option.metrics:
        known = f"{option.flag} takes no {metric!r}" if metric in METRICS else f"unknown metric {metric!r}"
        raise _error(option, text, known)
    percentile = _percentile(metric, name["pct"], option, text)
    number, unit = value_text, ""
    try:  # a bare number (inf and nan included: refused below)
        float(number)
    except ValueError:
        number, unit = _VALUE.fullmatch(value_text.lower()).group("number", "unit")
    try:
        value = float(number)
    except ValueError:
        raise _error(option, text, f"{value_text!r} is not a number with a unit") from None
    if not (math.isfinite(value) and value > 0):
        raise _error(option, text, "the limit must be a positive, finite number")
    units = METRICS[metric].units
    if not unit:
        if option.bare_unit is None:
            spelled = f"{Limit(metric, percentile, value, units[0]).name}:{number}"
            raise _error(option, text,
                         f"{number!r} has no unit: write {spelled}{units[0]} or {spelled}{units[1]}")
        unit = option.bare_unit
    if unit not in units:
        raise _error(option, text, f"{metric} is in {_or(units)}, not {unit!r}")
    return Limit(metric, percentile, value, unit)


def _percentile(metric: str, pct_text: str | None, option: LimitOption, text: str) -> int | None:
    """The PCT of `METRIC_pPCT`, checked against what `option` and the metric allow."""
    if option.per_request or METRICS[metric].column is None:
        if pct_text is not None:
            what = "each request's own value" if option.per_request else "a mean over the requests"
            raise _error(option, text, f"{metric} in {option.flag} is {what}: it takes no percentile")
        return None
    wanted = _or([f"{metric}_p{p}" for p in SUMMARY_PERCENTILES])
    if pct_text is None:
        raise _error(option, text, f"{metric} needs a percentile: {wanted}")
    if float(pct_text) not in SUMMARY_PERCENTILES:
        raise _error(option, text, f"a run summary keeps no p{pct_text} of {metric}: use {wanted}")
    return int(float(pct_text))


def parse_goodput(items: list[str] | None) -> tuple[Limit, ...]:
    """`--goodput` values (repeated, space- or comma-separated) as per-request limits, one per metric
    (the last given wins, in the order first given)."""
    limits: dict[str, Limit] = {}
    for item in (x for v in items or [] for x in v.replace(",", " ").split()):
        limit = parse_limit(item, GOODPUT)
        limits[limit.metric] = limit
    return tuple(limits.values())


def parse_slo(text: str) -> Limit:
    """`sweep --slo`: one limit on a run summary's statistic."""
    if "," in text:
        raise LimitError(f"--slo {text!r}: give one limit; accepted: {SLO.forms()}")
    return parse_limit(text, SLO)


def starts_limit(word: str) -> bool:
    """Whether a command-line word looks like a limit (`NAME:...` or `NAME=...` with a known metric
    name, or any name followed by a number), so that vLLM's `--goodput ttft:200 tpot:50` can give
    several values to one flag (and a mistyped metric is then named by the limit's own error)."""
    head = _HEAD.match(word)
    if head is None:
        return False
    name = _NAME.fullmatch(head.group().rstrip(":= \t").strip().lower().replace("-", "_"))
    known = name is not None and name["metric"] in METRICS
    return known or word[head.end():].lstrip()[:1] in tuple("0123456789.")

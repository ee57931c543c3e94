"""Seeded synthetic traces: arrival processes, length distributions, shared system prompts, n / beams.

`generate_trace(SyntheticConfig(...))` is deterministic in `seed`. Arrivals, lengths and prefix-group
membership use separate child generators of `numpy.random.default_rng(seed)`, so changing the length
distribution does not move the arrivals (and vice versa).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import pandas as pd

from traces.errors import TraceError, TraceFieldError
from traces.lengths import LENGTH_PRESETS, sample_preset
from traces.loaders import load_length_pairs
from traces.schema import LATE, MAX_ARRIVAL_S, emit, validate_trace

ARRIVALS = ("poisson", "gamma", "burst")
LENGTHS = ("fixed", "uniform", *LENGTH_PRESETS, "resample")


@dataclass(frozen=True)
class SyntheticConfig:
    """Everything that defines a synthetic trace; see docs/traces.md for the meaning of each field."""

    num_requests: int = 1000
    arrival: str = "poisson"  # poisson | gamma | burst
    rate: float = 1.0  # mean requests per second (poisson, gamma)
    cv: float = 1.0  # coefficient of variation of inter-arrival gaps (gamma)
    lengths: str = "sharegpt"  # fixed | uniform | sharegpt | alpaca | resample
    prompt_len: int = 128  # fixed
    output_len: int = 128  # fixed
    prompt_range: tuple[int, int] = (1, 1024)  # uniform, inclusive
    output_range: tuple[int, int] = (1, 1024)  # uniform, inclusive
    lengths_from: str | None = None  # resample: a trace path or bundled name
    max_model_len: int = 2048  # prompt_len + output_len never exceeds this
    num_prefix_groups: int = 0  # k shared system prompts ...
    prefix_len: int = 0  # ... of this many tokens ...
    prefix_fraction: float = 0.0  # ... each request uses one with this probability
    prefix_block_size: int = 16  # block size the prefix keys are recorded at
    n: int = 1  # parallel samples per request
    beam_width: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        """Refuse impossible settings early, naming the field (pure checks, no I/O)."""

        def bad(name: str, why: str) -> None:
            raise TraceFieldError("synthetic trace", name, why, getattr(self, name))

        for name in ("num_requests", "prompt_len", "output_len", "max_model_len", "num_prefix_groups",
                     "prefix_len", "prefix_block_size", "n", "beam_width", "seed"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                bad(name, "must be an integer")
        if self.seed < 0:  # numpy's generators take only non-negative seeds
            bad("seed", "must be >= 0")
        if self.num_requests < 1:
            bad("num_requests", "must be >= 1")
        if self.arrival not in ARRIVALS:
            bad("arrival", f"must be one of {', '.join(ARRIVALS)}")
        if self.arrival != "burst" and not self.rate > 0:
            bad("rate", "must be > 0")
        if self.arrival == "gamma" and not self.cv > 0:
            bad("cv", "must be > 0")
        if self.lengths not in LENGTHS:
            bad("lengths", f"must be one of {', '.join(LENGTHS)}")
        if self.max_model_len < 2:
            bad("max_model_len", "must be >= 2")
        if self.lengths == "fixed":
            if self.prompt_len < 1 or self.output_len < 1:
                bad("prompt_len" if self.prompt_len < 1 else "output_len", "must be >= 1")
            if self.prompt_len + self.output_len + self.prefix_len > self.max_model_len:
                bad("max_model_len", f"is smaller than prompt_len + output_len"
                    f"{' + prefix_len' if self.prefix_len else ''}")
        for name in ("prompt_range", "output_range"):
            lo, hi = getattr(self, name)
            if self.lengths == "uniform" and not 1 <= lo <= hi:
                bad(name, "needs 1 <= low <= high")
        if self.lengths == "uniform" and (self.prompt_range[1] + self.output_range[1] + self.prefix_len
                                          > self.max_model_len):
            bad("max_model_len", "is smaller than the largest prompt + output (+ prefix) of the ranges")
        if self.lengths == "resample" and not self.lengths_from:
            bad("lengths_from", "is needed to resample lengths from a trace")
        if self.num_prefix_groups < 0:
            bad("num_prefix_groups", "must be >= 0")
        if self.num_prefix_groups > 0:
            if not 0 < self.prefix_fraction <= 1:
                bad("prefix_fraction", "must be in (0, 1]")
            if self.prefix_block_size < 1:
                bad("prefix_block_size", "must be >= 1")
            if self.prefix_len < self.prefix_block_size:
                bad("prefix_len", f"is shorter than one block of {self.prefix_block_size} tokens, so nothing "
                    "could be shared")
            if self.prefix_len >= self.max_model_len - 1:
                bad("prefix_len", "leaves no room for a prompt and an output within max_model_len")
        if self.n < 1:
            bad("n", "must be >= 1")
        if self.beam_width < 1:
            bad("beam_width", "must be >= 1")


def arrivals(config: SyntheticConfig, rng: np.random.Generator,
             warnings: list[str] | None = None) -> np.ndarray:
    """Arrival times in seconds, first at 0; gaps have mean 1/rate (exponential or gamma)."""
    num_gaps = config.num_requests - 1
    if config.arrival == "burst":
        gaps = np.zeros(num_gaps)
    elif config.arrival == "poisson":
        gaps = rng.exponential(1.0 / config.rate, num_gaps)
    else:  # gamma with shape 1/cv^2 keeps the mean 1/rate and sets the spread
        gaps = gamma_gaps(rng, 1.0 / config.cv**2, config.rate, num_gaps, warnings)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def gamma_gaps(rng: np.random.Generator, shape: float, rate: float, num: int,
               warnings: list[str] | None) -> np.ndarray:
    """`num` gamma gaps of `shape` with mean 1/`rate`. Below a shape of about 1e-3 most draws fall under
    the smallest float and come out as 0 s: the arrivals then bunch far more than the shape says, which
    is warned about when it happens to most gaps."""
    gaps = rng.gamma(shape, 1.0 / (rate * shape), num)
    zeros = num - int(np.count_nonzero(gaps))
    if num and 2 * zeros > num:
        emit(warnings, f"gamma arrivals of shape {shape:.3g} (burstiness; cv {shape ** -0.5:.3g}): "
                       f"{zeros:,} of {num:,} gaps underflow to 0 s, so those requests arrive together; the "
                       f"gaps average {float(gaps.mean()):.3g} s against 1/rate = {1.0 / rate:.3g} s")
    return gaps


def lengths(config: SyntheticConfig, rng: np.random.Generator, source: pd.DataFrame | None,
            warnings: list[str] | None) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_len, output_len) arrays drawn from the configured distribution."""
    num, limit = config.num_requests, config.max_model_len
    if config.lengths == "fixed":
        return np.full(num, config.prompt_len, np.int64), np.full(num, config.output_len, np.int64)
    if config.lengths == "uniform":
        (p0, p1), (o0, o1) = config.prompt_range, config.output_range
        return rng.integers(p0, p1 + 1, num), rng.integers(o0, o1 + 1, num)
    if config.lengths in LENGTH_PRESETS:
        return sample_preset(config.lengths, num, limit, rng)
    if source is None:
        source = load_length_pairs(config.lengths_from, warnings=warnings)
    prompt = source["prompt_len"].to_numpy(np.int64)
    output = source["output_len"].to_numpy(np.int64)
    fits = prompt + output <= limit
    name = config.lengths_from or "length source"
    if not fits.any():
        raise TraceError(f"{name}: no request fits in max_model_len {limit} (prompt + output); raise it")
    if not fits.all():
        emit(warnings, f"{name}: left out {int((~fits).sum())} of {len(fits)} (prompt, output) pairs "
                       f"longer than max_model_len {limit} when resampling")
    pick = rng.integers(0, int(fits.sum()), num)
    return prompt[fits][pick], output[fits][pick]


def generate_trace(config: SyntheticConfig, *, source: pd.DataFrame | None = None,
                   warnings: list[str] | None = None) -> pd.DataFrame:
    """A canonical synthetic trace; `source` (prompt_len, output_len) overrides config.lengths_from."""
    arrival_rng, length_rng, prefix_rng = np.random.default_rng(config.seed).spawn(3)
    prompt, output = lengths(config, length_rng, source, warnings)
    frame = {
        "request_id": np.arange(config.num_requests, dtype=np.int64),
        "arrival_s": arrivals(config, arrival_rng, warnings),
        "prompt_len": prompt,
        "output_len": output,
        "n": np.full(config.num_requests, config.n, np.int64),
        "beam_width": np.full(config.num_requests, config.beam_width, np.int64),
    }
    if config.num_prefix_groups > 0:
        frame.update(_shared_prefixes(config, prompt, output, prefix_rng))
    return validate_trace(pd.DataFrame(frame), source="synthetic trace", warnings=warnings)


def _shared_prefixes(config: SyntheticConfig, prompt: np.ndarray, output: np.ndarray,
                     rng: np.random.Generator) -> dict[str, object]:
    """Put a system prompt of prefix_len tokens in front of a fraction of the prompts; their keys."""
    num, limit, length = config.num_requests, config.max_model_len, config.prefix_len
    member = rng.random(num) < config.prefix_fraction
    group = rng.integers(0, config.num_prefix_groups, num)
    # The user part is clipped again so that system prompt + user prompt + output still fit.
    user = np.minimum(prompt[member], limit - length - 1)
    prompt[member] = length + user
    output[member] = np.minimum(output[member], limit - prompt[member])
    per_group = length // config.prefix_block_size  # only full blocks of the system prompt are shareable
    keys = [list(range(g * per_group, (g + 1) * per_group)) for g in range(config.num_prefix_groups)]
    blocks = [keys[g] if m else [] for g, m in zip(group.tolist(), member.tolist(), strict=True)]
    return {"prefix_blocks": blocks, "prefix_block_size": np.full(num, config.prefix_block_size, np.int64)}


def rescale_rate(trace: pd.DataFrame, rate: float) -> pd.DataFrame:
    """A copy of a trace with arrival times scaled so the mean rate, (N - 1) / duration, equals `rate`."""
    if not rate > 0:
        raise TraceError(f"rate must be > 0 requests/s (got {rate!r})")
    arrival = trace["arrival_s"].to_numpy(np.float64)
    if len(arrival) < 2:
        raise TraceError("cannot rescale the arrival rate of a trace with fewer than 2 requests")
    duration = float(arrival.max() - arrival.min())
    if duration <= 0:
        raise TraceError("cannot rescale the arrival rate: all requests arrive at the same time (a burst)")
    out = trace.copy()
    out["arrival_s"] = (arrival - arrival.min()) * ((len(arrival) - 1) / duration / rate)
    return _within_clock(out, rate)


def respace_arrivals(trace: pd.DataFrame, rate: float, burstiness: float | None = None,
                     seed: int = 0, warnings: list[str] | None = None) -> pd.DataFrame:
    """Arrivals at mean `rate` req/s: inf puts every request at t=0 (as `vllm bench serve`); with
    `burstiness` (vLLM's gamma shape: 1 is Poisson, lower is burstier) fresh seeded gamma gaps replace the
    trace's own; otherwise the trace's gaps are scaled (`rescale_rate`)."""
    if rate == float("inf"):
        out = trace.copy()
        out["arrival_s"] = 0.0
        return out
    if burstiness is None:
        return rescale_rate(trace, rate)
    return _gamma_arrivals(trace, rate, burstiness, seed, warnings)


def _within_clock(out: pd.DataFrame, rate: float) -> pd.DataFrame:
    """`out`, re-timed at `rate`, unless its arrivals go past MAX_ARRIVAL_S."""
    last = float(out["arrival_s"].max())
    if last > MAX_ARRIVAL_S:
        raise TraceError(f"rate {rate:g} requests/s spreads {len(out):,} requests over {last:.3g} s, past "
                         f"{MAX_ARRIVAL_S:g} s ({LATE}): choose a higher rate")
    return out


def _gamma_arrivals(trace: pd.DataFrame, rate: float, burstiness: float, seed: int,
                    warnings: list[str] | None) -> pd.DataFrame:
    """A copy of the trace with seeded gamma gaps of shape `burstiness` at mean `rate`."""
    if not (burstiness > 0 and np.isfinite(burstiness)):
        raise TraceError(f"burstiness must be a finite number > 0 (got {burstiness!r})")
    if not (rate > 0 and np.isfinite(rate)):
        raise TraceError(f"rate must be > 0 requests/s (got {rate!r})")
    gaps = gamma_gaps(np.random.default_rng(seed), burstiness, rate, len(trace) - 1, warnings)
    out = trace.copy()
    out["arrival_s"] = np.concatenate(([0.0], np.cumsum(gaps)))
    return _within_clock(out, rate)

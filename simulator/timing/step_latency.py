"""Step-latency models: how long one engine step takes, given what the step computes and reads.

Every model answers the same three questions from three per-step counts (docs/calibration.md):
num_batched_tokens (prefill + decode tokens computed), attn_pairs (sum of q_len * context_len) and
kv_tokens_read (sum of context_len). A step that computes no token costs nothing.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from simulator.core.errors import ConfigError
from simulator.core.models import ModelSpec, get_model
from simulator.presets import GPUSpec, get_gpu

FEATURES = ("num_batched_tokens", "attn_pairs", "kv_tokens_read")
COEFFICIENT_NAMES = ("step_overhead_s", "s_per_token", "s_per_attn_pair", "s_per_kv_token_read")
# Optional fifth count and coefficient: decode sequences in the step, each costing s_per_decode_seq on top
# of its token (a CPU engine's per-sequence work; a GPU's decode is mostly reading KV, which kv_tokens_read
# already prices). Profiles without it keep 4 coefficients.
DECODE_FEATURE = "num_decode_seqs"
DECODE_COEFFICIENT = "s_per_decode_seq"
# Optional sixth: c5 * sqrt(decode sequences). A decode batch's per-sequence cost falls as the batch grows
# (the linear layers' matrix-vector products become matrix products, per-step work is shared), so a
# linear term alone prices batches of 2-4 short and of 16-64 long; with both terms the fit can bend
# (docs/calibration.md).
SQRT_DECODE_COEFFICIENT = "s_per_sqrt_decode_seq"
# Optional seventh: c6 for every step that prefills (num_batched_tokens > num_decode_seqs). On a GPU the
# engine replays decode-only steps as CUDA graphs and launches a prefill step's kernels one by one, so a
# prefill step pays the launch overhead that graphs hide, several times a whole graphed decode step.
# Without the term a fit on mostly-decode steps prices prefills about half short (docs/calibration.md).
PREFILL_STEP_COEFFICIENT = "s_per_prefill_step"
OPTIONAL_COEFFICIENTS = (DECODE_COEFFICIENT, SQRT_DECODE_COEFFICIENT, PREFILL_STEP_COEFFICIENT)


# A measured step at least STALL_FACTOR times its modelled price, and at least STALL_MIN_S over it, is a
# stall: a first-use kernel compile or a pause of the machine, which no model of the step's work can
# price (a Triton compile takes tens of steps' time; docs/calibration.md).
STALL_FACTOR = 10.0
STALL_MIN_S = 0.05


def stall_mask(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """Which measured steps are stalls against their modelled times (steps that computed nothing never)."""
    predicted = np.asarray(predicted, dtype=np.float64)
    measured = np.asarray(measured, dtype=np.float64)
    return (predicted > 0) & (measured >= STALL_FACTOR * predicted) & (measured - predicted >= STALL_MIN_S)


def step_features(q_lens: np.ndarray, context_lens: np.ndarray) -> tuple[int, int, int]:
    """The three step counts from per-sequence query lengths and context lengths (context includes q)."""
    q = np.asarray(q_lens, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    return int(q.sum()), int((q * ctx).sum()), int(ctx.sum())


class LatencyModel(Protocol):
    """What the scheduler needs from a step-latency model (`num_decode_seqs`: sequences that decode one
    token in the step, the rest of num_batched_tokens being prefill; models may ignore it)."""

    def step_time(self, num_batched_tokens: int, attn_pairs: int, kv_tokens_read: int,
                  num_decode_seqs: int = 0) -> float: ...

    def step_times(self, num_batched_tokens: np.ndarray, attn_pairs: np.ndarray,
                   kv_tokens_read: np.ndarray, num_decode_seqs: np.ndarray | int = 0) -> np.ndarray: ...

    def decode_times(self, num_seqs: int, context: int, num_steps: int) -> list[float]: ...

    def swap_time(self, num_blocks: int, block_size: int) -> float: ...

    def load_time(self, num_tokens: int, bandwidth: float, latency_s: float) -> float: ...

    def prefill_time(self, num_tokens: int) -> float: ...


class _SwapAndPrefill:
    """Costs shared by every latency model: swaps go over PCIe, recompute is a fresh prefill."""

    model: ModelSpec
    gpu: GPUSpec
    kv_bytes_per_token: int | None = None  # None: the KV cache is stored in the weights' dtype

    def decode_times(self, num_seqs: int, context: int, num_steps: int) -> list[float]:
        """`step_time` of each of `num_steps` decode steps of `num_seqs` sequences holding `context` tokens
        in all before the first (each step adds one per sequence): a span of steps (simulator/loop)."""
        step_time = self.step_time
        return [step_time(num_seqs, ctx, ctx, num_seqs)
                for ctx in (context + num_seqs * j for j in range(1, num_steps + 1))]

    def swap_time(self, num_blocks: int, block_size: int) -> float:
        """Seconds to move num_blocks KV blocks of block_size tokens one way over PCIe."""
        per_token = self.kv_bytes_per_token or self.model.bytes_per_token
        return num_blocks * block_size * per_token / self.gpu.pcie_bandwidth

    def load_time(self, num_tokens: int, bandwidth: float, latency_s: float) -> float:
        """Seconds to load num_tokens of KV from a tier below the GPU (CPU, disk) at `bandwidth` bytes/s."""
        per_token = self.kv_bytes_per_token or self.model.bytes_per_token
        return latency_s + num_tokens * per_token / bandwidth

    def prefill_time(self, num_tokens: int) -> float:
        """Seconds for a step that prefills one sequence of num_tokens alone (also the cost of recompute)."""
        return self.step_time(num_tokens, num_tokens * num_tokens, num_tokens)


def roofline_problem(model: ModelSpec) -> str | None:
    """Why the roofline cannot time `model` (its weights are read every step), or None."""
    if model.num_params is None:
        return (f"{model.name or 'the model'}: the roofline step time reads every weight, and its parameter "
                "count (num_params) is unknown: give a fitted latency profile (--profile or --latency "
                "PROFILE.json)")
    return None


@dataclass(frozen=True)
class _RooflineCoefficients:
    overhead_s: float
    flops_per_token: float
    flops_per_attn_pair: float
    flops_rate: float
    weight_bytes: float
    bytes_per_token: float
    bytes_rate: float


@dataclass(frozen=True)
class RooflineLatency(_SwapAndPrefill):
    """overhead + max(FLOPs / achievable FLOP/s, HBM bytes / achievable bandwidth)."""

    model: ModelSpec
    gpu: GPUSpec
    kv_bytes_per_token: int | None = None  # KV stored in another dtype than the weights (fp8 KV cache)

    @cached_property
    def _coef(self) -> _RooflineCoefficients:
        m, g = self.model, self.gpu
        problem = roofline_problem(m)
        if problem is not None:
            raise ConfigError(problem)
        weight_bytes = float(m.weight_bytes)
        return _RooflineCoefficients(
            overhead_s=g.step_overhead_s,
            # One multiply-add per parameter per token (embedding lookups overcount slightly; documented).
            flops_per_token=2.0 * m.num_params,
            # QK^T and PV: 2 FLOPs each per head dimension, per head, per layer, per (query, key) pair.
            flops_per_attn_pair=4.0 * m.num_layers * m.num_heads * m.head_dim,
            flops_rate=g.peak_flops * g.flops_efficiency,
            weight_bytes=weight_bytes,
            bytes_per_token=float(self.kv_bytes_per_token or m.bytes_per_token),
            bytes_rate=g.hbm_bandwidth * g.bandwidth_efficiency,
        )

    def terms(self, num_batched_tokens: int, attn_pairs: int, kv_tokens_read: int) -> tuple[float, float]:
        """The compute term and the memory term of a step, in seconds, before the max and the overhead."""
        c = self._coef
        compute = (c.flops_per_token * num_batched_tokens + c.flops_per_attn_pair * attn_pairs) / c.flops_rate
        # KV written by this step (one entry per computed token) plus KV read by attention.
        memory = (c.weight_bytes + c.bytes_per_token * (kv_tokens_read + num_batched_tokens)) / c.bytes_rate
        return compute, memory

    def step_time(self, num_batched_tokens: int, attn_pairs: int, kv_tokens_read: int,
                  num_decode_seqs: int = 0) -> float:
        """Seconds for one step (the roofline prices decode tokens like prefill ones)."""
        if num_batched_tokens <= 0:
            return 0.0
        compute, memory = self.terms(num_batched_tokens, attn_pairs, kv_tokens_read)
        return self._coef.overhead_s + max(compute, memory)

    def decode_times(self, num_seqs: int, context: int, num_steps: int) -> list[float]:
        """The base class's, with `step_time`'s operations inlined in one loop (the same floats): a long
        span asks for thousands of steps."""
        if num_seqs <= 0:
            return [0.0] * num_steps
        c = self._coef
        token_flops, pair_flops = c.flops_per_token * num_seqs, c.flops_per_attn_pair
        flops_rate = c.flops_rate
        weights, per_token, bytes_rate = c.weight_bytes, c.bytes_per_token, c.bytes_rate
        overhead = c.overhead_s
        out = []
        for ctx in range(context + num_seqs, context + num_seqs * num_steps + 1, num_seqs):  # num_seqs > 0
            compute = (token_flops + pair_flops * ctx) / flops_rate
            memory = (weights + per_token * (ctx + num_seqs)) / bytes_rate
            out.append(overhead + (memory if memory > compute else compute))  # max(compute, memory)
        return out

    def step_times(self, num_batched_tokens: np.ndarray, attn_pairs: np.ndarray,
                   kv_tokens_read: np.ndarray, num_decode_seqs: np.ndarray | int = 0) -> np.ndarray:
        """step_time over arrays of steps, elementwise (same float operations, same results)."""
        tokens = np.asarray(num_batched_tokens, dtype=np.float64)
        compute, memory = self.terms(tokens, np.asarray(attn_pairs, dtype=np.float64),
                                     np.asarray(kv_tokens_read, dtype=np.float64))
        return np.where(tokens > 0, self._coef.overhead_s + np.maximum(compute, memory), 0.0)


@dataclass(frozen=True)
class FittedLatency(_SwapAndPrefill):
    """c0 + c1 * tokens + c2 * attn_pairs + c3 * kv_tokens_read [+ c4 * decode seqs [+ c5 * sqrt(decode
    seqs) [+ c6 if the step prefills]]], fitted to measurements.

    `block_size` (when known) is the block size of the runs it was fitted on: paged attention's cost
    depends on it, so a profile is refused for simulations with another one. `meta` carries the fit's
    provenance and quality (written to and read from the JSON profile, never used for timing).
    """

    model: ModelSpec
    gpu: GPUSpec
    coefficients: tuple[float, ...]  # 4, +1 per OPTIONAL_COEFFICIENTS in order (at most 7)
    num_samples: int = 0
    rms_residual_s: float = 0.0
    block_size: int | None = None
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if len(self.coefficients) not in (4, 5, 6, 7) or not all(math.isfinite(c) and c >= 0
                                                                 for c in self.coefficients):
            raise ConfigError(
                f"fitted latency needs 4 to 7 finite non-negative coefficients, got {self.coefficients}")

    def step_time(self, num_batched_tokens: int, attn_pairs: int, kv_tokens_read: int,
                  num_decode_seqs: int = 0) -> float:
        """Seconds for one step."""
        if num_batched_tokens <= 0:
            return 0.0
        coefs = self.coefficients
        c0, c1, c2, c3 = coefs[:4]
        t = c0 + c1 * num_batched_tokens + c2 * attn_pairs + c3 * kv_tokens_read
        if len(coefs) > 4:
            t = t + coefs[4] * num_decode_seqs
            if len(coefs) > 5:  # the same operations in the same order as step_times: identical floats
                t = t + coefs[5] * math.sqrt(num_decode_seqs)
                if len(coefs) > 6 and num_batched_tokens > num_decode_seqs:
                    t = t + coefs[6]
        return t

    def step_times(self, num_batched_tokens: np.ndarray, attn_pairs: np.ndarray,
                   kv_tokens_read: np.ndarray, num_decode_seqs: np.ndarray | int = 0) -> np.ndarray:
        """step_time over arrays of steps, elementwise."""
        c0, c1, c2, c3 = self.coefficients[:4]
        tokens = np.asarray(num_batched_tokens, dtype=np.float64)
        times = (c0 + c1 * tokens + c2 * np.asarray(attn_pairs, dtype=np.float64)
                 + c3 * np.asarray(kv_tokens_read, dtype=np.float64))
        if len(self.coefficients) > 4:
            decode = np.asarray(num_decode_seqs, dtype=np.float64)
            times = times + self.coefficients[4] * decode
            if len(self.coefficients) > 5:
                times = times + self.coefficients[5] * np.sqrt(decode)
                if len(self.coefficients) > 6:  # + c6 or + 0.0: the same floats as step_time's
                    times = times + np.where(tokens > decode, self.coefficients[6], 0.0)
        return np.where(tokens > 0, times, 0.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; the model and GPU are stored by preset name."""
        out = {
            "kind": "fitted", "model": self.model.name, "gpu": self.gpu.name,
            "coefficients": dict(zip((*COEFFICIENT_NAMES, *OPTIONAL_COEFFICIENTS)[:len(self.coefficients)],
                                     self.coefficients, strict=True)),
            "num_samples": self.num_samples, "rms_residual_s": self.rms_residual_s,
        }
        if self.block_size is not None:
            out["block_size"] = self.block_size
        return {**out, **dict(self.meta)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], model: ModelSpec | None = None,
                  gpu: GPUSpec | None = None, source: str = "fitted profile",
                  block_size: int | None = None) -> FittedLatency:
        """Rebuild from to_dict's output; a given model/gpu/block size must match the profile's."""
        try:
            coefs = tuple(float(data["coefficients"][k]) for k in COEFFICIENT_NAMES)
            for name in OPTIONAL_COEFFICIENTS:  # each needs the ones before it
                if name not in data["coefficients"]:
                    break
                coefs += (float(data["coefficients"][name]),)
            model_name, gpu_name = str(data["model"]), str(data["gpu"])
            recorded_bs = None if data.get("block_size") is None else int(data["block_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: missing or invalid field {exc}") from None
        for given, recorded, what in ((model, model_name, "model"), (gpu, gpu_name, "gpu")):
            if given is not None and given.name != recorded:
                raise ConfigError(f"{source} was fitted for {what} {recorded!r}, not {given.name!r}")
        if block_size is not None and recorded_bs is not None and block_size != recorded_bs:
            raise ConfigError(f"{source} was fitted for block size {recorded_bs}, not {block_size}")
        known = {"kind", "model", "gpu", "coefficients", "num_samples", "rms_residual_s", "block_size"}
        return cls(model=model or get_model(model_name), gpu=gpu or get_gpu(gpu_name),
                   coefficients=coefs, num_samples=int(data.get("num_samples", 0)),
                   rms_residual_s=float(data.get("rms_residual_s", 0.0)), block_size=recorded_bs,
                   meta={k: v for k, v in data.items() if k not in known})


PROFILES_DIR = Path(__file__).parent / "profiles"


def bundled_profiles() -> list[str]:
    """Names of the profiles shipped with pagelab (simulator/timing/profiles/NAME.json)."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def resolve_profile(name_or_path: str | Path) -> Path:
    """The file of a fitted profile given by path, or by the name of a bundled one (e.g. cpu-tiny)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    bundled = PROFILES_DIR / f"{name_or_path}.json"
    if path.suffix != ".json" and bundled.is_file():
        return bundled
    raise ConfigError(f"latency profile {str(name_or_path)!r} is neither a file nor a bundled profile "
                      f"(bundled: {', '.join(bundled_profiles()) or 'none'})")


def load_fitted(path: str | Path, model: ModelSpec | None = None,
                gpu: GPUSpec | None = None, block_size: int | None = None) -> FittedLatency:
    """Read a fitted profile (a path or a bundled name) written as JSON from FittedLatency.to_dict."""
    path = resolve_profile(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read fitted latency profile ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return FittedLatency.from_dict(data, model, gpu, source=str(path), block_size=block_size)


def _make_roofline(model: ModelSpec, gpu: GPUSpec, path: str | Path | None,
                   block_size: int | None = None, kv_bytes_per_token: int | None = None) -> LatencyModel:
    return RooflineLatency(model, gpu, kv_bytes_per_token)


def _make_fitted(model: ModelSpec, gpu: GPUSpec, path: str | Path | None,
                 block_size: int | None = None, kv_bytes_per_token: int | None = None) -> LatencyModel:
    # A fitted profile's coefficients already price the KV dtype its replays stored.
    if path is None:
        raise ConfigError("latency model 'fitted' needs the path of a fitted profile (JSON)")
    return load_fitted(path, model, gpu, block_size)


LATENCY_MODELS: dict[str, Callable[..., LatencyModel]] = {
    "roofline": _make_roofline,
    "fitted": _make_fitted,
}


def check_latency(latency: str, model: ModelSpec | str, gpu: GPUSpec | str) -> None:
    """Raise the ConfigError that building the step-latency model `latency` ('roofline', or a profile's
    path or name) for `model` on `gpu` would raise: a profile fitted for another model or GPU, a roofline
    without the model's parameter count."""
    if latency != "roofline":
        make_latency_model("fitted", model, gpu, path=latency)
    elif (problem := roofline_problem(get_model(model) if isinstance(model, str) else model)) is not None:
        raise ConfigError(problem)


def make_latency_model(kind: str, model: ModelSpec | str, gpu: GPUSpec | str,
                       path: str | Path | None = None, block_size: int | None = None,
                       kv_bytes_per_token: int | None = None) -> LatencyModel:
    """Build a latency model by kind ('roofline' or 'fitted'); presets may be given by name. A fitted
    profile (a path or a bundled name) must match the model, the GPU and, if given, the block size.
    `kv_bytes_per_token`: the KV cache's own size per token when its dtype is not the weights'."""
    if kind not in LATENCY_MODELS:
        raise ConfigError(f"unknown latency model {kind!r}; valid: {', '.join(sorted(LATENCY_MODELS))}")
    model = get_model(model) if isinstance(model, str) else model
    gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
    return LATENCY_MODELS[kind](model, gpu, path, block_size, kv_bytes_per_token)

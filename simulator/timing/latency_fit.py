"""Fitting a step-latency profile (step_latency.FittedLatency) to measured steps: non-negative least
squares over the step features, optionally relative to each step's time (docs/calibration.md)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from simulator.core.errors import ConfigError
from simulator.core.models import ModelSpec
from simulator.presets import GPUSpec
from simulator.timing.step_latency import DECODE_FEATURE, FEATURES, FittedLatency


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares (scipy.optimize.nnls) on rescaled columns."""
    from scipy.optimize import nnls as scipy_nnls  # imported here: `import simulator` stays light

    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    # Columns span many orders of magnitude (1 vs attn_pairs ~1e7); scale them so the solver is well
    # conditioned.
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    sol, _ = scipy_nnls(a / scale, b)
    return sol / scale


def fit_latency(data: Mapping[str, Any], model: ModelSpec, gpu: GPUSpec,
                source: str = "measured steps", relative: bool = False,
                sqrt_decode: bool = False, prefill_step: bool = False) -> FittedLatency:
    """Fit FittedLatency by non-negative least squares to measured steps (columns FEATURES + step_s, and
    num_decode_seqs for the fifth coefficient when present, with `sqrt_decode` the sixth and with
    `prefill_step` the seventh; a seventh without the sixth fits the sixth as 0); `relative` minimises
    relative residuals, then scales the fit so that its total over the steps is their measured total."""
    columns = {}
    names = (*FEATURES, DECODE_FEATURE) if DECODE_FEATURE in data else FEATURES
    for name in (*names, "step_s"):
        if name not in data:
            raise ConfigError(f"{source}: missing column {name!r} (need {', '.join((*FEATURES, 'step_s'))})")
        col = np.asarray(data[name], dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(col) | (col < 0))
        if bad.size:
            raise ConfigError(f"{source}: row {int(bad[0])}, column {name!r}: expected a finite value >= 0, "
                              f"got {col[bad[0]]}")
        columns[name] = col
    keep = columns["num_batched_tokens"] > 0  # empty steps are defined to cost 0, not measured
    num_kept = int(keep.sum())
    if num_kept < 4:
        raise ConfigError(f"{source}: need at least 4 steps with num_batched_tokens > 0, got {num_kept}")
    features = np.column_stack([np.ones(num_kept)] + [columns[f][keep] for f in names])
    if sqrt_decode or prefill_step:
        if DECODE_FEATURE not in columns:
            term = "sqrt(decode sequences)" if sqrt_decode else "prefill step"
            raise ConfigError(f"{source}: the {term} term needs column {DECODE_FEATURE!r}")
        decode = columns[DECODE_FEATURE][keep]
        # A zero column fits to 0 (nnls leaves it at its start), so a 7-term profile without the sixth.
        features = np.column_stack([features, np.sqrt(decode) if sqrt_decode else np.zeros(num_kept)])
        if prefill_step:
            features = np.column_stack([features, columns["num_batched_tokens"][keep] > decode])
    target = columns["step_s"][keep]
    if relative:  # minimise relative residuals: every step counts alike, short decodes as much as prefills
        weight = 1.0 / np.maximum(target, 1e-9)
        coefs = nnls(features * weight[:, None], target * weight)
        # Least squares of (p - y) / y prices low: a step priced 10% long costs what one 11% short does,
        # so the fit falls a few percent short in total; one scale puts the total back (the relative
        # shape of the fit is kept).
        predicted = float((features @ coefs).sum())
        if predicted > 0:
            coefs = coefs * (float(target.sum()) / predicted)
    else:
        coefs = nnls(features, target)
    rms = float(np.sqrt(np.mean((features @ coefs - target) ** 2)))
    return FittedLatency(model=model, gpu=gpu, coefficients=tuple(float(c) for c in coefs),
                         num_samples=num_kept, rms_residual_s=rms)

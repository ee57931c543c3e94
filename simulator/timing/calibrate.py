"""Calibration: fit the step-latency model to the steps tables of measured replays, and judge the fit.

The fit is `FittedLatency` (docs/calibration.md): time = c0 + c1 * tokens + c2 * attn_pairs +
c3 * kv_tokens_read + c4 * decode seqs [+ c5 * sqrt(decode seqs) [+ c6 if the step prefills]],
non-negative least squares over every measured step that computed something.
Pure functions over tables; reading run folders is the CLI's job (cli/calibrate.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pandas as pd

from simulator.core.errors import ConfigError
from simulator.core.models import canonical_name, get_model
from simulator.presets import get_gpu
from simulator.timing.latency_fit import fit_latency
from simulator.timing.step_latency import DECODE_FEATURE, FEATURES, FittedLatency, stall_mask

# A 4-coefficient fit needs far more steps than coefficients to say anything about its error.
MIN_STEPS = 20
STEP_COLUMNS = ("dt_s", *FEATURES, DECODE_FEATURE)


def fit_quality(profile: FittedLatency, steps: pd.DataFrame) -> dict:
    """How well `profile` predicts the measured step times of `steps`: R², RMS, relative errors."""
    busy = steps[steps["num_batched_tokens"] > 0]
    measured = busy["dt_s"].to_numpy(np.float64)
    predicted = profile.step_times(*(busy[f].to_numpy(np.float64) for f in (*FEATURES, DECODE_FEATURE)))
    resid = predicted - measured
    total = float(np.sum((measured - measured.mean()) ** 2)) if len(measured) else 0.0
    rel = np.abs(resid) / np.where(measured > 0, measured, np.nan)
    return {
        "num_steps": int(len(busy)),
        "r2": float(1 - np.sum(resid**2) / total) if total > 0 else None,
        "rms_s": float(np.sqrt(np.mean(resid**2))) if len(busy) else None,
        "median_abs_rel_error": float(np.nanmedian(rel)) if len(busy) else None,
        "p90_abs_rel_error": float(np.nanpercentile(rel, 90)) if len(busy) else None,
        "total_time_rel_error": float(resid.sum() / measured.sum()) if measured.sum() > 0 else None,
    }


def check_steps(steps: pd.DataFrame, source: str) -> None:
    """A steps table must have the fit's columns; missing ones are a one-line error naming the run."""
    missing = [c for c in STEP_COLUMNS if c not in steps.columns]
    if missing:
        raise ConfigError(f"{source}: steps table has no column {missing[0]!r} (written by pagelab replay)")


def calibrate(runs: Sequence[tuple[str, dict, pd.DataFrame]], gpu: str | None = None,
              min_steps: int = MIN_STEPS, relative: bool = False,
              sqrt_decode: bool = False, prefill_step: bool = False) -> FittedLatency:
    """Fit a profile to the steps of measured runs, given as (source, config.json, steps table) each.

    All runs must share the model, device, backend, dtype, block size and CUDA-graph setting (a profile
    stands for one of each); `gpu` names the device preset (default: `cpu` for CPU runs, required for GPU
    runs).
    """
    if not runs:
        raise ConfigError("calibrate needs at least one measured run")
    keys = ("model", "device", "backend", "dtype", "block_size", "enforce_eager")
    first_source, first, _ = runs[0]
    for source, config, steps in runs:
        if config.get("source") != "replay":
            raise ConfigError(f"{source}: not a measured run (a simulation, or not a run): calibrate "
                              "takes the folders of `pagelab replay` runs")
        check_steps(steps, source)
        for key in keys:
            if config.get(key) != first.get(key):
                raise ConfigError(f"{source}: {key} {config.get(key)!r} differs from {first_source}'s "
                                  f"{first.get(key)!r}; fit one profile per model, device and block size")
    device = str(first.get("device", ""))
    if gpu is None:
        if not device.startswith("cpu"):
            raise ConfigError(f"{first_source}: measured on {device!r}; name its GPU preset with --gpu")
        gpu = "cpu"
    elif device.startswith("cpu") and get_gpu(gpu).name != "cpu":
        raise ConfigError(f"{first_source}: measured on the CPU, not on --gpu {gpu}")
    model = get_model(canonical_name(str(first["model"])))
    table = pd.concat([s for _, _, s in runs], ignore_index=True)
    busy = int((table["num_batched_tokens"] > 0).sum())
    if busy < min_steps:
        raise ConfigError(f"too few steps to fit: {busy} steps computed tokens, need at least {min_steps} "
                          "(replay more requests)")
    data = {f: table[f].to_numpy(np.float64) for f in (*FEATURES, DECODE_FEATURE)}
    data["step_s"] = table["dt_s"].to_numpy(np.float64)
    options = {"model": model, "gpu": get_gpu(gpu), "source": "steps", "relative": relative,
               "sqrt_decode": sqrt_decode, "prefill_step": prefill_step}
    fitted = fit_latency(data, **options)
    # Stalls (first-use compiles, pauses) are not step work: fitted, the relative objective's scaling to
    # the measured total would spread their seconds over every step. Refit once without them; the
    # held-out runs have none once a machine's kernels are compiled.
    stalled = stall_mask(fitted.step_times(*(data[f] for f in (*FEATURES, DECODE_FEATURE))), data["step_s"])
    if stalled.any():
        table = table[~stalled].reset_index(drop=True)
        fitted = fit_latency({k: v[~stalled] for k, v in data.items()}, **options)
    meta = {"device": device, "backend": first.get("backend"), "dtype": first.get("dtype"),
            "engine_model": first.get("model"), "enforce_eager": first.get("enforce_eager"),
            "fitted_on": [s for s, _, _ in runs],
            "objective": "relative" if relative else "absolute",
            "stalls_excluded": {"count": int(stalled.sum()),
                                "seconds": float(data["step_s"][stalled].sum())}}
    profile = FittedLatency(model=fitted.model, gpu=fitted.gpu, coefficients=fitted.coefficients,
                            num_samples=fitted.num_samples, rms_residual_s=fitted.rms_residual_s,
                            block_size=int(first["block_size"]), meta=meta)
    quality = fit_quality(profile, table)
    return dataclasses.replace(profile, meta={**meta, "fit": quality})

"""Synthetic length presets: heavy-tailed stand-ins for the ShareGPT and Alpaca datasets.

The vLLM paper's datasets are not available here, so each preset draws prompt and output lengths from
independent lognormal distributions whose spread (sigma) is a fixed choice and whose location (mu) is
solved so that the means *after* rounding and clipping equal the published ones:

    prompt = clip(rint(X), 1, max_model_len - 1)
    output = clip(rint(Y), 1, max_model_len - prompt)

The expected clipped means are computed exactly from the lognormal survival function (no sampling), so
the calibration depends only on (preset, max_model_len), never on the seed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from traces.errors import TraceError


@dataclass(frozen=True)
class LengthPreset:
    """Target means (tokens, after clipping) and lognormal spreads of one length preset."""

    mean_prompt: float
    mean_output: float
    sigma_prompt: float
    sigma_output: float
    note: str = ""


LENGTH_PRESETS: dict[str, LengthPreset] = {
    "sharegpt": LengthPreset(161.31, 337.99, 1.3, 1.0,
                             "ShareGPT means from the vLLM paper (Fig. 11); synthetic lognormal stand-in"),
    "alpaca": LengthPreset(19.31, 58.45, 0.6, 0.9,
                           "Alpaca means from the vLLM paper (Fig. 11); synthetic lognormal stand-in"),
}

_erfc = np.frompyfunc(math.erfc, 1, 1)


def _survival(x: np.ndarray, mu: float, sigma: float) -> np.ndarray:
    """P(X >= x) for X ~ LogNormal(mu, sigma)."""
    z = (np.log(x) - mu) / (sigma * math.sqrt(2.0))
    return 0.5 * _erfc(z).astype(np.float64)


def _prompt_pmf(mu: float, sigma: float, max_model_len: int) -> np.ndarray:
    """P(prompt = p) for p = 1 .. max_model_len - 1 (index p - 1)."""
    surv = _survival(np.arange(1.5, max_model_len - 1), mu, sigma)  # P(rint(X) >= k), k = 2 .. M-1
    upper = np.concatenate(([1.0], surv))
    lower = np.concatenate((surv, [0.0]))
    return upper - lower


def _mean_output(mu: float, sigma: float, pmf: np.ndarray, max_model_len: int) -> float:
    """E[output] given the prompt distribution: E[min(max(rint(Y), 1), M - p)] averaged over p."""
    surv = _survival(np.arange(1.5, max_model_len), mu, sigma)  # P(rint(Y) >= k), k = 2 .. M
    capped = 1.0 + np.concatenate(([0.0], np.cumsum(surv)))  # capped[c - 1] = E[min(max(rint Y,1), c)]
    caps = max_model_len - np.arange(1, max_model_len)  # c = M - p for p = 1 .. M-1
    return float(pmf @ capped[caps - 1])


def _solve_mu(mean_of, target: float, sigma: float, max_model_len: int, what: str) -> float:
    """The mu whose clipped mean is `target` (the clipped mean rises monotonically with mu)."""
    lo, hi = -10.0 * sigma, math.log(max_model_len) + 10.0 * sigma
    if not mean_of(lo) < target < mean_of(hi):
        raise TraceError(f"max_model_len {max_model_len} is too small for a mean {what} of {target:g} tokens "
                         f"(reachable: {mean_of(lo):.2f} .. {mean_of(hi):.2f})")
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mean_of(mid) < target else (lo, mid)
    return 0.5 * (lo + hi)


def calibrate(preset: LengthPreset, max_model_len: int) -> tuple[float, float]:
    """Lognormal (mu_prompt, mu_output) whose clipped means equal the preset's."""
    if max_model_len < 2:
        raise TraceError(f"max_model_len must be >= 2 (got {max_model_len})")
    sp, so = preset.sigma_prompt, preset.sigma_output
    mean_prompt = lambda mu: 1.0 + float(_survival(np.arange(1.5, max_model_len - 1), mu, sp).sum())
    mu_p = _solve_mu(mean_prompt, preset.mean_prompt, sp, max_model_len, "prompt length")
    pmf = _prompt_pmf(mu_p, sp, max_model_len)
    mean_output = lambda mu: _mean_output(mu, so, pmf, max_model_len)
    mu_o = _solve_mu(mean_output, preset.mean_output, so, max_model_len, "output length")
    return mu_p, mu_o


def sample_preset(name: str, num: int, max_model_len: int,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Draw `num` (prompt_len, output_len) pairs from a preset, clipped to max_model_len."""
    preset = LENGTH_PRESETS[name]
    mu_p, mu_o = calibrate(preset, max_model_len)
    x = np.exp(mu_p + preset.sigma_prompt * rng.standard_normal(num))
    y = np.exp(mu_o + preset.sigma_output * rng.standard_normal(num))
    prompt = np.clip(np.rint(x), 1, max_model_len - 1).astype(np.int64)
    output = np.clip(np.rint(y), 1, max_model_len - prompt).astype(np.int64)
    return prompt, output

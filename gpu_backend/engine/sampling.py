"""Batched token sampling: greedy, temperature, top-k, top-p, with per-sequence seeds.

One call samples one token for every row of a logits matrix; rows may mix greedy, unseeded and seeded
sampling, and every setting is an array over the rows, so no step loops over rows in Python.

Unseeded random rows use the exponential-race trick (argmax of p / E with E ~ Exp(1) is a draw from p),
with noise from the step's shared generator. A seeded row draws its token by inverting its cumulative
distribution at one uniform number that is a hash of (seed, draw index): the draw depends only on the
row's own seed and on how many tokens it has drawn before, never on the batch, the step or other rows, so
a request samples the same tokens alone, in any batch, and after a recompute preemption.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Exp(1) noise can underflow to 0; dividing by it would turn a zero-probability token into a winner (0/0).
_MIN_NOISE = 1e-30
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings for one step; row i of the logits belongs to entry i of each array.

    temperature 0 means greedy; top_k <= 0 or >= vocab means no top-k; top_p 1.0 means no top-p.
    seeds[i] >= 0 gives the row its own reproducible stream (draws[i]: how many tokens the row drew
    before this one); -1 draws from the step's shared generator. Lists are accepted and kept as arrays.
    """

    temperatures: np.ndarray
    top_ps: np.ndarray
    top_ks: np.ndarray
    seeds: np.ndarray | None = None
    draws: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.temperatures)
        arrays = {"temperatures": (self.temperatures, np.float64), "top_ps": (self.top_ps, np.float64),
                  "top_ks": (self.top_ks, np.int64),
                  "seeds": (np.full(n, -1) if self.seeds is None else self.seeds, np.int64),
                  "draws": (np.zeros(n) if self.draws is None else self.draws, np.int64)}
        for name, (values, dtype) in arrays.items():
            array = np.asarray(values, dtype=dtype)
            if array.shape != (n,):
                raise ValueError("SamplingBatch arrays must all have one entry per row")
            object.__setattr__(self, name, array)
        bad = np.flatnonzero(self.temperatures < 0)
        if bad.size:
            raise ValueError(f"row {bad[0]}: temperature must be >= 0, got {self.temperatures[bad[0]]}")
        bad = np.flatnonzero(~((self.top_ps > 0.0) & (self.top_ps <= 1.0)))
        if bad.size:
            raise ValueError(f"row {bad[0]}: top_p must be in (0, 1], got {self.top_ps[bad[0]]}")

    @classmethod
    def greedy(cls, num_rows: int) -> SamplingBatch:
        """All rows greedy."""
        return cls(np.zeros(num_rows), np.ones(num_rows), np.zeros(num_rows, dtype=np.int64))

    @property
    def all_greedy(self) -> bool:
        """True when no row needs random numbers."""
        return not self.temperatures.any()


def greedy_tokens(logits: torch.Tensor) -> np.ndarray:
    """The argmax of every row, on the host. On a CPU through numpy: torch's single-threaded argmax over
    the last dimension takes ~10x longer (60 against 6 us for [64, 1024] fp32 on the dev VM)."""
    if logits.device.type == "cpu":
        return logits.float().numpy().argmax(axis=1)
    return logits.argmax(dim=-1).cpu().numpy()


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` seeded with `seed` (the engine's shared generator)."""
    return torch.Generator(device=device).manual_seed(int(seed))


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer over uint64 arrays (arithmetic modulo 2^64)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def seeded_uniform(seeds: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """One number in [0, 1) per row, a hash of (seed, draw index): the row's reproducible stream."""
    with np.errstate(over="ignore"):
        s = np.asarray(seeds, dtype=np.int64).astype(np.uint64)
        d = np.asarray(draws, dtype=np.int64).astype(np.uint64)
        z = _splitmix64(_splitmix64(s * _GOLDEN + np.uint64(1)) ^ (d * _GOLDEN))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and outside its top-p nucleus.

    logits [B, V] fp32; top_k [B] int64 (values <= 0 or >= V disable it); top_p [B] float.
    The nucleus is the smallest set of most likely tokens whose probability sums to >= top_p
    (computed after top-k); the most likely token is always kept.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)
        # Ascending order: the k largest are the last k columns; the k-th largest is the threshold.
        kth = sorted_logits.gather(-1, (vocab - k).unsqueeze(-1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum_from_bottom = probs.cumsum(dim=-1)
        drop = cum_from_bottom <= (1.0 - top_p).unsqueeze(-1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _inverse_cdf(probs: torch.Tensor, uniform: np.ndarray) -> torch.Tensor:
    """For each row, the first token whose cumulative probability exceeds uniform * total (float64, so a
    zero-probability token is never chosen: its cumulative sum equals its predecessor's)."""
    cdf = probs.double().cumsum(dim=-1)
    u = torch.from_numpy(uniform).to(probs.device).unsqueeze(-1) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max_(probs.shape[-1] - 1)


def sample(logits: torch.Tensor, batch: SamplingBatch,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row [B] int64 from logits [B, V]; `generator` serves unseeded random rows."""
    if logits.shape[0] != len(batch.temperatures):
        raise ValueError(f"{logits.shape[0]} logits rows but {len(batch.temperatures)} sampling rows")
    logits = logits.float()
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_ids
    device = logits.device
    temps = batch.temperatures
    logits = logits / torch.from_numpy(np.where(temps > 0, temps, 1.0).astype(np.float32)).to(device)[:, None]
    vocab = logits.shape[-1]
    use_top_k = bool(((batch.top_ks > 0) & (batch.top_ks < vocab)).any())
    use_top_p = bool((batch.top_ps < 1.0).any())
    if use_top_k or use_top_p:
        logits = apply_top_k_top_p(
            logits, torch.from_numpy(batch.top_ks).to(device) if use_top_k else None,
            torch.from_numpy(batch.top_ps.astype(np.float32)).to(device) if use_top_p else None)
    probs = logits.softmax(dim=-1)
    seeded = (batch.seeds >= 0) & (temps > 0)
    sampled = None
    if not seeded.all():  # the shared generator's noise, drawn over the whole matrix
        noise = torch.empty_like(probs).exponential_(generator=generator)
        sampled = (probs / noise.clamp_min_(_MIN_NOISE)).argmax(dim=-1)
    if seeded.any():
        rows = np.flatnonzero(seeded)
        own = _inverse_cdf(probs[torch.from_numpy(rows).to(device)],
                           seeded_uniform(batch.seeds[rows], batch.draws[rows]))
        sampled = own if sampled is None else sampled.index_copy(0, torch.from_numpy(rows).to(device), own)
    return torch.where(torch.from_numpy(temps == 0).to(device), greedy_ids, sampled)


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [B, V] fp32 of the unmodified distribution (for beam search and logprob output)."""
    return torch.log_softmax(logits.float(), dim=-1)

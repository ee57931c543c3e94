"""Batched token sampling: greedy, temperature, top-k, top-p, with per-sequence seeded generators.

One call samples one token for every row of a logits matrix; rows may mix greedy and random sampling.
Random rows use the exponential-race trick (argmax of p / E with E ~ Exp(1) is a draw from p), so the
whole batch is sampled by one vectorized argmax and each seeded row only needs its own noise row.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Exp(1) noise can underflow to 0; dividing by it would turn a zero-probability token into a winner (0/0).
_MIN_NOISE = 1e-30


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings for one step; row i of the logits belongs to entry i of each list.

    temperature 0 means greedy; top_k <= 0 or >= vocab means no top-k; top_p 1.0 means no top-p.
    generators[i] is the row's own seeded generator (kept by the caller across steps) or None to
    draw from the step's shared generator.
    """

    temperatures: Sequence[float]
    top_ps: Sequence[float]
    top_ks: Sequence[int]
    generators: Sequence[torch.Generator | None]

    def __post_init__(self) -> None:
        n = len(self.temperatures)
        if not (len(self.top_ps) == len(self.top_ks) == len(self.generators) == n):
            raise ValueError("SamplingBatch lists must all have one entry per row")
        for i, (t, p) in enumerate(zip(self.temperatures, self.top_ps, strict=True)):
            if t < 0:
                raise ValueError(f"row {i}: temperature must be >= 0, got {t}")
            if not 0.0 < p <= 1.0:
                raise ValueError(f"row {i}: top_p must be in (0, 1], got {p}")

    @classmethod
    def greedy(cls, num_rows: int) -> SamplingBatch:
        """All rows greedy."""
        return cls([0.0] * num_rows, [1.0] * num_rows, [0] * num_rows, [None] * num_rows)

    @property
    def all_greedy(self) -> bool:
        """True when no row needs random numbers."""
        return all(t == 0 for t in self.temperatures)


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` seeded with `seed` (one per seeded sequence, kept across steps)."""
    return torch.Generator(device=device).manual_seed(int(seed))


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


def sample(logits: torch.Tensor, batch: SamplingBatch,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row [B] int64 from logits [B, V]; `generator` serves rows without their own."""
    if logits.shape[0] != len(batch.temperatures):
        raise ValueError(f"{logits.shape[0]} logits rows but {len(batch.temperatures)} sampling rows")
    logits = logits.float()
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_ids
    device = logits.device
    temps = torch.tensor([t if t > 0 else 1.0 for t in batch.temperatures], device=device)
    logits = logits / temps.unsqueeze(-1)
    vocab = logits.shape[-1]
    use_top_k = any(0 < k < vocab for k in batch.top_ks)
    use_top_p = any(p < 1.0 for p in batch.top_ps)
    if use_top_k or use_top_p:
        logits = apply_top_k_top_p(
            logits,
            torch.tensor(list(batch.top_ks), dtype=torch.int64, device=device) if use_top_k else None,
            torch.tensor(list(batch.top_ps), dtype=torch.float32, device=device) if use_top_p else None,
        )
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs)
    own = [row for row, gen in enumerate(batch.generators) if gen is not None and batch.temperatures[row] > 0]
    if len(own) < len(batch.generators):
        noise.exponential_(generator=generator)
    for row in own:
        # A seeded row draws only from its own generator, so its samples do not depend on the batch.
        noise[row].exponential_(generator=batch.generators[row])
    sampled = (probs / noise.clamp_min_(_MIN_NOISE)).argmax(dim=-1)
    greedy_rows = torch.tensor([t == 0 for t in batch.temperatures], device=device)
    return torch.where(greedy_rows, greedy_ids, sampled)


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [B, V] fp32 of the unmodified distribution (for beam search and logprob output)."""
    return torch.log_softmax(logits.float(), dim=-1)

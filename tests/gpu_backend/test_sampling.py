"""Batched sampling: greedy, temperature, top-k, top-p, and per-sequence seeded streams."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_backend.engine.sampling import (
    SamplingBatch,
    apply_top_k_top_p,
    compute_logprobs,
    make_generator,
    sample,
    seeded_uniform,
)

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.normal(0.0, 2.0, (rows, VOCAB)).astype(np.float32))


def _batch(rows: int, temperature=1.0, top_p=1.0, top_k=0, seeds=None, draws=None) -> SamplingBatch:
    return SamplingBatch([temperature] * rows, [top_p] * rows, [top_k] * rows, seeds, draws)


def _support(masked: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in masked]


def test_greedy_is_argmax():
    logits = _logits(8)
    assert torch.equal(sample(logits, SamplingBatch.greedy(8)), logits.argmax(-1))


def test_top_k_1_equals_greedy():
    logits = _logits(64, seed=1)
    got = sample(logits, _batch(64, temperature=1.3, top_k=1), generator=make_generator(5))
    assert torch.equal(got, logits.argmax(-1))


def test_same_seed_same_samples_whatever_the_batch():
    logits = _logits(4, seed=2)
    first = sample(logits, _batch(4, seeds=[11, 12, 13, 14]))
    again = sample(logits, _batch(4, seeds=[11, 12, 13, 14]))
    assert torch.equal(first, again)
    # Row 2 alone, in another batch with another shared generator: the same draw, its stream is its own.
    alone = sample(logits[2:3], _batch(1, seeds=[13]), generator=make_generator(99))
    assert alone.item() == first[2].item()


def test_a_seeded_stream_advances_with_the_draw_index():
    logits = _logits(1, seed=3) * 0.1  # nearly flat: draws vary
    draws = [sample(logits, _batch(1, seeds=[7], draws=[d])).item() for d in range(20)]
    # The same (seed, draw index) gives the same token whatever else shares the batch or the step.
    batch = _batch(20, seeds=[7] * 20, draws=list(range(20)))
    assert sample(logits.expand(20, VOCAB), batch, generator=make_generator(3)).tolist() == draws
    assert len(set(draws)) > 1


def test_seeded_uniforms_are_uniform_and_distinct():
    u = seeded_uniform(np.arange(50_000) % 7, np.arange(50_000) // 7)
    assert u.min() >= 0.0 and u.max() < 1.0 and len(np.unique(u)) == len(u)
    counts, _ = np.histogram(u, bins=10, range=(0.0, 1.0))
    assert (np.abs(counts - 5_000) < 300).all()  # ~4 sigma of a binomial(50k, 0.1)


def test_different_seeds_differ():
    logits = _logits(1, seed=4) * 0.1
    assert len({sample(logits, _batch(1, seeds=[s])).item() for s in range(30)}) > 1


def test_mixed_greedy_and_random_rows():
    logits = _logits(6, seed=5) * 0.1
    batch = SamplingBatch([0.0, 1.0, 0.0, 1.0, 0.0, 1.0], [1.0] * 6, [0] * 6, [-1, 4, -1, -1, 5, 6])
    got = sample(logits, batch, generator=make_generator(0))
    assert got[0::2].tolist() == logits[0::2].argmax(-1).tolist()


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]] * 3)
    top_p = torch.tensor([0.4, 0.75, 0.85])
    masked = apply_top_k_top_p(probs.log(), None, top_p)
    assert _support(masked) == [{1}, {1, 3}, {1, 2, 3}]
    kept = torch.where(torch.isfinite(masked), masked, torch.zeros_like(masked))
    assert torch.equal(kept, torch.where(torch.isfinite(masked), probs.log(), torch.zeros_like(masked)))


def test_top_k_then_top_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.05, 0.5, 0.15, 0.3]])
    # Row 0: top-2 leaves {0.5, 0.3} renormalized to {0.625, 0.375}; top-p 0.6 then keeps only the first.
    masked = apply_top_k_top_p(probs.log(), torch.tensor([2, 0]), torch.tensor([0.6, 1.0]))
    assert _support(masked) == [{1}, {0, 1, 2, 3}]


def test_sampled_frequencies_follow_the_filtered_distribution():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    rows = 4000
    logits = probs.log().expand(rows, 4).clone()
    expected = torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95
    # Shared-generator rows (-1), and seeded rows (a seed per row, then one seed's successive draws).
    for seeds, draws in ((None, None), (np.arange(rows), None), ([11] * rows, np.arange(rows))):
        got = sample(logits, SamplingBatch([1.0] * rows, [0.85] * rows, [0] * rows, seeds, draws),
                     generator=make_generator(1))
        freq = torch.bincount(got, minlength=4).float() / rows
        assert freq[0] == 0  # outside the nucleus
        assert (freq - expected).abs().max() < 0.03


def test_temperature_sharpens():
    probs = torch.tensor([0.2, 0.5, 0.3])
    rows = 4000
    logits = probs.log().expand(rows, 3).clone()
    cold = sample(logits, SamplingBatch([0.25] * rows, [1.0] * rows, [0] * rows, np.arange(rows)),
                  generator=make_generator(2))
    expected = torch.softmax(probs.log() / 0.25, dim=-1)
    freq = torch.bincount(cold, minlength=3).float() / rows
    assert (freq - expected).abs().max() < 0.03


def test_logprobs_normalized():
    lp = compute_logprobs(_logits(3))
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(3))


@pytest.mark.parametrize("kwargs,match", [
    ({"temperatures": [-1.0]}, "temperature"),
    ({"top_ps": [0.0]}, "top_p"),
    ({"top_ks": [1, 2]}, "one entry per row"),
    ({"seeds": [1, 2]}, "one entry per row"),
])
def test_bad_sampling_settings(kwargs, match):
    fields = {"temperatures": [1.0], "top_ps": [1.0], "top_ks": [0]} | kwargs
    with pytest.raises(ValueError, match=match):
        SamplingBatch(**fields)

"""Rotary position embeddings (neox / rotate-half layout, as Llama checkpoints on the Hub expect)."""
from __future__ import annotations

import math

import torch

from gpu_backend.model_config import ModelLoadError, RopeScaling


def compute_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] in fp32, after any rope_scaling."""
    # Same expression as transformers so fp32 results agree bit for bit.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ModelLoadError(f"unsupported rope_scaling type {scaling.rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    ramp = scaling.high_freq_factor - scaling.low_freq_factor
    smooth = (old_len / wavelen - scaling.low_freq_factor) / ramp
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Computes cos/sin for arbitrary (packed, non-contiguous) positions and rotates q and k."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.head_dim = head_dim
        # Frequencies are cheap to recompute, so they are never part of a checkpoint.
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, theta, scaling).to(device),
                             persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim] for positions [T]; computed in fp32 then cast, as transformers does."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, head_dim] by the per-token angles in cos/sin [T, head_dim]."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]

"""A decoder layer's ops beside attention and the projections: RMSNorm, the residual add before a norm,
the rotary embedding of q and k, and the gated activation. The torch versions are the reference (and the
CPU path); with the Triton attention backend the model takes the fused kernels of triton_layer.py, one
launch each where torch takes several (what a CUDA-graph decode step pays for per launch)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_backend.rope import RotaryEmbedding

Pair = tuple[torch.Tensor, torch.Tensor]


class TorchLayerOps:
    """The reference: the model's own torch code."""

    name = "torch"

    def rms_norm(self, norm, x: torch.Tensor) -> torch.Tensor:
        """norm(x) for an RMSNorm module."""
        return norm(x)

    def add_rms_norm(self, norm, x: torch.Tensor, residual: torch.Tensor) -> Pair:
        """(norm(residual + x), residual + x)."""
        total = residual + x
        return norm(total), total

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> Pair:
        """q [T, Hq, D] and k [T, Hkv, D] rotated by the per-token angles in cos/sin [T, D]."""
        return RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)

    def act_mul(self, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
        """act(gate) * up of gate_up = [gate | up]: GELU-tanh (Gemma) or SiLU."""
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
        return act * up


class TritonLayerOps(TorchLayerOps):
    """The fused kernels (triton_layer.py); GELU stays in torch (only Gemma uses it)."""

    name = "triton"

    def __init__(self) -> None:
        # Imported here, not at module level: Triton loads only once the Triton backend is asked for.
        import gpu_backend.ops.triton_layer as kernels

        self.kernels = kernels

    def rms_norm(self, norm, x: torch.Tensor) -> torch.Tensor:
        """norm(x), one launch."""
        return self.kernels.rms_norm(x, norm.weight, norm.eps, norm.gemma)[0]

    def add_rms_norm(self, norm, x: torch.Tensor, residual: torch.Tensor) -> Pair:
        """(norm(residual + x), residual + x), one launch."""
        return self.kernels.rms_norm(x, norm.weight, norm.eps, norm.gemma, residual=residual)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> Pair:
        """q and k rotated, one launch for both."""
        return self.kernels.rope(q, k, cos, sin)

    def act_mul(self, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
        """SiLU-and-multiply in one launch; GELU through torch."""
        if gelu:
            return super().act_mul(gate_up, gelu)
        return self.kernels.silu_mul(gate_up)


def layer_ops(backend) -> TorchLayerOps:
    """The layer ops that go with an attention backend: Triton's kernels with Triton, else torch."""
    return TritonLayerOps() if getattr(backend, "name", None) == "triton" else TorchLayerOps()

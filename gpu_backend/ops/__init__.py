"""Paged-attention ops: a backend protocol, the torch and Triton backends, block copy and swap.

KV layout per layer: `k_cache`, `v_cache` each `[num_blocks, block_size, num_kv_heads, head_dim]`;
slot = block_id * block_size + offset. Triton is imported only when the Triton backend is asked for.
"""
from __future__ import annotations

from typing import Protocol

import torch

from gpu_backend.ops.block_ops import copy_blocks, swap_blocks
from gpu_backend.ops.checks import KernelInputError
from gpu_backend.ops.torch_backend import TorchBackend, TorchBackendConfig


class AttentionBackend(Protocol):
    """What the engine needs from an attention implementation (shapes in docs/kernels.md)."""

    name: str

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        """key/value [T, Hkv, D] -> pool slots slot_mapping [T] (int64; -1 skips the token)."""

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale: float, *,
               max_context_len: int | None = None, contiguous: bool = False, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """q [B, Hq, D], block_tables [B, max_blocks] int32/64 (or [B, 1] region starts when
        contiguous), context_lens [B] -> [B, Hq, D]; max_context_len >= every context (host int).
        window: the layer's sliding window in tokens (None/0: full attention; blocks wholly before it
        are skipped); softcap: cap * tanh(logit / cap) on the scores (None/0: none)."""

    def prefill(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale: float,
                max_query_len: int | None = None, *, contiguous: bool = False, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """Packed q [T, Hq, D], cu_seqlens_q [B+1], context_lens [B] incl. new tokens -> [T, Hq, D];
        window and softcap as in decode."""


BACKEND_NAMES = ("auto", "torch", "triton")

# On CUDA the gathered tile has no cache to fit in, so one batched tile per call is best (prefill padding
# is left unbounded there: each extra tile is another round of launches; not measured on a GPU).
_CUDA_TORCH_CONFIG = TorchBackendConfig(tile_bytes=1 << 62, solo_bytes=1 << 62, reuse_workspace=False,
                                        prefill_max_pad=None)


def get_backend(name: str = "auto", device=None) -> AttentionBackend:
    """Return the backend called `name`; "auto" picks Triton on CUDA devices and torch elsewhere."""
    if name not in BACKEND_NAMES:
        raise KernelInputError(
            f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    dev = torch.device(device) if device is not None else None
    on_cuda = dev.type == "cuda" if dev is not None else torch.cuda.is_available()
    if name == "auto":
        name = "triton" if on_cuda else "torch"
    if name == "torch":
        return TorchBackend(_CUDA_TORCH_CONFIG if on_cuda else None)
    from gpu_backend.ops.triton_backend import TritonBackend, check_device

    check_device(on_cuda, dev)
    return TritonBackend()


__all__ = [
    "AttentionBackend",
    "KernelInputError",
    "TorchBackend",
    "TorchBackendConfig",
    "copy_blocks",
    "get_backend",
    "swap_blocks",
]

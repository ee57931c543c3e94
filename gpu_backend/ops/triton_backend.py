"""The Triton attention backend: validation and launch configuration around the kernels."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

import gpu_backend.ops.triton_cache as triton_cache
import gpu_backend.ops.triton_decode as triton_decode
import gpu_backend.ops.triton_prefill as triton_prefill
from gpu_backend.ops.checks import (
    KernelInputError,
    check_cache_pair,
    check_query,
    check_store,
    check_tables,
    check_window,
)
from gpu_backend.ops.triton_decode import SplitPolicy, choose_num_splits
from gpu_backend.ops.triton_tile import interpreting

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
# Without a GPU (interpreter) there is no SM count; this stands in so the heuristic still splits
# long contexts in tests the way it would on a small device.
_FALLBACK_NUM_SMS = 4


@dataclass(frozen=True)
class TritonBackendConfig:
    """Launch configuration of the Triton kernels."""

    block_n: int = 64  # KV positions per inner-loop tile (decode and prefill)
    block_m: int = 64  # query rows (tokens x packed heads) per prefill program
    num_warps: int = 4
    split_policy: SplitPolicy = field(default_factory=SplitPolicy)


class TritonBackend:
    """Paged attention with Triton kernels that read K/V straight from the pool's blocks."""

    name = "triton"

    def __init__(self, config: TritonBackendConfig | None = None):
        self.config = config or TritonBackendConfig()

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        """Write key/value [T, Hkv, D] into pool slots slot_mapping [T]; slot -1 is skipped."""
        check_cache_pair(k_cache, v_cache)
        check_store(key, value, k_cache, slot_mapping)
        _check_runnable(key, k_cache)
        if key.stride(-1) != 1 or value.stride(-1) != 1:
            raise KernelInputError("store_kv key/value must have a contiguous last dimension")
        triton_cache.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale: float,
               num_splits: int | None = None, *, max_context_len: int | None = None,
               contiguous: bool = False, window: int | None = None, softcap: float | None = None
               ) -> torch.Tensor:
        """q [B, Hq, D] over paged contexts -> [B, Hq, D]; num_splits=None lets the heuristic choose.

        max_context_len: the longest context (the engine knows it on the host); without it the table's
        capacity bounds it (paged) or one device sync finds it (contiguous). contiguous: block_tables
        [B, 1] holds each sequence's region start and its context is slots [start, start + len).
        window: sliding-window size in tokens (None or 0: full attention); softcap: logit cap (None or 0:
        none).
        """
        window, softcap = check_window(window, softcap)
        _, block_size, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
        check_query(q, num_kv_heads, head_dim, "decode")
        check_tables(block_tables, context_lens, q.shape[0], "decode")
        self._check_geometry(block_size, head_dim)
        _check_runnable(q, k_cache)
        if max_context_len is None:
            max_context_len = (int(context_lens.max()) if contiguous and len(context_lens)
                               else block_tables.shape[1] * block_size)
        if num_splits is None:
            span = triton_decode.decode_span(max_context_len, window, block_size)
            num_splits = choose_num_splits(q.shape[0], num_kv_heads, span, _num_sms(q.device),
                                           self.config.split_policy)
        if num_splits < 1:
            raise KernelInputError(f"decode num_splits must be >= 1, got {num_splits}")
        return triton_decode.paged_decode(
            q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, max_context_len,
            block_n=self._block_n(head_dim), num_warps=self.config.num_warps, contiguous=contiguous,
            window=window, softcap=softcap)

    def prefill(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale: float,
                max_query_len: int | None = None, *, contiguous: bool = False, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """Packed q [T, Hq, D]; each sequence's last q_len positions attend causally -> [T, Hq, D]."""
        window, softcap = check_window(window, softcap)
        _, block_size, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
        check_query(q, num_kv_heads, head_dim, "prefill")
        check_tables(block_tables, context_lens, context_lens.shape[0], "prefill")
        if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] != context_lens.shape[0] + 1:
            raise KernelInputError(f"prefill cu_seqlens_q must be [{context_lens.shape[0] + 1}], "
                                   f"got {tuple(cu_seqlens_q.shape)}")
        self._check_geometry(block_size, head_dim)
        _check_runnable(q, k_cache)
        if max_query_len is None:  # one host sync; engines that know it pass it in
            max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if len(context_lens) else 0
        return triton_prefill.paged_prefill(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_query_len,
            block_m=self.config.block_m, block_n=self._block_n(head_dim), num_warps=self.config.num_warps,
            contiguous=contiguous, window=window, softcap=softcap)

    def _block_n(self, head_dim: int) -> int:
        """KV tile length; halved for head_dim 256 to bound registers per program."""
        return max(16, self.config.block_n // 2) if head_dim > 128 else self.config.block_n

    @staticmethod
    def _check_geometry(block_size: int, head_dim: int) -> None:
        """The kernels are specialized for these head dims and block sizes."""
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise KernelInputError(
                f"Triton attention supports head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim}")
        if block_size < 1:
            raise KernelInputError(f"block_size must be positive, got {block_size}")


def check_device(on_cuda: bool, device: torch.device | None) -> None:
    """Refuse a backend without a CUDA device to run on, unless Triton interprets the kernels."""
    # Triton compiles for a GPU driver: without one, the first launch fails deep inside Triton.
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise KernelInputError(f"the triton attention backend needs a CUDA device (here: "
                               f"{device or 'no CUDA device'}), or TRITON_INTERPRET=1 to interpret its "
                               f"kernels on the CPU; the torch backend runs anywhere")


def _check_runnable(t: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Triton needs CUDA tensors, except under the interpreter; all tensors on one device."""
    if t.device != k_cache.device:
        raise KernelInputError(f"tensors on different devices: {t.device} vs {k_cache.device}")
    if k_cache.device.type != "cuda" and not interpreting():
        raise KernelInputError("the Triton backend needs CUDA tensors (or TRITON_INTERPRET=1 set before "
                               "importing the kernels); use get_backend('torch') on CPU")
    if interpreting() and torch.bfloat16 in (t.dtype, k_cache.dtype):
        raise KernelInputError("Triton's interpreter mis-handles bfloat16 (stored as uint16): upcast "
                               "bf16 inputs to float32 when running under TRITON_INTERPRET=1")


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a small stand-in elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _FALLBACK_NUM_SMS

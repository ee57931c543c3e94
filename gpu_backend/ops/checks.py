"""Input validation shared by the attention backends: typed errors instead of bare asserts."""
from __future__ import annotations

import torch

from pagelab.errors import PagelabError


class KernelInputError(PagelabError, ValueError):
    """A tensor handed to an attention op has the wrong shape, dtype, device or layout."""


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate a K/V pool pair and return (num_blocks, block_size, num_kv_heads, head_dim)."""
    if k_cache.dim() != 4:
        raise KernelInputError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise KernelInputError(f"v_cache shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype or v_cache.device != k_cache.device:
        raise KernelInputError("k_cache and v_cache must share dtype and device")
    if k_cache.dtype not in SUPPORTED_DTYPES:
        raise KernelInputError(f"KV cache dtype {k_cache.dtype} not supported (fp16, bf16, fp32)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelInputError("k_cache and v_cache must be contiguous pools")
    return tuple(k_cache.shape)  # type: ignore[return-value]


def check_query(q: torch.Tensor, num_kv_heads: int, head_dim: int, what: str) -> int:
    """Validate a query tensor [N, Hq, D] against the pool; return the GQA group size Hq // Hkv."""
    if q.dim() != 3:
        raise KernelInputError(f"{what} q must be [tokens, num_heads, head_dim], got {tuple(q.shape)}")
    num_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise KernelInputError(f"{what} q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise KernelInputError(
            f"{what} num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads} (GQA)")
    if q.stride(-1) != 1:
        raise KernelInputError(f"{what} q must have a contiguous last dimension")
    return num_heads // num_kv_heads


def check_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, num_seqs: int, what: str) -> None:
    """Validate block tables [B, max_blocks] and context lengths [B] (integer tensors)."""
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise KernelInputError(
            f"{what} block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    if context_lens.dim() != 1 or context_lens.shape[0] != num_seqs:
        raise KernelInputError(f"{what} context_lens must be [{num_seqs}], got {tuple(context_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise KernelInputError(f"{what} {name} must be int32 or int64, got {t.dtype}")


def check_store(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """Validate store_kv inputs: key/value [T, Hkv, D] matching the pool, slot_mapping [T]."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    if key.shape != value.shape or key.dim() != 3 or tuple(key.shape[1:]) != (num_kv_heads, head_dim):
        raise KernelInputError(
            f"store_kv key/value must both be [T, {num_kv_heads}, {head_dim}], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise KernelInputError(
            f"store_kv slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(f"store_kv slot_mapping must be int32/int64, got {slot_mapping.dtype}")


def check_window(window: int | None, softcap: float | None) -> tuple[int, float]:
    """Normalize a layer's sliding window (None/0: full attention) and logit soft-cap (None/0: none)."""
    window = 0 if window is None else window
    softcap = 0.0 if softcap is None else float(softcap)
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise KernelInputError(
            f"sliding window must be a non-negative int (0 = full attention), got {window!r}")
    if softcap < 0:
        raise KernelInputError(f"logit soft-cap must be >= 0 (0 = none), got {softcap}")
    return window, softcap


def block_mapping_tensor(block_mapping, device=None) -> torch.Tensor:
    """Normalize a (src, dst) mapping — dict, list of pairs or [N, 2] tensor — to an int64 [N, 2] tensor."""
    if isinstance(block_mapping, dict):
        block_mapping = list(block_mapping.items())
    if isinstance(block_mapping, torch.Tensor):
        mapping = block_mapping.to(dtype=torch.int64)
    else:
        pairs = list(block_mapping)
        mapping = torch.tensor(pairs, dtype=torch.int64) if pairs else torch.empty((0, 2), dtype=torch.int64)
    if mapping.dim() != 2 or mapping.shape[1] != 2:
        raise KernelInputError(f"block mapping must be (src, dst) pairs, got shape {tuple(mapping.shape)}")
    return mapping if device is None else mapping.to(device)

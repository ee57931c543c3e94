"""Whether an engine fits its device's memory: checked before the KV pool is made, where it can be predicted.

The pool (capacity x bytes per token), a step's activations (at least: the largest step the scheduler can
make, max_num_batched_tokens tokens) and the weights must fit the device's memory. On CUDA that is the free
memory once the weights are loaded; on a CPU nothing is checked unless PAGELAB_DEVICE_MEMORY_GB gives a
budget, which then stands in for a device's memory (it caps a GPU's too). An out-of-memory error that no
check foresaw (fragmentation, memory held by others) stops a replay cleanly instead (gpu_backend/replay.py).
"""
from __future__ import annotations

import math
import os

import torch

from pagelab.errors import PagelabError

BUDGET_ENV = "PAGELAB_DEVICE_MEMORY_GB"
GIB = 1 << 30


class DeviceMemoryError(PagelabError):
    """The engine's pool and largest step cannot fit the device's memory (or its budget is not a number);
    the message gives the sizes."""


def budget_bytes(device: torch.device) -> tuple[int, bool, str] | None:
    """(bytes the engine may still use, whether the weights count against them, where the figure comes from),
    or None: no budget is known (a CPU without PAGELAB_DEVICE_MEMORY_GB)."""
    text = os.environ.get(BUDGET_ENV)
    if text:
        try:
            gb = float(text)
        except ValueError:
            gb = math.nan
        if not math.isfinite(gb) or gb <= 0:
            raise DeviceMemoryError(f"{BUDGET_ENV}={text!r}: expected a number of GiB > 0")
        return int(gb * GIB), True, f"{BUDGET_ENV}={text}"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), False, f"free on {device} once the weights are loaded"
    return None


def step_activation_bytes(config, dtype: torch.dtype, num_tokens: int, num_seqs: int) -> int:
    """A lower bound of a step's activations: one layer's hidden states and MLP outputs for every token,
    and fp32 logits for each sequence's last token (what the forward keeps at its peak, at least)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = (2 * config.hidden_size + 2 * config.intermediate_size) * elem
    return num_tokens * per_token + min(num_seqs, num_tokens) * config.vocab_size * 4


def _gib(n: int) -> str:
    return f"{n / GIB:.3g} GiB"


def check_fits(model, pool_bytes: int, num_tokens: int, num_seqs: int) -> None:
    """DeviceMemoryError when the pool, a step of `num_tokens` tokens over `num_seqs` sequences and (against
    a PAGELAB_DEVICE_MEMORY_GB budget) the weights cannot fit the device's memory."""
    budget = budget_bytes(model.device)
    if budget is None:
        return
    have, with_weights, source = budget
    activations = step_activation_bytes(model.config, model.dtype, num_tokens, num_seqs)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) if with_weights else 0
    need = pool_bytes + activations + weights
    if need <= have:
        return
    room = have - activations - weights
    hint = (f"give a KV pool of at most {_gib(room)} (--kv-memory-gb / --num-blocks)" if room > 0 else
            "lower --max-num-batched-tokens or use a larger device")
    parts = (f"the KV pool ({_gib(pool_bytes)}) and a step of {num_tokens:,} tokens (at least "
             f"{_gib(activations)} of activations)")
    if weights:
        parts += f" and the weights ({_gib(weights)})"
    raise DeviceMemoryError(f"{parts} need {_gib(need)}, but the device has {_gib(have)} ({source}); {hint}")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation that failed for want of memory (CUDA, the CPU allocator, Python)."""
    if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)

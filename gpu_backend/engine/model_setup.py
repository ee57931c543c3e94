"""The device and model an engine runs on: "auto" resolved, and a given model checked against the request."""
from __future__ import annotations

from pathlib import Path

import torch

from gpu_backend.engine.params import EngineInputError
from gpu_backend.model import CausalLM


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" is CUDA when available; an unavailable or unknown device is an EngineInputError."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise EngineInputError(f"unknown device {device!r} ({exc}); use auto, cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineInputError(f"device {device!r} asked for, but CUDA is not available here")
    return dev


def device_holds(requested: torch.device, actual: torch.device) -> bool:
    """Whether a model on `actual` is on the `requested` device: plain "cuda" names no index, so a
    model on any "cuda:N" is on it (torch.device("cuda") != torch.device("cuda:0"))."""
    return requested.type == actual.type and requested.index in (None, actual.index)


def engine_model(model, device: str | torch.device, dtype, backend: str, seed: int) -> CausalLM:
    """The engine's model: a CausalLM checked against the requested device and dtype (its backend set),
    or a preset name or model directory loaded onto the device."""
    from gpu_backend.loader import resolve_model
    from gpu_backend.ops import get_backend

    if isinstance(model, CausalLM):
        if str(device) != "auto" and not device_holds(resolve_device(device), model.device):
            raise EngineInputError(f"the model lives on {model.device}, not on the requested {device}")
        if dtype is not None:
            from gpu_backend.model_config import resolve_dtype
            if resolve_dtype(dtype) != model.dtype:
                raise EngineInputError(f"the model's dtype is {model.dtype}, not the requested {dtype}")
        if backend != "auto" or model.attn_backend is None:
            model.set_backend(get_backend(backend, model.device))
        return model
    if not isinstance(model, (str, Path)):
        raise EngineInputError(f"model must be a preset name, a model directory or a CausalLM, got {model!r}")
    dev = resolve_device(device)
    return resolve_model(model, dtype=dtype, device=dev, backend=get_backend(backend, dev), seed=seed)

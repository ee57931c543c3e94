"""Load a Hugging Face model directory (config.json + safetensors, single file or sharded) from local disk.

Nothing is ever downloaded: a path that is not a directory holding a supported checkpoint is an error.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from gpu_backend.model import CausalLM
from gpu_backend.model_config import ModelConfig, ModelLoadError, resolve_dtype

__all__ = ["ModelLoadError", "find_weight_files", "load_model", "load_weights", "resolve_model"]

INDEX_FILE = "model.safetensors.index.json"


def find_weight_files(path: str | Path) -> dict[str, Path]:
    """Map every tensor name of the checkpoint in `path` to the safetensors file holding it."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: cannot read the shard index ({exc!r})") from None
        located = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(located.values())):
            if not shard.is_file():
                raise ModelLoadError(f"{index}: lists shard {shard.name} which is missing from {path}")
        return located
    files = sorted(path.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {', '.join(others)}; only safetensors are supported)" if others else ""
        raise ModelLoadError(f"{path}: no *.safetensors weight files{hint}")
    located = {}
    for file in files:
        for name in _open(file).keys():  # noqa: SIM118 - safe_open handles are not iterable
            located[name] = file
    return located


def _open(file: Path):
    """A safetensors handle; a truncated or corrupt file becomes a ModelLoadError naming it."""
    try:
        return safe_open(file, framework="pt")
    except Exception as exc:  # safetensors raises its own SafetensorError, OSError for unreadable files
        raise ModelLoadError(f"{file}: not a readable safetensors file ({exc})") from None


def load_weights(model: CausalLM, path: str | Path) -> None:
    """Fill every parameter of `model` from the checkpoint in `path`, checking names and shapes."""
    path = Path(path)
    located = find_weight_files(path)
    params = dict(model.named_parameters())
    sources = model.hf_weight_sources()
    if set(params) != set(sources):  # a model/loader mismatch, never a checkpoint problem
        raise RuntimeError(f"parameters without a checkpoint source: {sorted(set(params) ^ set(sources))}")
    handles: dict[Path, object] = {}
    for ours, pieces in sources.items():
        row = 0
        for name, rows in pieces:
            tensor = _read_tensor(name, located, handles, path)
            expected = (rows, *params[ours].shape[1:])
            if tuple(tensor.shape) != expected:
                raise ModelLoadError(f"{located[name]}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"but config.json implies {expected}")
            params[ours].data[row: row + rows].copy_(tensor)
            row += rows


def _read_tensor(name: str, located: dict[str, Path], handles: dict[Path, object],
                 path: Path) -> torch.Tensor:
    """One tensor by its Hugging Face name, opening each file once."""
    file = located.get(name)
    if file is None:
        raise ModelLoadError(f"{path}: tensor {name!r} is missing from the checkpoint")
    if file not in handles:
        handles[file] = _open(file)
    try:
        return handles[file].get_tensor(name)
    except Exception as exc:  # safetensors has its own error types, e.g. for an index naming the wrong shard
        raise ModelLoadError(f"{file}: cannot read tensor {name!r} ({exc})") from None


def load_model(path: str | Path, dtype: str | torch.dtype | None = None, device: torch.device | str = "cpu",
               backend=None) -> CausalLM:
    """Build a CausalLM from the Hugging Face directory `path` (dtype None: fp32 on CPU, else the
    checkpoint's dtype or bf16)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a model directory (nothing is downloaded; give a local path)")
    config = ModelConfig.from_model_dir(path)
    model = CausalLM(config, dtype=default_dtype(config, dtype, device), device=device, backend=backend)
    load_weights(model, path)
    return model


def default_dtype(config: ModelConfig, dtype: str | torch.dtype | None,
                  device: torch.device | str) -> torch.dtype:
    """The dtype to run in: as asked, else fp32 on CPU (half precision is slow there), else the checkpoint's
    (bf16 when it names none)."""
    if dtype is not None:
        return resolve_dtype(dtype)
    if torch.device(device).type == "cpu":
        return torch.float32
    return resolve_dtype(config.torch_dtype, default=torch.bfloat16) if config.torch_dtype else torch.bfloat16


def resolve_model(spec: str | Path, dtype: str | torch.dtype | None = None,
                  device: torch.device | str = "cpu", backend=None, seed: int = 0) -> CausalLM:
    """A built-in preset by name (seeded random weights) or a local Hugging Face directory."""
    from gpu_backend.model_presets import PRESETS, build_preset

    if isinstance(spec, str) and spec in PRESETS and not Path(spec).is_dir():
        config = PRESETS[spec]
        return build_preset(spec, dtype=default_dtype(config, dtype, device), device=device,
                            backend=backend, seed=seed)
    if not Path(spec).is_dir():
        raise ModelLoadError(f"model {str(spec)!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
                             f"nor a local model directory")
    return load_model(spec, dtype=dtype, device=device, backend=backend)

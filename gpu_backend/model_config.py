"""The engine's model configuration: a registry entry it can build, or a Hugging Face `config.json` (Llama,
Mistral, Qwen2 families)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagelab.errors import PagelabError
from simulator.core.errors import ConfigError
from simulator.core.models import ModelSpec, RopeScaling

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


class ModelLoadError(PagelabError, ValueError):
    """A model directory or configuration cannot be used; the message names the file and field."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig(ModelSpec):
    """A model the engine can build: a registry shape (simulator/core/models.py) of the Llama family.

    It adds no fields, so an engine preset runs exactly its registry entry's numbers; it adds the checks
    for what the engine implements and the reading of a Hugging Face config.json.
    """

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"unsupported architecture {self.architecture!r}; "
                                 f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            super().__post_init__()
        except ConfigError as exc:
            raise ModelLoadError(str(exc)) from None
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling is not None and self.rope_scaling.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(f"unsupported rope_scaling type {self.rope_scaling.rope_type!r}; "
                                 f"expected one of {', '.join(SUPPORTED_ROPE_TYPES)}")

    def num_parameters(self) -> int:
        """Parameter count of this Llama-family architecture (embedding counted once when tied)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mlp = 3 * h * self.intermediate_size + ((2 * self.intermediate_size + h) if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * per_layer + h + head

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> ModelConfig:
        """The registry entry `spec` as an engine config (refused if the engine cannot build it)."""
        return cls(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(ModelSpec)})

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from the parsed JSON of a Hugging Face config; `source` names the file in errors."""
        return _parse_hf_config(raw, source)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelConfig:
        """Read `<path>/config.json`."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ModelLoadError(f"{file}: no config.json in model directory {path}")
        try:
            raw = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{file}: cannot read config ({exc})") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{file}: expected a JSON object")
        return _parse_hf_config(raw, str(file))


def _parse_hf_config(raw: dict[str, Any], source: str) -> ModelConfig:
    """Map HF field names (transformers 4.x and 5.x spellings) onto ModelConfig."""
    archs = raw.get("architectures") or []
    if not archs:
        raise ModelLoadError(f"{source}: field 'architectures' is missing")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{source}: unsupported architecture {arch!r} (field 'architectures'); "
                             f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (only 'silu', SwiGLU)")

    def need(name: str) -> Any:
        if name not in raw:
            raise ModelLoadError(f"{source}: required field {name!r} is missing")
        return raw[name]

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    head_dim = raw.get("head_dim") or (hidden // heads if isinstance(hidden, int) and heads else 0)
    # transformers 5 writes rope_parameters (theta inside); 4.x and most checkpoints write
    # rope_theta + rope_scaling.
    rope_params = raw.get("rope_parameters") or {}
    rope_theta = float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling_raw = raw.get("rope_scaling") or rope_params
    qkv_bias = arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False))
    o_bias = arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False))
    sliding = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        sliding = None
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=_parse_rope_scaling(scaling_raw, source, raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )
    except ModelLoadError as exc:  # __post_init__ does not know the file name; need() already says it
        message = str(exc)
        raise ModelLoadError(message if message.startswith(source) else f"{source}: {message}") from None


def _parse_rope_scaling(raw: dict[str, Any], source: str, max_position_embeddings: int) -> RopeScaling | None:
    """Read a rope_scaling / rope_parameters block; None when it asks for plain RoPE."""
    if not raw:
        return None
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{source}: unsupported rope_scaling type {rope_type!r}; "
                             f"expected one of {', '.join(SUPPORTED_ROPE_TYPES)}")
    if "factor" not in raw:
        raise ModelLoadError(f"{source}: rope_scaling of type {rope_type!r} needs field 'factor'")
    original = raw.get("original_max_position_embeddings", max_position_embeddings)
    return RopeScaling(
        rope_type=rope_type,
        factor=float(raw["factor"]),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original) if original is not None else None,
    )


def resolve_dtype(dtype: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """Turn a dtype name ("bf16", "float16"...) or torch dtype into a torch dtype; None gives `default`."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES.values():
            raise ModelLoadError(f"unsupported dtype {dtype}; expected float32, float16 or bfloat16")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; expected one of {', '.join(sorted(_DTYPE_NAMES))}")
    return _DTYPE_NAMES[key]

"""The engine's model configuration: a registry entry it can build, or a Hugging Face `config.json` (Llama,
Mistral, Qwen2, Gemma 2 and Gemma 3 text families)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagelab.errors import PagelabError
from simulator.core.errors import ConfigError
from simulator.core.model_files import layer_types_of, window_of
from simulator.core.models import ModelSpec, RopeScaling

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", *GEMMA_ARCHITECTURES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


class ModelLoadError(PagelabError, ValueError):
    """A model directory or configuration cannot be used; the message names the file and field."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig(ModelSpec):
    """A model the engine can build: a registry shape (simulator/core/models.py) of the Llama or Gemma family.

    The fields it adds describe what the engine computes beyond the registry's shape: which layers attend
    through a sliding window, and what Gemma 2 and 3 add (GELU MLP, attention scale, soft-caps, the local
    RoPE base). Their defaults are Llama's, so a registry entry runs exactly its own numbers. The class also
    checks what the engine implements and reads a Hugging Face config.json.
    """

    # layer_types (the registry's field): per layer "sliding_attention" or "full_attention"; None: every
    # layer slides when sliding_window is set (Mistral), else none does.
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power; None: head_dim's
    attn_logit_softcapping: float | None = None  # cap * tanh(logit / cap) on attention scores (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the LM head's logits (Gemma 2 and 3)
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3); None: rope_theta

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
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ModelLoadError(f"hidden_act {self.hidden_act!r} is not supported; "
                                 f"expected one of {', '.join(SUPPORTED_ACTIVATIONS)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window must be a positive number of tokens, "
                                 f"got {self.sliding_window}")
        if self.layer_types is not None:  # the registry checked their number and names
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ModelLoadError(f"layer_types holds {unknown[0]!r}, which the engine does not run; "
                                     f"it runs {' or '.join(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ModelLoadError("layer_types has sliding_attention layers but sliding_window is not set")

    @property
    def is_gemma(self) -> bool:
        """Gemma 2 / 3 layout: (1 + w) RMSNorms, a norm before and after attention and MLP, embeddings
        scaled by sqrt(hidden_size)."""
        return self.architecture in GEMMA_ARCHITECTURES

    @property
    def qk_norm(self) -> bool:
        """Queries and keys are RMS-normalized per head before RoPE (Gemma 3)."""
        return self.architecture == "Gemma3ForCausalLM"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` in tokens, None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def attention_scale(self) -> float:
        """Softmax scale: query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def max_model_len(self) -> int:
        """max_position_embeddings capped by context_limit: the engine attends through sliding windows
        itself, so a window does not cap the sequence as it does for the registry's full attention."""
        return min(c for c in (self.max_position_embeddings, self.context_limit) if c)

    def num_parameters(self) -> int:
        """Parameter count of this Llama- or Gemma-family architecture (embedding counted once when tied)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        mlp = 3 * h * self.intermediate_size + ((2 * self.intermediate_size + h) if self.mlp_bias else 0)
        per_layer = attn + mlp + (4 if self.is_gemma else 2) * h
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
    # Gemma names its activation hidden_activation (older Gemma 2 files also carry hidden_act).
    act = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported; "
                             f"expected one of {', '.join(SUPPORTED_ACTIVATIONS)}")

    def need(name: str) -> Any:
        if name not in raw:
            raise ModelLoadError(f"{source}: required field {name!r} is missing")
        return raw[name]

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    head_dim = raw.get("head_dim") or (hidden // heads if isinstance(hidden, int) and heads else 0)
    # transformers 5 writes rope_parameters (theta inside); 4.x and most checkpoints write
    # rope_theta + rope_scaling.
    rope_params = raw.get("rope_parameters") or {}
    local_theta = raw.get("rope_local_base_freq")  # Gemma 3 in transformers 4.x
    if isinstance(rope_params.get("full_attention"), dict):  # one block per layer type (Gemma 3, 5.x)
        local = rope_params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"{source}: rope_parameters.sliding_attention of type "
                                 f"{local['rope_type']!r} is not supported (only 'default')")
        local_theta = local.get("rope_theta", local_theta)
        rope_params = rope_params["full_attention"]
    rope_theta = float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling_raw = raw.get("rope_scaling") or rope_params
    qkv_bias = arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False))
    o_bias = arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False))
    sliding = window_of(raw, arch)
    try:
        layer_types = layer_types_of(raw, arch, sliding, source)
    except ConfigError as exc:
        raise ModelLoadError(str(exc)) from None
    gemma = arch in GEMMA_ARCHITECTURES
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
            layer_types=layer_types,
            hidden_act=act,
            query_pre_attn_scalar=_optional_float(raw, "query_pre_attn_scalar") if gemma else None,
            # transformers' Gemma 3 ignores attn_logit_softcapping (its attention never applies it).
            attn_logit_softcapping=(_optional_float(raw, "attn_logit_softcapping")
                                    if arch == "Gemma2ForCausalLM" else None),
            final_logit_softcapping=_optional_float(raw, "final_logit_softcapping") if gemma else None,
            rope_local_theta=float(local_theta) if local_theta is not None else None,
        )
    except ModelLoadError as exc:  # __post_init__ does not know the file name; need() already says it
        message = str(exc)
        raise ModelLoadError(message if message.startswith(source) else f"{source}: {message}") from None


def _optional_float(raw: dict[str, Any], name: str) -> float | None:
    """A float field that may be absent or null."""
    value = raw.get(name)
    return None if value is None else float(value)


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

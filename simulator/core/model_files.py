"""The fields of a local checkpoint's config.json that a registry shape (`ModelSpec`) holds (read from its
folder, errors naming the file), and the parameter count of a decoder estimated from its shape (config.json
does not hold it). Imports nothing of the registry, which reads folders through it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from simulator.core.errors import ConfigError

if TYPE_CHECKING:
    from simulator.core.models import ModelSpec


def read_config(folder: str) -> tuple[dict[str, Any], str]:
    """The `ModelSpec` fields of `folder`/config.json (`config_fields`), and the file's path."""
    file = Path(folder) / "config.json"
    if not file.exists():
        raise ConfigError(f"{folder}: the folder has no config.json (the model's shape is read from it)")
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file}: cannot read the model's config ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    return config_fields(raw, str(file)), str(file)


def config_fields(raw: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The `ModelSpec` fields of a Hugging Face config.json (any decoder; `source` names it in errors);
    the parameter count, which config.json does not hold, comes from `estimate_params`."""
    def need(field: str, *others: str) -> Any:
        for key in (field, *others):
            if key in raw:
                return raw[key]
        raise ConfigError(f"{source}: required field {field!r} is missing")

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    arch = (raw.get("architectures") or ["unknown"])[0]
    sliding = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        sliding = None  # Qwen2 configs carry a window they do not use
    return dict(
        architecture=arch, vocab_size=need("vocab_size"), hidden_size=hidden,
        intermediate_size=need("intermediate_size", "ffn_dim"), num_hidden_layers=need("num_hidden_layers"),
        num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or (hidden // heads if isinstance(hidden, int) and heads else 0),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
        layer_types=tuple(raw["layer_types"]) if raw.get("layer_types") else None,
        sliding_window=int(sliding) if sliding else None,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"))


def estimate_params(m: ModelSpec) -> int:
    """Parameters of a decoder of this shape: gated MLP (Llama, Mistral, Qwen2), plain for OPT."""
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    h, f = m.hidden_size, m.intermediate_size
    attn = 2 * h * q + 2 * h * kv + ((q + 2 * kv) if m.qkv_bias else 0)
    mlp = (2 if m.architecture == "OPTForCausalLM" else 3) * h * f
    embed = m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
    return m.num_hidden_layers * (attn + mlp + 2 * h) + embed + h

"""A local checkpoint folder's config.json read into a registry shape (`ModelSpec`), and the parameter
count of a decoder estimated from its shape (config.json does not hold it)."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from simulator.core.errors import ConfigError
from simulator.core.models import ModelSpec


@functools.lru_cache(maxsize=16)
def read_folder(path: str, shown: str) -> ModelSpec:
    """The shape in `path`/config.json (read once per process; `shown` names it)."""
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file}: cannot read the model's config ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    return spec_from_config(raw, name=shown, source=str(file))


def spec_from_config(raw: dict[str, Any], name: str = "", source: str = "config.json") -> ModelSpec:
    """The memory-relevant shape of a Hugging Face config.json (any decoder; `source` names it in errors).

    The parameter count, which config.json does not hold, is counted from the architecture:
    `estimate_params`.
    """
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
    try:
        spec = ModelSpec(
            name=name, architecture=arch, vocab_size=need("vocab_size"), hidden_size=hidden,
            intermediate_size=need("intermediate_size", "ffn_dim"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or (hidden // heads if isinstance(hidden, int) and heads else 0),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            layer_types=tuple(raw["layer_types"]) if raw.get("layer_types") else None,
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"))
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return spec.replace(num_params=estimate_params(spec))


def estimate_params(m: ModelSpec) -> int:
    """Parameters of a decoder of this shape: gated MLP (Llama, Mistral, Qwen2), plain for OPT."""
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    h, f = m.hidden_size, m.intermediate_size
    attn = 2 * h * q + 2 * h * kv + ((q + 2 * kv) if m.qkv_bias else 0)
    mlp = (2 if m.architecture == "OPTForCausalLM" else 3) * h * f
    embed = m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
    return m.num_hidden_layers * (attn + mlp + 2 * h) + embed + h

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


def read_config(folder: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The `ModelSpec` fields of `folder`/config.json (`config_fields`), the text model's raw fields
    (`text_fields`) and the file's path."""
    file = Path(folder) / "config.json"
    if not file.exists():
        raise ConfigError(f"{folder}: the folder has no config.json (the model's shape is read from it)")
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file}: cannot read the model's config ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    return config_fields(raw, str(file)), text_fields(raw), str(file)


def text_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The fields of the text decoder: a multimodal config (Gemma 3's, Llama 4's) nests them under
    text_config, which overrides the top level (as vLLM's `get_text_config`); others are the top level."""
    text = raw.get("text_config")
    return {**raw, **text} if isinstance(text, dict) else raw


def layer_types_of(raw: dict[str, Any], arch: str, sliding: int | None,
                   source: str = "config.json") -> tuple[str, ...] | None:
    """Each layer's attention as transformers derives it: config.json's layer_types, else the fixed
    pattern of the architecture when a window is set (Gemma 2 alternates starting with a sliding layer,
    Gemma 3 attends fully every sliding_window_pattern-th layer, Qwen2 slides from max_window_layers on),
    else every layer slides (Mistral); None when every layer attends fully."""
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list):
            raise ConfigError(f"{source}: field 'layer_types' must be a list")
        if not sliding:  # the architecture ignores its window: those layers attend fully
            types = ["full_attention" if t == "sliding_attention" else t for t in types]
        return None if all(t == "full_attention" for t in types) else tuple(types)
    layers = raw.get("num_hidden_layers")
    if not sliding or not isinstance(layers, int):
        return None
    if arch == "Gemma2ForCausalLM":
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
    if arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6))
        if not isinstance(pattern, int) or pattern < 1:
            raise ConfigError(f"{source}: field 'sliding_window_pattern' must be a positive integer, "
                              f"got {pattern!r}")
        return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                     for i in range(layers))
    if arch == "Qwen2ForCausalLM":
        first = raw.get("max_window_layers", 28)
        if not isinstance(first, int):
            raise ConfigError(f"{source}: field 'max_window_layers' must be an integer, got {first!r}")
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers)) \
            if first < layers else None
    return ("sliding_attention",) * layers


def window_of(raw: dict[str, Any], arch: str) -> int | None:
    """The sliding window the layers use: config.json's sliding_window, except where the architecture
    ignores it (Qwen2 without use_sliding_window)."""
    sliding = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        return None
    return sliding or None


def config_fields(raw: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The `ModelSpec` fields of a Hugging Face config.json (any decoder, its text model for a multimodal
    one; `source` names it in errors); the parameter count, which config.json does not hold, comes from
    `estimate_params`."""
    arch = (raw.get("architectures") or ["unknown"])[0]
    raw = text_fields(raw)

    def need(field: str, *others: str) -> Any:
        for key in (field, *others):
            if key in raw:
                return raw[key]
        raise ConfigError(f"{source}: required field {field!r} is missing")

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    sliding = window_of(raw, arch)
    mla = raw.get("kv_lora_rank")
    return dict(
        architecture=arch, vocab_size=need("vocab_size"), hidden_size=hidden,
        intermediate_size=need("intermediate_size", "ffn_dim"), num_hidden_layers=need("num_hidden_layers"),
        num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or _head_dim(raw, hidden, heads),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
        layer_types=layer_types_of(raw, arch, sliding, source),
        sliding_window=int(sliding) if sliding else None,
        kv_lora_rank=mla, qk_rope_head_dim=raw.get("qk_rope_head_dim") if mla else None,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"))


def _head_dim(raw: dict[str, Any], hidden: Any, heads: Any) -> int:
    """The query/key head width when config.json does not name it: MLA's no-RoPE plus RoPE parts, else
    hidden_size / num_attention_heads."""
    if raw.get("kv_lora_rank") and raw.get("qk_nope_head_dim") and raw.get("qk_rope_head_dim"):
        return raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else 0


def _attention_params(m: ModelSpec, raw: dict[str, Any]) -> int:
    """One layer's attention weights: MLA's low-rank projections (DeepSeek V2/V3), else Q, K, V and O."""
    h, heads = m.hidden_size, m.num_attention_heads
    if m.is_mla:
        rope, latent = m.qk_rope_head_dim, m.kv_lora_rank
        nope = raw.get("qk_nope_head_dim") or m.head_dim - rope
        v = raw.get("v_head_dim") or nope
        q_rank = raw.get("q_lora_rank")
        q = h * q_rank + q_rank * heads * (nope + rope) if q_rank else h * heads * (nope + rope)
        return q + h * (latent + rope) + latent * heads * (nope + v) + heads * v * h
    q, kv = heads * m.head_dim, m.num_key_value_heads * m.head_dim
    return 2 * h * q + 2 * h * kv + ((q + 2 * kv) if m.qkv_bias else 0)


def _mlp_params(m: ModelSpec, raw: dict[str, Any]) -> int:
    """The MLP weights of all layers: dense (gated, or plain for OPT), or mixtures of experts where
    config.json counts experts (Mixtral and gpt-oss num_local_experts, DeepSeek n_routed_experts with
    shared experts and first_k_dense_replace dense layers, Qwen MoE num_experts)."""
    h, f, layers = m.hidden_size, m.intermediate_size, m.num_hidden_layers
    dense = (2 if m.architecture == "OPTForCausalLM" else 3) * h * f
    experts = raw.get("num_local_experts") or raw.get("n_routed_experts") or raw.get("num_experts")
    if not isinstance(experts, int) or experts < 2:
        return layers * dense
    expert_f = raw.get("moe_intermediate_size") or f
    shared = 3 * h * expert_f * (raw.get("n_shared_experts") or 0)
    shared += 3 * h * (raw.get("shared_expert_intermediate_size") or 0)
    moe = experts * 3 * h * expert_f + h * experts + shared  # the router: one logit per expert
    num_dense = min(raw.get("first_k_dense_replace") or 0, layers)
    return num_dense * dense + (layers - num_dense) * moe


def estimate_params(m: ModelSpec, raw: dict[str, Any] | None = None) -> int:
    """Parameters of a decoder of this shape (`raw`: its config.json, for MLA and expert counts)."""
    raw = raw or {}
    h = m.hidden_size
    embed = m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
    return m.num_hidden_layers * (_attention_params(m, raw) + 2 * h) + _mlp_params(m, raw) + embed + h

"""A local checkpoint's config.json read into a registry shape: the same KV layout as the registry's entry
for the same model, whatever way the file spells it (nested text config, window patterns, MLA)."""
from __future__ import annotations

import json

import pytest

from simulator.core.errors import ConfigError
from simulator.core.kv_layout import model_kv_layout
from simulator.core.model_files import config_fields, estimate_params, layer_types_of
from simulator.core.models import ModelSpec, get_model

GEMMA_3_27B_TEXT = {
    "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "num_attention_heads": 32,
    "num_hidden_layers": 62, "num_key_value_heads": 16, "sliding_window": 1024, "sliding_window_pattern": 6,
    "max_position_embeddings": 131072, "vocab_size": 262208}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "sliding_window": 4096, "torch_dtype": "bfloat16", "vocab_size": 32000}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "num_attention_heads": 128,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "torch_dtype": "bfloat16", "vocab_size": 129280,
    "n_routed_experts": 256, "n_shared_experts": 1, "moe_intermediate_size": 2048, "first_k_dense_replace": 3}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "vocab_size": 32000, "torch_dtype": "bfloat16"}


def _read(tmp_path, raw: dict) -> ModelSpec:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return get_model(str(tmp_path))


def _same_kv(spec: ModelSpec, registered: str) -> None:
    known = get_model(registered)
    assert spec.attention_types == known.attention_types
    assert (spec.sliding_window, spec.kv_elements_per_layer, spec.bytes_per_token, spec.max_model_len) == \
        (known.sliding_window, known.kv_elements_per_layer, known.bytes_per_token, known.max_model_len)
    assert model_kv_layout(spec, 16, 2) == model_kv_layout(known, 16, 2)  # 2: bf16 bytes per element


@pytest.mark.parametrize("raw", [
    {"architectures": ["Gemma3ForCausalLM"], "torch_dtype": "bfloat16", **GEMMA_3_27B_TEXT},
    # The hub's gemma-3-27b-it: a multimodal config with the text decoder under text_config.
    {"architectures": ["Gemma3ForConditionalGeneration"], "torch_dtype": "bfloat16",
     "text_config": GEMMA_3_27B_TEXT, "vision_config": {"hidden_size": 1152}},
], ids=["text", "multimodal"])
def test_a_gemma_3_folder_has_the_registrys_hybrid_layout(tmp_path, raw):
    _same_kv(_read(tmp_path, raw), "gemma-3-27b")


def test_a_mistral_window_slides_every_layer_and_does_not_cap_the_length(tmp_path):
    _same_kv(_read(tmp_path, MISTRAL_7B_V01), "mistral-7b-v0.1")


def test_a_deepseek_v3_folder_caches_the_mla_latent(tmp_path):
    spec = _read(tmp_path, DEEPSEEK_V3)
    _same_kv(spec, "deepseek-v3")
    assert spec.is_mla and spec.head_dim == 192
    # Experts and MLA counted: DeepSeek-V3's published 671B parameters (its next-token module aside).
    assert abs(spec.num_params - 671e9) / 671e9 < 0.005


def test_experts_are_counted_in_the_parameter_estimate():
    spec = ModelSpec(name="mixtral", **config_fields(MIXTRAL_8X7B))
    dense = estimate_params(spec)
    moe = estimate_params(spec, MIXTRAL_8X7B)
    assert abs(moe - 46.7e9) / 46.7e9 < 0.005  # Mixtral 8x7B's published 46.7B
    assert moe > 5 * dense > 0


def test_layer_patterns_follow_each_architecture():
    base = {"num_hidden_layers": 6}
    assert layer_types_of(base, "Gemma2ForCausalLM", 4096) == ("sliding_attention", "full_attention") * 3
    assert layer_types_of({**base, "sliding_window_pattern": 3}, "Gemma3ForCausalLM", 512) == \
        ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert layer_types_of({**base, "max_window_layers": 4}, "Qwen2ForCausalLM", 4096) == \
        ("full_attention",) * 4 + ("sliding_attention",) * 2
    assert layer_types_of({**base, "max_window_layers": 6}, "Qwen2ForCausalLM", 4096) is None  # none slides
    assert layer_types_of(base, "MistralForCausalLM", 4096) == ("sliding_attention",) * 6
    assert layer_types_of(base, "LlamaForCausalLM", None) is None
    # A window the architecture ignores (Qwen2 without use_sliding_window) slides no layer.
    qwen = config_fields({**MISTRAL_7B_V01, "architectures": ["Qwen2ForCausalLM"],
                          "layer_types": ["sliding_attention"] * 32})
    assert (qwen["sliding_window"], qwen["layer_types"]) == (None, None)


@pytest.mark.parametrize("edit,match", [
    ({"sliding_window_pattern": 0}, "field 'sliding_window_pattern' must be a positive integer, got 0"),
    ({"layer_types": "sliding"}, "field 'layer_types' must be a list"),
    ({"num_hidden_layers": 61}, None),
])
def test_bad_window_fields_are_named(tmp_path, edit, match):
    raw = {"architectures": ["Gemma3ForCausalLM"], **GEMMA_3_27B_TEXT, **edit}
    if match is None:  # any layer count takes the pattern
        assert _read(tmp_path, raw).attention_types.count("full_attention") == 10
        return
    with pytest.raises(ConfigError, match=r"config\.json: " + match):
        _read(tmp_path, raw)

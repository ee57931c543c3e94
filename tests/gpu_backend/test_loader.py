"""Loading Hugging Face directories: config parsing, sharded safetensors, and typed errors for bad input."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_backend.loader import load_model, resolve_model
from gpu_backend.model import CausalLM
from gpu_backend.model_config import ModelConfig, ModelLoadError, resolve_dtype
from gpu_backend.model_presets import PRESETS
from pagelab.errors import PagelabError
from simulator.core.models import ModelSpec

# Llama-3.2-1B's config.json as transformers 4.x writes it (rope_theta + rope_scaling at top level).
LLAMA_32_1B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 128256,
}


def _copy(src: Path, dst: Path, config_edit=None, drop: str | None = None) -> Path:
    """Copy a checkpoint directory, optionally editing config.json or dropping one tensor."""
    shutil.copytree(src, dst)
    if config_edit is not None:
        config = json.loads((dst / "config.json").read_text())
        config_edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    if drop is not None:
        tensors = load_file(dst / "model.safetensors")
        del tensors[drop]
        save_file(tensors, dst / "model.safetensors")
    return dst


def _shard(src: Path, dst: Path) -> Path:
    """Rewrite src's single safetensors file as two shards plus model.safetensors.index.json."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, members in shards.items():
        save_file({n: tensors[n] for n in members}, dst / file)
        weight_map.update({n: file for n in members})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _same_weights(a: CausalLM, b: CausalLM) -> bool:
    return all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


# -- loading --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_sharded_checkpoint_loads_the_same_weights(hf_model_dirs, tmp_path, name):
    sharded = _shard(hf_model_dirs[name], tmp_path / "sharded")
    assert not (sharded / "model.safetensors").exists()
    assert _same_weights(load_model(sharded), load_model(hf_model_dirs[name]))


def test_loaded_weights_are_the_checkpoints(hf_model_dirs):
    model = load_model(hf_model_dirs["llama"])
    tensors = load_file(hf_model_dirs["llama"] / "model.safetensors")
    attn = model.layers[1].self_attn.qkv_proj.weight
    q_rows = model.config.num_attention_heads * model.config.head_dim
    kv_rows = model.config.num_key_value_heads * model.config.head_dim
    assert torch.equal(attn[:q_rows], tensors["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(attn[q_rows + kv_rows:], tensors["model.layers.1.self_attn.v_proj.weight"])
    assert torch.equal(model.lm_head, tensors["lm_head.weight"])


def test_tied_embeddings_need_no_lm_head(hf_model_dirs):
    assert "lm_head.weight" not in load_file(hf_model_dirs["qwen2"] / "model.safetensors")
    model = load_model(hf_model_dirs["qwen2"])
    assert model.config.tie_word_embeddings and model.lm_head is None
    assert model.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0  # Qwen2 biases were loaded


def test_dtype_by_name(hf_model_dirs):
    model = load_model(hf_model_dirs["llama"], dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_resolve_model_takes_presets_and_paths(hf_model_dirs):
    assert resolve_model("tiny").config.architecture == "LlamaForCausalLM"
    assert resolve_model(hf_model_dirs["qwen2"]).config.architecture == "Qwen2ForCausalLM"
    with pytest.raises(ModelLoadError, match="neither a preset"):
        resolve_model("meta-llama/Llama-3.2-1B")


# -- typed errors ---------------------------------------------------------------------------------------

def test_errors_are_pagelab_errors():
    assert issubclass(ModelLoadError, PagelabError)


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="nothing is downloaded"):
        load_model(tmp_path / "absent")


def test_missing_config(hf_model_dirs, tmp_path):
    path = _copy(hf_model_dirs["llama"], tmp_path / "m")
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(path)


def test_no_safetensors_names_the_other_files(hf_model_dirs, tmp_path):
    path = _copy(hf_model_dirs["llama"], tmp_path / "m")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        load_model(path)


def test_corrupt_safetensors_file(hf_model_dirs, tmp_path):
    path = _copy(hf_model_dirs["llama"], tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(path)


def test_index_naming_a_missing_shard(hf_model_dirs, tmp_path):
    path = _shard(hf_model_dirs["llama"], tmp_path / "m")
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors which is missing"):
        load_model(path)


def test_unsupported_architecture(hf_model_dirs, tmp_path):
    path = _copy(hf_model_dirs["llama"], tmp_path / "m",
                 config_edit=lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ModelLoadError, match=r"config\.json.*unsupported architecture 'GPT2LMHeadModel'"):
        load_model(path)


def test_missing_tensor_is_named(hf_model_dirs, tmp_path):
    path = _copy(hf_model_dirs["llama"], tmp_path / "m", drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        load_model(path)


def test_untied_model_without_lm_head(hf_model_dirs, tmp_path):
    path = _copy(hf_model_dirs["llama"], tmp_path / "m", drop="lm_head.weight")
    with pytest.raises(ModelLoadError, match="'lm_head.weight' is missing"):
        load_model(path)


def test_shape_mismatch_names_tensor_and_shapes(hf_model_dirs, tmp_path):
    path = _copy(hf_model_dirs["llama"], tmp_path / "m", config_edit=lambda c: c.update(intermediate_size=96))
    with pytest.raises(ModelLoadError, match=r"gate_proj\.weight' has shape \(160, 64\).*\(96, 64\)"):
        load_model(path)


# -- config parsing -------------------------------------------------------------------------------------

def test_transformers_4_llama_3_2_config():
    config = ModelConfig.from_hf_dict(LLAMA_32_1B_CONFIG)
    assert config.rope_theta == 500000.0 and config.head_dim == 64
    assert config.rope_scaling.rope_type == "llama3" and config.rope_scaling.factor == 32.0
    assert config.rope_scaling.original_max_position_embeddings == 8192
    assert config.eos_token_ids == (128001, 128008, 128009) and config.tie_word_embeddings
    assert config.num_parameters() == 1_235_814_400
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 16 * 8 * 64 * 2


def test_llama_1b_shape_is_llama_3_2_1b_as_config_json_says():
    # The registry entry the engine builds as llama-1b-shape is Llama 3.2 1B's config.json field for field
    # (the eos list above is the instruct model's; the base model ends on 128001 alone).
    real, preset = ModelConfig.from_hf_dict(LLAMA_32_1B_CONFIG), PRESETS["llama-1b-shape"]
    registry_only = {"name", "aliases", "hf_id", "num_params", "eos_token_ids"}
    fields = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in registry_only]
    assert {f: getattr(real, f) for f in fields} == {f: getattr(preset, f) for f in fields}
    assert preset.num_params == real.num_parameters()
    assert real.name == "" and real.num_params is None  # config.json says neither


def test_mistral_sliding_window_is_run_not_a_length_cap():
    raw = dict(LLAMA_32_1B_CONFIG, architectures=["MistralForCausalLM"], sliding_window=4096,
               rope_scaling=None)
    config = ModelConfig.from_hf_dict(raw)
    assert config.sliding_window == 4096 and config.layer_window(0) == config.layer_window(15) == 4096
    # Every layer slides, in the engine and in the shape the memory core lays its KV cache groups out from.
    assert config.max_model_len == raw["max_position_embeddings"]
    spec = ModelSpec(**{f.name: getattr(config, f.name) for f in dataclasses.fields(ModelSpec)})
    assert spec.layer_types == ("sliding_attention",) * 16
    assert spec.max_model_len == raw["max_position_embeddings"]


@pytest.mark.parametrize("edit,match", [
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types has 3 entries for 16 layers"),
    ({"layer_types": ["local"] * 16}, "layer_types: unknown 'local'"),
    ({"sliding_window": None, "layer_types": ["sliding_attention"] * 16}, None),
    ({"hidden_activation": "relu"}, "hidden_act 'relu'"),
])
def test_bad_hybrid_fields(edit, match):
    raw = {**LLAMA_32_1B_CONFIG, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 512, **edit}
    if match is None:  # no window: layer types are moot, every layer attends fully
        assert ModelConfig.from_hf_dict(raw).layer_window(0) is None
        return
    with pytest.raises(ModelLoadError, match=r"^x/config\.json: .*" + match):
        ModelConfig.from_hf_dict(raw, source="x/config.json")


def test_gemma3_legacy_fields_give_the_same_layout():
    """transformers 4.x Gemma 3 files: rope_local_base_freq and sliding_window_pattern, no layer_types."""
    raw = dict(LLAMA_32_1B_CONFIG, architectures=["Gemma3ForCausalLM"], sliding_window=512,
               sliding_window_pattern=4, rope_local_base_freq=10000.0, rope_theta=1e6, rope_scaling=None,
               hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=64)
    config = ModelConfig.from_hf_dict(raw)
    assert [config.layer_window(i) for i in range(8)] == [512, 512, 512, None] * 2
    assert (config.rope_theta, config.rope_local_theta, config.query_pre_attn_scalar) == (1e6, 1e4, 64.0)


def test_qwen2_bias_and_disabled_sliding_window():
    raw = dict(LLAMA_32_1B_CONFIG, architectures=["Qwen2ForCausalLM"], sliding_window=4096,
               use_sliding_window=False, rope_scaling=None)
    config = ModelConfig.from_hf_dict(raw)
    assert config.qkv_bias and not config.o_bias and config.sliding_window is None


@pytest.mark.parametrize("edit,match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling type 'yarn'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope_scaling type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "linear"}}, "needs field 'factor'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_key_value_heads": 5}, "not a multiple of num_key_value_heads"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"architectures": []}, "'architectures' is missing"),
])
def test_bad_config_fields(edit, match):
    with pytest.raises(ModelLoadError, match=r"^x/config\.json: .*" + match):
        ModelConfig.from_hf_dict(dict(LLAMA_32_1B_CONFIG, **edit), source="x/config.json")


def test_missing_config_field_is_named():
    raw = {k: v for k, v in LLAMA_32_1B_CONFIG.items() if k != "intermediate_size"}
    with pytest.raises(ModelLoadError, match=r"^x/config\.json: required field 'intermediate_size'"):
        ModelConfig.from_hf_dict(raw, source="x/config.json")


def test_resolve_dtype():
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("torch.float16") is torch.float16
    assert resolve_dtype(None) is torch.float32 and resolve_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(ModelLoadError, match="unknown dtype 'int8'"):
        resolve_dtype("int8")

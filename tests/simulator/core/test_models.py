"""The model registry: every entry's numbers agree with its architecture, and names resolve to one entry."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from simulator.core.errors import ConfigError
from simulator.core.model_files import estimate_params
from simulator.core.models import MODELS, ModelSpec, canonical_name, get_model, model_names

ROOT = Path(__file__).resolve().parents[3]
ENTRIES = pytest.mark.parametrize("model", list(MODELS.values()), ids=list(MODELS))


def _llama_family_params(m: ModelSpec) -> int:
    """Parameter count of a Llama/Mistral/Qwen2 decoder, from the architecture alone."""
    kv_dim = m.num_key_value_heads * m.head_dim
    q_dim = m.num_attention_heads * m.head_dim
    attn = 2 * m.hidden_size * q_dim + 2 * m.hidden_size * kv_dim
    if m.qkv_bias:
        attn += q_dim + 2 * kv_dim
    mlp = 3 * m.hidden_size * m.intermediate_size
    layer = attn + mlp + 2 * m.hidden_size  # two RMSNorm weights
    embed = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    return m.num_hidden_layers * layer + embed + m.hidden_size


def _opt_params(m: ModelSpec) -> int:
    """Parameter count of an OPT decoder: biases everywhere, LayerNorm with bias, learned positions (+2)."""
    h, f = m.hidden_size, m.intermediate_size
    layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
    return m.num_hidden_layers * layer + m.vocab_size * h + (m.max_position_embeddings + 2) * h + 2 * h


def _qwen3_params(m: ModelSpec) -> int:
    """Qwen3: the Llama family's count plus an RMSNorm over each query and key head (head_dim each)."""
    return _llama_family_params(m) + m.num_hidden_layers * 2 * m.head_dim


def _gemma3_params(m: ModelSpec) -> int:
    """Gemma 3's text decoder: four RMSNorms around attention and MLP, query/key norms; an untied head
    (tiny-hybrid) adds a second vocabulary matrix."""
    h = m.hidden_size
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    layer = 2 * h * q + 2 * h * kv + 3 * h * m.intermediate_size + 4 * h + 2 * m.head_dim
    return m.num_hidden_layers * layer + m.vocab_size * h * (1 if m.tie_word_embeddings else 2) + h


PARAM_COUNTS = {"OPTForCausalLM": _opt_params, "LlamaForCausalLM": _llama_family_params,
                "Qwen2ForCausalLM": _llama_family_params, "MistralForCausalLM": _llama_family_params,
                "Qwen3ForCausalLM": _qwen3_params, "Gemma3ForCausalLM": _gemma3_params}
# Mixture-of-experts checkpoints in quantized weights (MXFP4, FP8): num_params x dtype bytes is not their
# weight size, so the registry leaves num_params unknown.
UNCOUNTED = {"gpt-oss-20b", "gpt-oss-120b", "deepseek-v3"}
COUNTED = pytest.mark.parametrize("model", [m for n, m in MODELS.items() if n not in UNCOUNTED],
                                  ids=[n for n in MODELS if n not in UNCOUNTED])


@COUNTED
def test_num_params_matches_the_architecture(model):
    # The formulas agree with transformers' models built on the meta device from these configs.
    assert model.architecture in PARAM_COUNTS, f"no parameter count for {model.architecture}"
    assert model.num_params == PARAM_COUNTS[model.architecture](model)


def test_architecture_flags_of_the_checkpoints():
    # What the parameter counts rest on: Qwen2 has q/k/v biases, OPT biases everywhere, and which heads tie.
    assert get_model("qwen2.5-7b").qkv_bias and not get_model("qwen2.5-7b").o_bias
    opt = get_model("opt-13b")
    assert opt.qkv_bias and opt.o_bias and opt.mlp_bias and opt.tie_word_embeddings
    tied = {name for name, m in MODELS.items() if m.tie_word_embeddings}
    assert tied == {"opt-13b", "llama-3.2-1b", "tiny-qwen2", "gemma-3-27b"}


@ENTRIES
def test_entries_are_consistent(model):
    assert MODELS[model.name] is model
    if model.architecture in ("OPTForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        assert model.num_attention_heads * model.head_dim == model.hidden_size
    assert model.num_attention_heads % model.num_key_value_heads == 0
    assert (model.num_params is None) == (model.name in UNCOUNTED) and model.torch_dtype is not None
    # The engine's CPU models run in fp32; every checkpoint is served in its 16-bit dtype.
    assert model.dtype_bytes == (4 if model.name in ("tiny", "tiny-qwen2", "tiny-hybrid") else 2)


def test_simulator_names_read_the_hugging_face_fields():
    qwen = get_model("qwen2.5-7b")
    assert (qwen.num_layers, qwen.num_heads, qwen.num_kv_heads) == (28, 28, 4)
    assert qwen.num_queries_per_kv == 7
    assert qwen.bytes_per_token == qwen.kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2
    assert qwen.weight_bytes == 2 * 7_615_616_512


def test_opt13b_bytes_per_token_is_800_kib():
    # K and V x hidden 5120 x 40 layers x 2 bytes (fp16).
    assert get_model("opt-13b").bytes_per_token == 819_200 == 800 * 1024


def test_kv_bytes_in_another_dtype():
    class Fp8:
        itemsize = 1

    tiny = get_model("tiny")
    assert tiny.kv_bytes_per_token() == 4 * tiny.kv_bytes_per_token(Fp8()) == 2 * 4 * 2 * 64 * 4


def test_max_model_len_is_the_tightest_cap():
    assert get_model("qwen2.5-7b").max_position_embeddings == 131072
    assert get_model("qwen2.5-7b").max_model_len == 32768  # context_limit: YaRN needed beyond
    assert get_model("llama-3.2-1b").max_model_len == 131072
    windowed = get_model("llama-3-8b").replace(sliding_window=4096)
    assert windowed.max_model_len == 4096
    assert windowed.replace(context_limit=2048).max_model_len == 2048


def test_an_alias_is_the_same_entry():
    assert get_model("llama-1b-shape") is get_model("llama-3.2-1b")
    assert canonical_name("llama-1b-shape") == "llama-3.2-1b" == canonical_name("llama-3.2-1b")
    assert canonical_name("/models/my-llama") == "/models/my-llama"  # not ours to rename


def test_every_name_belongs_to_one_entry():
    names = [n for m in MODELS.values() for n in m.names]
    assert len(names) == len(set(names))
    assert sorted(names) == model_names()


def test_unknown_name_lists_every_valid_name():
    with pytest.raises(ConfigError, match="unknown model 'nope'; valid models: ") as info:
        get_model("nope")
    assert "\n" not in str(info.value)
    assert all(name in str(info.value) for name in model_names())
    assert "llama-1b-shape" in str(info.value)


def test_entries_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_model("opt-13b").num_hidden_layers = 1


@pytest.mark.parametrize(("change", "message"), [
    ({"num_key_value_heads": 5}, "not a multiple of num_key_value_heads"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
    ({"num_params": -1}, "num_params must be a positive integer"),
    ({"context_limit": True}, "context_limit must be a positive integer"),
])
def test_bad_shapes_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        get_model("tiny").replace(**change)


def test_unknown_sizes_are_named():
    with pytest.raises(ConfigError, match="tiny: torch_dtype 'int4' has no known size"):
        get_model("tiny").replace(torch_dtype="int4").bytes_per_token  # noqa: B018
    with pytest.raises(ConfigError, match="num_params is unknown"):
        get_model("tiny").replace(num_params=None).weight_bytes  # noqa: B018


def test_the_registry_imports_no_numpy_or_torch():
    # The engine and the simulator both read it; neither's heavy dependencies may come with it.
    code = ("import sys, simulator.core.models; "
            "print(sorted(m for m in ('numpy', 'pandas', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("name", "entry"), [
    ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b"), ("meta-llama/meta-llama-3-8b", "llama-3-8b"),
    ("META-LLAMA/META-LLAMA-3-8B-INSTRUCT", "llama-3-8b"), ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"),
    ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"), ("facebook/opt-13b", "opt-13b"), ("LLAMA-3-8B", "llama-3-8b"),
])
def test_hugging_face_ids_and_their_instruct_variants_name_the_entry(name, entry):
    assert get_model(name) is MODELS[entry]
    assert canonical_name(name) == entry


def test_a_local_folder_is_read_for_its_shape(tmp_path):
    # A Llama-3-8B-Instruct checkpoint's config.json (fields the shape needs, as the hub writes them).
    raw = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
           "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    spec = get_model(str(tmp_path))
    known = get_model("llama-3-8b")
    assert spec.name == str(tmp_path)
    assert (spec.bytes_per_token, spec.max_model_len) == (known.bytes_per_token, known.max_model_len)
    assert spec.num_params == known.num_params == estimate_params(known)
    assert canonical_name(str(tmp_path)) == str(tmp_path)


def test_a_folder_config_missing_a_field_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 2}))
    with pytest.raises(ConfigError, match=r"config.json: required field 'vocab_size' is missing"):
        get_model(str(tmp_path))


def test_a_folder_without_a_config_is_named_as_such(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="the folder has no config.json") as info:
        get_model(str(tmp_path))
    assert str(tmp_path) in str(info.value) and "unknown model" not in str(info.value)


def test_a_file_or_an_empty_name_is_not_read_as_a_checkpoint_folder(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="config.json is a file: give the folder"):
        get_model(str(tmp_path / "config.json"))
    monkeypatch.chdir(tmp_path)  # "" is not the current folder, though Path("") is
    with pytest.raises(ConfigError, match="unknown model ''"):
        get_model("")


def test_the_opt_parameter_count_is_estimated_from_its_shape():
    opt = get_model("opt-13b")
    # Biases, LayerNorm biases and learned positions are left out: within 0.1 %.
    assert abs(estimate_params(opt) - opt.num_params) / opt.num_params < 1e-3

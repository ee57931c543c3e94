"""Model/GPU presets and KV capacity."""
import dataclasses

import pytest

from simulator.core.errors import ConfigError
from simulator.specs import GIB, GPUS, MODELS, get_gpu, get_model, kv_bytes_for, kv_capacity_tokens


def _llama_family_params(m, qkv_bias: bool, tied: bool) -> int:
    """Parameter count of a Llama/Qwen2 decoder, from the architecture alone."""
    kv_dim = m.num_kv_heads * m.head_dim
    attn = 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * kv_dim
    if qkv_bias:
        attn += m.hidden_size + 2 * kv_dim
    mlp = 3 * m.hidden_size * m.intermediate_size
    layer = attn + mlp + 2 * m.hidden_size  # two RMSNorm weights
    embed = m.vocab_size * m.hidden_size * (1 if tied else 2)
    return m.num_layers * layer + embed + m.hidden_size


def _opt_params(m) -> int:
    """Parameter count of an OPT decoder: biases everywhere, LayerNorm with bias, learned positions (+2)."""
    h, f = m.hidden_size, m.intermediate_size
    layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
    return m.num_layers * layer + m.vocab_size * h + (m.max_model_len + 2) * h + 2 * h


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("opt-13b", lambda m: _opt_params(m)),
        ("llama-2-7b", lambda m: _llama_family_params(m, qkv_bias=False, tied=False)),
        ("llama-3-8b", lambda m: _llama_family_params(m, qkv_bias=False, tied=False)),
        ("qwen2.5-7b", lambda m: _llama_family_params(m, qkv_bias=True, tied=False)),
        ("llama-3.2-1b", lambda m: _llama_family_params(m, qkv_bias=False, tied=True)),
        ("tiny", lambda m: _llama_family_params(m, qkv_bias=False, tied=False)),
    ],
)
def test_num_params_matches_architecture(name, expected):
    # Cross-checked once against transformers' models built on the meta device from these configs.
    model = get_model(name)
    assert model.num_params == expected(model)


@pytest.mark.parametrize("model", list(MODELS.values()), ids=list(MODELS))
def test_model_shapes_are_consistent(model):
    assert MODELS[model.name] is model
    assert model.num_heads * model.head_dim == model.hidden_size
    assert model.num_heads % model.num_kv_heads == 0
    assert model.dtype_bytes == (4 if model.name == "tiny" else 2)  # tiny runs in fp32 on a CPU


def test_opt13b_bytes_per_token_is_800_kib():
    # DESIGN.md: 2 x 5120 x 40 x 2 bytes.
    assert get_model("opt-13b").bytes_per_token == 819_200 == 800 * 1024


def test_gqa_presets():
    assert get_model("llama-3-8b").num_kv_heads == 8
    qwen = get_model("qwen2.5-7b")
    assert (qwen.num_layers, qwen.num_kv_heads) == (28, 4)
    # GQA shrinks the KV cache by num_heads / num_kv_heads relative to MHA with the same shape.
    assert get_model("llama-2-7b").bytes_per_token == 4 * get_model("llama-3-8b").bytes_per_token


def test_weight_bytes_in_dtype():
    model = get_model("opt-13b")
    assert model.weight_bytes == 2 * 12_853_473_280
    assert 23.9 < model.weight_bytes / GIB < 24.0


def test_presets_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_model("opt-13b").num_layers = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_gpu("h200").peak_flops = 1.0


@pytest.mark.parametrize("gpu", list(GPUS.values()), ids=list(GPUS))
def test_gpu_coefficients_are_fractions(gpu):
    assert GPUS[gpu.name] is gpu
    assert 0 < gpu.flops_efficiency <= 1
    assert 0 < gpu.bandwidth_efficiency <= 1
    assert 0 <= gpu.step_overhead_s < 0.01
    assert gpu.pcie_bandwidth < gpu.hbm_bandwidth


def test_gpu_generations_ordered():
    a40, a80, h100, h200 = (get_gpu(n) for n in ("a100-40gb", "a100-80gb", "h100-80gb", "h200"))
    assert a40.hbm_bandwidth < a80.hbm_bandwidth < h100.hbm_bandwidth < h200.hbm_bandwidth
    assert a40.peak_flops == a80.peak_flops < h100.peak_flops == h200.peak_flops
    assert a40.memory_bytes < a80.memory_bytes == h100.memory_bytes < h200.memory_bytes


@pytest.mark.parametrize(("getter", "kind"), [(get_model, "model"), (get_gpu, "gpu")])
def test_unknown_name_lists_valid_names(getter, kind):
    with pytest.raises(ConfigError, match=f"unknown {kind} 'nope'") as info:
        getter("nope")
    valid = MODELS if kind == "model" else GPUS
    assert all(name in str(info.value) for name in valid)


def test_paper_kv_budget_is_15728_slots():
    assert kv_capacity_tokens(get_model("opt-13b"), kv_memory_gb=12) == 15_728
    assert kv_capacity_tokens("opt-13b", gpu="h200", kv_memory_gb=12) == 15_728  # explicit budget wins


def test_capacity_from_gpu_memory():
    # 40 GiB * 0.9 = 38,654,705,664; - 25,706,946,560 weights - 1 GiB reserve = 11,874,017,280 bytes;
    # / 819,200 = 14,494.6 slots (15,805.4 without the reserve).
    assert kv_capacity_tokens("opt-13b", "a100-40gb") == 14_494
    assert kv_capacity_tokens("opt-13b", "a100-40gb", activation_reserve_bytes=0) == 15_805


def test_capacity_grows_with_memory():
    small = kv_capacity_tokens("llama-3-8b", "a100-80gb", gpu_memory_utilization=0.5)
    large = kv_capacity_tokens("llama-3-8b", "a100-80gb", gpu_memory_utilization=0.95)
    bigger_gpu = kv_capacity_tokens("llama-3-8b", "h200", gpu_memory_utilization=0.95)
    assert small < large < bigger_gpu
    kv = kv_bytes_for("llama-3-8b", "a100-80gb", gpu_memory_utilization=0.95)
    per_token = get_model("llama-3-8b").bytes_per_token
    assert large * per_token <= kv < (large + 1) * per_token


def test_weights_that_do_not_fit_are_refused():
    with pytest.raises(ConfigError, match="opt-13b does not fit on a100-40gb"):
        kv_capacity_tokens("opt-13b", "a100-40gb", gpu_memory_utilization=0.6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_memory_gb": 0}, "kv_memory_gb must be positive"),
        ({"kv_memory_gb": float("nan")}, "kv_memory_gb must be positive"),
        ({}, "give either a gpu or kv_memory_gb"),
        ({"gpu": "a100-80gb", "gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu": "a100-80gb", "gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"gpu": "a100-80gb", "activation_reserve_bytes": -1}, "activation_reserve_bytes"),
        ({"kv_memory_gb": 1e-4}, "hold no token"),
        ({"gpu": "b200"}, "unknown gpu"),
    ],
)
def test_bad_capacity_inputs(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        kv_capacity_tokens("opt-13b", **kwargs)


def test_tiny_matches_the_engine_preset():
    torch = pytest.importorskip("torch")
    from gpu_backend.model_presets import build_preset
    engine = build_preset("tiny")
    spec = get_model("tiny")
    assert sum(p.numel() for p in engine.parameters()) == spec.num_params
    c = engine.config
    assert (c.num_hidden_layers, c.num_key_value_heads, c.head_dim) == (spec.num_layers, spec.num_kv_heads,
                                                                        spec.head_dim)
    assert spec.bytes_per_token == c.kv_bytes_per_token(torch.float32)

"""GPU presets and the KV capacity of a registry model on one."""
import dataclasses

import pytest

from simulator.core.errors import ConfigError
from simulator.core.models import get_model
from simulator.presets import GIB, GPUS, get_gpu, kv_bytes_for, kv_capacity, kv_capacity_tokens


def test_gqa_shrinks_the_kv_cache():
    # GQA shrinks the KV cache by num_heads / num_kv_heads relative to MHA with the same shape.
    assert get_model("llama-2-7b").bytes_per_token == 4 * get_model("llama-3-8b").bytes_per_token


def test_weight_bytes_in_dtype():
    model = get_model("opt-13b")
    assert model.weight_bytes == 2 * 12_853_473_280
    assert 23.9 < model.weight_bytes / GIB < 24.0


def test_gpu_presets_are_frozen():
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


def test_unknown_gpu_lists_valid_names():
    with pytest.raises(ConfigError, match="unknown gpu 'nope'") as info:
        get_gpu("nope")
    assert all(name in str(info.value) for name in GPUS)


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
        ({"kv_memory_gb": float("inf")}, "kv_memory_gb inf GiB is too large"),
        ({"kv_memory_gb": 1e300}, r"kv_memory_gb 1e\+300 GiB is too large"),
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


def test_capacity_is_vllms_arithmetic():
    # 0.9 x 80 GiB - 16,060,522,496 bytes of weights - 1 GiB reserve, in 128 KiB tokens, 16-token blocks.
    cap = kv_capacity("llama-3-8b", "a100-80gb", block_size=16)
    kv_bytes = 0.9 * 80 * GIB - 8_030_261_248 * 2 - GIB
    assert cap.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert cap.capacity_tokens == int(kv_bytes // 131_072) == kv_capacity_tokens("llama-3-8b", "a100-80gb")
    assert cap.num_blocks == cap.capacity_tokens // 16
    assert cap.num_tokens == cap.num_blocks * 16
    assert cap.max_concurrency == cap.num_blocks / (8192 // 16)
    assert cap.lines()[2] == f"GPU KV cache size: {cap.num_tokens:,} tokens ({cap.num_blocks:,} blocks of 16)"
    assert cap.lines()[3] == f"Maximum concurrency for 8,192 tokens per request: {cap.max_concurrency:.2f}x"


def test_fp8_kv_cache_holds_twice_the_tokens_and_utilization_scales_the_pool():
    bf16 = kv_capacity("llama-3-8b", "h100-80gb")
    fp8 = kv_capacity("llama-3-8b", "h100-80gb", kv_cache_dtype="fp8")
    assert (fp8.kv_cache_dtype, bf16.kv_cache_dtype) == ("fp8", "bfloat16")
    assert fp8.bytes_per_token * 2 == bf16.bytes_per_token
    assert fp8.capacity_tokens in (2 * bf16.capacity_tokens, 2 * bf16.capacity_tokens + 1)
    smaller = kv_capacity("llama-3-8b", "h100-80gb", gpu_memory_utilization=0.5)
    assert smaller.pool_bytes == int(0.5 * 80 * GIB - 8_030_261_248 * 2 - GIB)
    assert kv_capacity("opt-13b", kv_cache_dtype="fp16", kv_memory_gb=12).capacity_tokens == 15_728


def test_a_partial_last_block_still_counts_for_concurrency():
    # max_model_len 100 in 16-token blocks needs 7 blocks per request, as vLLM's cdiv.
    cap = kv_capacity("tiny", capacity_tokens=16 * 70, max_model_len=100)
    assert cap.max_concurrency == 10.0
    assert cap.sized_by == "capacity_tokens" and cap.gpu is None


def test_an_unknown_kv_dtype_is_named():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, bfloat16"):
        kv_capacity("tiny", kv_memory_gb=1, kv_cache_dtype="int3")


@pytest.mark.parametrize("model", ["gemma-3-27b", "mistral-7b-v0.1", "llama-3.1-8b"])
def test_a_pool_given_in_tokens_reports_those_tokens_and_records_them_as_its_summary_does(model):
    # 38,736 is what gemma-3-27b's own summary reports on an H100-80GB: given back, it sizes the same pool.
    from simulator.config import SimConfig
    from simulator.loop import simulate
    from traces import load_trace

    config = SimConfig(model=model, allocator="paged", capacity_tokens=38_736, record_events=False)
    pool = config.kv_capacity()
    assert pool.num_tokens == 38_736 and pool.num_blocks % len(pool.layout.groups) == 0
    if len(pool.layout.groups) > 1:  # contiguous allocators get the same bytes, without padding layers
        assert config.capacity() == pool.pool_bytes // pool.bytes_per_token > pool.num_tokens
    else:
        assert config.capacity() == 38_736
    result = simulate(load_trace("azure-conv").iloc[:20].reset_index(drop=True), config)
    assert result.summary["capacity_tokens"] == result.config["capacity_tokens"] == 38_736

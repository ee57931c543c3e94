"""KV cache groups and the pool they share, against numbers worked out by hand from vLLM's rules
(vllm/v1/core/kv_cache_utils.py and vllm/v1/kv_cache_interface.py at the pinned commit)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.core.errors import ConfigError
from simulator.core.kv_layout import LayerKV, kv_cache_groups, model_kv_layout
from simulator.core.models import MODELS, get_model
from simulator.presets import GIB, kv_capacity

KV = 40  # GiB of KV memory every hand computation below is given
STEP = 8192  # max_num_batched_tokens


def test_llama_3_1_8b_is_one_full_group():
    cap = kv_capacity("llama-3.1-8b", kv_memory_gb=KV, max_num_batched_tokens=STEP)
    # 32 layers x 8 KV heads x 128 dims x K,V x 2 bytes = 131,072 bytes per token; a page of one layer is
    # 16 tokens x 4,096 bytes = 65,536; get_num_blocks: 40 GiB // 65,536 // 32 layers.
    assert cap.bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131_072
    assert cap.layout.page_size_bytes == 16 * 8 * 128 * 2 * 2 == 65_536
    assert cap.num_blocks == 40 * 2**30 // 65_536 // 32 == 20_480
    assert cap.num_tokens == 20_480 * 16 == 327_680
    # 131,072 tokens need 131,072 / 16 = 8,192 blocks: 20,480 / 8,192 = 2.5.
    assert cap.max_concurrency == 20_480 / 8_192 == 2.5
    assert len(cap.layout.groups) == 1 and not cap.grouped


def test_gpt_oss_20b_is_two_groups_of_twelve():
    cap = kv_capacity("gpt-oss-20b", kv_memory_gb=KV, max_num_batched_tokens=STEP)
    layout = cap.layout
    # 24 layers alternating sliding (even) and full (odd): 12 and 12, fewer than 1.5 x 12, so the group
    # size is 12 and nothing pads.
    assert [g.spec.kind for g in layout.groups] == ["sliding_window", "full"]
    assert layout.groups[0].layers == tuple(range(0, 24, 2))
    assert layout.groups[1].layers == tuple(range(1, 24, 2))
    assert layout.group_size == 12 and layout.num_padding_layers == 0
    # Page: 16 tokens x 8 heads x 64 dims x K,V x 2 bytes = 32,768; a block is 12 such pages.
    assert layout.page_size_bytes == 16 * 8 * 64 * 2 * 2 == 32_768
    assert cap.num_blocks == 40 * 2**30 // 32_768 // 12 == 109_226
    # GPU KV cache size: blocks // 2 groups x 16.
    assert cap.num_tokens == 109_226 // 2 * 16 == 873_808
    # Per request: full 131,072 / 16 = 8,192 blocks; the window min(128 - 1 + 8,192, 131,072) = 8,319
    # tokens -> ceil(8,319 / 16) + 1 = 521 blocks.
    assert cap.blocks_per_request == 8_192 + 521
    assert cap.max_concurrency == pytest.approx(109_226 / 8_713)


def test_gemma_3_27b_pads_its_sliding_groups():
    cap = kv_capacity("gemma-3-27b", kv_memory_gb=KV, max_num_batched_tokens=STEP)
    layout = cap.layout
    # 62 layers, every sixth global: 10 full, 52 sliding. 52 >= 1.5 x 10, so groups of 10: ceil(52 / 10) = 6
    # sliding groups (layers[i::6]: 9, 9, 9, 9, 8, 8 layers, 8 padding) and one full group.
    assert [len(g.layers) for g in layout.groups] == [9, 9, 9, 9, 8, 8, 10]
    assert layout.groups[-1].layers == tuple(range(5, 62, 6))
    assert layout.num_padding_layers == 8
    # Page: 16 x 16 heads x 128 x 2 x 2 = 131,072 bytes; a block 10 pages = 1,310,720 bytes.
    assert layout.block_bytes == 10 * 16 * 16 * 128 * 2 * 2 == 1_310_720
    assert cap.num_blocks == 40 * 2**30 // 131_072 // 10 == 32_768
    assert cap.num_tokens == 32_768 // 7 * 16 == 74_896
    # Per request: 6 sliding groups of ceil((1,023 + 8,192) / 16) + 1 = 577 blocks, one full of 8,192.
    assert cap.blocks_per_request == 6 * 577 + 8_192 == 11_654
    assert cap.max_concurrency == pytest.approx(32_768 / 11_654)


def test_deepseek_v3_in_fp8_caches_one_latent_per_token():
    cap = kv_capacity("deepseek-v3", kv_memory_gb=KV, kv_cache_dtype="fp8", max_num_batched_tokens=STEP)
    # MLA: 512 latent + 64 RoPE dims, one head, 1 byte each: 576 bytes per token and layer, x 61 layers.
    assert cap.bytes_per_token == 61 * 576 == 35_136
    assert cap.layout.groups[0].spec.kind == "mla" and cap.layout.page_size_bytes == 16 * 576
    assert cap.num_blocks == 40 * 2**30 // (16 * 576) // 61 == 76_398
    assert cap.num_tokens == 76_398 * 16
    assert cap.max_concurrency == 76_398 / (163_840 // 16)


def test_mistral_slides_on_every_layer_in_one_group():
    cap = kv_capacity("mistral-7b-v0.1", kv_memory_gb=KV, max_num_batched_tokens=2048)
    assert len(cap.layout.groups) == 1 and cap.grouped
    # min(4,095 + 2,048, 32,768) = 6,143 tokens -> ceil(6,143 / 16) + 1 = 385 blocks, not 32,768 / 16.
    assert cap.blocks_per_request == 385
    assert cap.num_blocks == 40 * 2**30 // (16 * 8 * 128 * 2 * 2) // 32


def test_the_default_step_budget_follows_the_named_gpu_where_the_pool_size_is_given():
    # vLLM's server steps 2,048 tokens on an A100, 8,192 on an H100; a window holds
    # ceil((4,095 + budget) / 16) + 1 blocks: 385 or 769 of the 15,360 blocks in 30 GiB.
    a100 = kv_capacity("mistral-7b-v0.1", "a100-80gb", kv_memory_gb=30)
    h100 = kv_capacity("mistral-7b-v0.1", "h100-80gb", kv_memory_gb=30)
    assert (a100.max_num_batched_tokens, a100.blocks_per_request) == (2048, 385)
    assert (h100.max_num_batched_tokens, h100.blocks_per_request) == (8192, 769)
    assert a100.num_blocks == h100.num_blocks == 30 * 2**30 // 65_536 // 32 == 15_360
    assert round(a100.max_concurrency, 2) == 39.90


def test_a_pool_too_small_for_one_request_reports_vllms_refusal_and_the_longest_length_that_fits():
    cap = kv_capacity("gemma-3-27b", kv_memory_gb=0.5, max_num_batched_tokens=STEP)
    # Per layer a page is 16 x 16 heads x 128 x K,V x 2 bytes = 131,072 bytes, a block 10 layer slots of
    # it. A request of L <= 9,215 tokens holds c = ceil(L / 16) blocks of the full group and c + 1 of each
    # of the 6 sliding groups, every block all 10 slots, the 8 padding ones included: (70c + 60) pages.
    # 0.5 GiB is 4,096 pages: c <= 57, so L <= 912 (1,040 if padding counted nothing).
    assert cap.layout.request_bytes(912, STEP) == (70 * 57 + 60) * 131_072 <= 2**29
    assert cap.layout.request_bytes(913, STEP) > 2**29
    assert not cap.fits_max_model_len and cap.longest_model_len() == 912
    assert cap.to_dict()["estimated_max_model_len"] == 912
    assert cap.lines()[-1].startswith("vLLM would not start: to serve one request of max_model_len 131,072")
    assert cap.lines()[-1].endswith("the estimated maximum model length is 912.")
    # Llama 3.1 8B: 128 KiB a token, so 1 GiB serves exactly 8,192 tokens.
    small = kv_capacity("llama-3.1-8b", kv_memory_gb=1)
    assert small.request_bytes == 131_072 * 131_072 and small.longest_model_len() == 8192
    fits = kv_capacity("llama-3.1-8b", kv_memory_gb=KV)
    assert fits.fits_max_model_len and fits.to_dict()["estimated_max_model_len"] is None
    assert not fits.lines()[-1].startswith("vLLM would not start")


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["llama-3.1-8b", "gemma-3-27b", "gpt-oss-20b", "mistral-7b-v0.1", "deepseek-v3"]),
       pool=st.integers(1, 2**36), max_len=st.integers(1, 200_000), step=st.integers(1, 16_384))
def test_the_longest_model_len_is_the_last_length_that_fits(name, pool, max_len, step):
    layout = model_kv_layout(get_model(name), 16, 2)
    longest = layout.longest_model_len(pool, max_len, step)
    assert 0 <= longest <= max_len
    if longest:
        assert layout.request_bytes(longest, step) <= pool
    if longest < max_len:  # the next length does not fit, and a request never shrinks as it grows
        assert layout.request_bytes(longest + 1, step) > pool


def test_a_group_size_near_the_largest_type_pads_the_smaller():
    # 12 sliding + 13 full (gpt-oss-20b with a drafter layer): 13 < 1.5 x 12, so two groups of 13.
    sw, full = LayerKV("sliding_window", 16, 4096, 128), LayerKV("full", 16, 4096)
    layout = kv_cache_groups([sw] * 12 + [full] * 13)
    assert [(g.spec.kind, len(g.layers)) for g in layout.groups] == [("sliding_window", 12), ("full", 13)]
    assert layout.group_size == 13 and layout.num_padding_layers == 1


def test_disabling_the_hybrid_manager_keeps_every_token_on_every_layer():
    hybrid = kv_capacity("gemma-3-27b", kv_memory_gb=KV, max_num_batched_tokens=STEP)
    flat = kv_capacity("gemma-3-27b", kv_memory_gb=KV, max_num_batched_tokens=STEP, hybrid=False)
    assert len(flat.layout.groups) == 1 and not flat.grouped
    assert flat.num_blocks == 40 * 2**30 // (16 * 16 * 128 * 2 * 2) // 62 and flat.blocks_per_request == 8_192
    assert hybrid.max_concurrency > 2 * flat.max_concurrency
    # A model that only slides has no full layer to unify with.
    assert model_kv_layout(get_model("mistral-7b-v0.1"), 16, 2, hybrid=False).is_hybrid


@pytest.mark.parametrize("name", [n for n, m in MODELS.items() if m.layer_types is None and not m.is_mla])
def test_models_without_layer_types_keep_their_numbers(name):
    # The arithmetic before groups existed: slots = pool // bytes per token, blocks = slots // 16,
    # concurrency = blocks / ceil(L / 16).
    model = get_model(name)
    cap = kv_capacity(model, kv_memory_gb=3.5)
    slots = int(3.5 * GIB // (2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim
                              * model.dtype_bytes))
    assert (cap.capacity_tokens, cap.num_blocks) == (slots, slots // 16)
    assert cap.max_concurrency == slots // 16 / -(-model.max_model_len // 16)
    assert "kv_groups" not in cap.to_dict() and not any("groups" in line for line in cap.lines())


def test_layers_with_different_pages_are_refused():
    with pytest.raises(ConfigError, match="different KV page sizes"):
        kv_cache_groups([LayerKV("full", 16, 4096), LayerKV("sliding_window", 16, 2048, 64)])


@pytest.mark.parametrize(("change", "message"), [
    ({"layer_types": ("full_attention",)}, "layer_types has 1 entries for 4 layers"),
    ({"layer_types": ("full_attention", "sliding_attention") * 2}, "sliding_window is not set"),
    ({"layer_types": ("global",) * 4}, "unknown 'global'"),
    ({"kv_lora_rank": 512}, "both kv_lora_rank and qk_rope_head_dim"),
])
def test_contradicting_layer_fields_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        get_model("tiny").replace(**change)


def test_declared_windows_do_not_cap_the_length():
    # A window in layer_types is served as a window; one without layer_types caps max_model_len.
    assert get_model("mistral-7b-v0.1").max_model_len == 32768
    assert get_model("llama-3-8b").replace(sliding_window=4096).max_model_len == 4096


def test_the_docs_table_is_current():
    path = Path(__file__).resolve().parents[3] / "docs" / "gen_kv_table.py"
    spec = importlib.util.spec_from_file_location("gen_kv_table", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.PAGE.read_text()
    assert "| gemma-3-27b | 6 x sliding 1024, 1 x full of 10 | 8 | 496 / 248 |" in gen.render()
    assert gen.replaced(text) == text, "docs/hybrid.md is out of date: run `python docs/gen_kv_table.py`"

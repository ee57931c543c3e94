"""The engine's CPU and disk KV tiers behind a grouped pool: tiny-hybrid (32-token windows on layers 0 and 2,
full attention on 1 and 3: two KV cache groups sharing two pool tensors), fp32, torch backend, on the CPU
(and on CUDA where present).

A shared prefix is computed, pushed out of a small GPU pool by other prompts and asked for again: the
tiers serve the pages each group needs (the full group's and the sliding group's last ones), and loading
them must give what recomputing gives - the same greedy tokens, and every page both engines publish
holding the same bytes in its group's layers (one torch thread: the forwards that write a prefix have the
same shape either way, so the comparison is exact).
"""
from __future__ import annotations

import pytest
import torch

from gpu_backend import EngineInputError, LLMEngine
from gpu_backend.model import CausalLM
from gpu_backend.model_presets import build_preset
from gpu_backend.ops import get_backend
from tests.gpu_backend.test_engine_tiers import CUDA, run_one_by_one, tier_prompts

pytestmark = pytest.mark.usefixtures("single_thread")

BS = 16
PREFIX_BLOCKS = 4  # 64 tokens: past the 32-token window, so the sliding group needs only its last two
PAGE_GIB = BS * 1024 * 2 / 2**30  # one pool block of tiny-hybrid in fp32: 16 tokens x 2 tensors x 1 KiB


@pytest.fixture(scope="module", params=["cpu", CUDA])
def hybrid(request) -> CausalLM:
    """tiny-hybrid on the CPU and, where CUDA is present, on the GPU (pinned slots, a side stream)."""
    return build_preset("tiny-hybrid", device=request.param, backend=get_backend("torch", request.param))


def _run(model, **kw) -> tuple[LLMEngine, list[list[int]]]:
    """The shared-prefix prompts one after the other, over a 14-block pool unless given."""
    kw.setdefault("num_blocks", 14)
    return run_one_by_one(model, tier_prompts(PREFIX_BLOCKS * BS, 1024), backend="torch", block_size=BS, **kw)


def _pages(engine: LLMEngine) -> dict[int, torch.Tensor]:
    """Each published page (group-tagged hash) -> its K and V in its group's layers."""
    pool, tables = engine.allocator.pool, engine.allocator.tables
    cache = engine.cache.device_cache
    out = {}
    for gh, bid in pool.cached.items():
        n = tables.specs[tables.group_of[bid]].layers  # group g's i-th layer is in tensor i
        out[gh] = torch.stack([t[bid] for t in (*cache.k_pools[:n], *cache.v_pools[:n])])
    return out


@pytest.fixture(scope="module")
def recomputed(hybrid):
    """The small grouped pool without tiers: the last prompt recomputes its evicted prefix."""
    engine, tokens = _run(hybrid)
    assert engine.allocator.stats.prefix_hits == 0 and engine.allocator.stats.evictions > 0
    return tokens, _pages(engine)


def _check_load_equals_recompute(engine, tokens, recomputed, loads: dict[str, int]) -> None:
    stats = engine.allocator.stats
    summary = engine.allocator.tiers.summary(stats.prefix_query_tokens, stats.prefix_hit_tokens)
    assert tokens == recomputed[0]
    for name, pages in loads.items():
        assert summary[name]["hit_blocks"] == pages > 0
        assert engine.cache.tiers.copied_in[name] == pages
    assert sum(summary["tokens_by_source"][f"{name}_hit"] for name in loads) > 0
    mine, theirs = _pages(engine), recomputed[1]
    common = mine.keys() & theirs.keys()
    assert len(common) >= PREFIX_BLOCKS * 2  # the last prompt's prefix, both groups' pages
    for gh in common:
        assert torch.equal(mine[gh], theirs[gh])
    engine.cache.settle_tiers()
    assert engine.cache.tiers.problems() == []  # the slots in use are the tiers' pages: none leaked


@pytest.mark.parametrize("store", ["lazy", "eager"])
def test_grouped_cpu_tier_load_gives_the_tokens_and_kv_of_recompute(hybrid, recomputed, store):
    engine, tokens = _run(hybrid, kv_offloading_size=64 * PAGE_GIB, kv_offloading_store=store)
    # The prefix's last two blocks in both groups (its first two need only the full group's pages,
    # still on the GPU).
    _check_load_equals_recompute(engine, tokens, recomputed, {"cpu": 4})


def test_grouped_disk_tier_load_after_a_spill_gives_the_tokens_and_kv_of_recompute(hybrid, recomputed,
                                                                                   tmp_path):
    engine, tokens = _run(hybrid, kv_offloading_size=2 * PAGE_GIB, kv_offloading_disk_size=64 * PAGE_GIB,
                          kv_offloading_disk_path=str(tmp_path))
    assert engine.allocator.tiers.cpu.stats.evicted_blocks > 0  # the two-page CPU tier spilled to disk
    _check_load_equals_recompute(engine, tokens, recomputed, {"cpu": 2, "disk": 2})
    assert len(list(tmp_path.iterdir())) == 1
    engine.close()
    assert list(tmp_path.iterdir()) == []


def test_a_grouped_tier_slot_holds_the_bytes_of_its_gpu_page(hybrid):
    engine, _ = _run(hybrid, kv_offloading_size=64 * PAGE_GIB, num_blocks=200, kv_offloading_store="eager")
    engine.allocator.tiers.flush()
    engine.cache.settle_tiers()
    pages, tables = _pages(engine), engine.allocator.tables
    slots = engine.cache.tiers.slots["cpu"].slot
    assert {g for _, g in slots} == {0, 1}
    for gh, bid in engine.allocator.pool.cached.items():  # eager: every released page is in the tier too
        held = engine.cache.tiers.block("cpu", (engine.allocator.tiers.ranges[gh], tables.group_of[bid]))
        n = tables.specs[tables.group_of[bid]].layers
        assert torch.equal(torch.cat([held[:n, 0], held[:n, 1]]), pages[gh])


@pytest.mark.parametrize("policy", ["lfu", "s3fifo"])
def test_grouped_tiers_under_another_policy_give_the_tokens_and_kv_of_recompute(hybrid, recomputed, policy,
                                                                                tmp_path):
    engine, tokens = _run(hybrid, kv_offloading_size=2 * PAGE_GIB, kv_offloading_disk_size=64 * PAGE_GIB,
                          kv_offloading_disk_path=str(tmp_path), kv_offloading_policy=policy)
    tiers = engine.allocator.tiers
    assert type(tiers.cpu.keys).__name__ == "_NotedPolicy" and tiers.cpu.stats.evicted_blocks > 0
    loads = {t.spec.name: t.stats.hit_blocks for t in tiers.tiers if t.stats.hit_blocks}
    assert sum(loads.values()) == 4  # the prefix's last two blocks in both groups, from either tier
    _check_load_equals_recompute(engine, tokens, recomputed, loads)
    engine.close()


def test_what_grouped_tiers_refuse_is_a_clear_error(hybrid):
    with pytest.raises(EngineInputError, match=f"holds no KV block of {BS * 2048} bytes"):
        LLMEngine(hybrid, backend="torch", block_size=BS, num_blocks=14, kv_offloading_size=PAGE_GIB / 2)


def test_a_grouped_tier_block_of_two_gpu_blocks_loads_whole_and_gives_recomputed_kv(hybrid, recomputed):
    engine, tokens = _run(hybrid, kv_offloading_size=64 * PAGE_GIB, kv_offloading_block_size=2 * BS)
    assert engine.allocator.tiers.per_tier == 2
    _check_load_equals_recompute(engine, tokens, recomputed, {"cpu": 4})


def test_grouped_tiers_under_chunked_prefill_give_the_tokens_and_kv_of_recompute(hybrid):
    """Prompts fed in chunks of 2 tokens, each chunk's pages taken as it is scheduled (after a loaded
    prefix too, whose prompt has 3 more tokens): a prefix loaded from the CPU tier gives what the same
    chunked engine without tiers recomputes."""
    chunked = dict(enable_chunked_prefill=True, max_num_batched_tokens=2, max_num_seqs=2)
    plain, plain_tokens = _run(hybrid, **chunked)
    assert plain.allocator.prefill_chunk == 2 and plain.allocator.stats.evictions > 0
    engine, tokens = _run(hybrid, kv_offloading_size=64 * PAGE_GIB, **chunked)
    _check_load_equals_recompute(engine, tokens, (plain_tokens, _pages(plain)), {"cpu": 4})

"""The engine's CPU and disk KV tiers on a small random-weight model (fp32, torch backend; on the CPU, and
on CUDA where present).

A shared prefix is computed, evicted from a deliberately small GPU pool by other prompts, and asked for
again: the tiers serve it, and loading it must give exactly what recomputing it gives - the same greedy
tokens and the same K/V bytes (fp32 on one CPU thread: the prefix's K/V comes from forwards of the same
shape either way, so the comparison is exact, torch.equal).
"""
from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gpu_backend import EngineInputError, LLMEngine, SamplingParams
from gpu_backend.engine.engine_config import EngineConfig
from gpu_backend.kv_tiers import slot_runs
from gpu_backend.model import CausalLM
from gpu_backend.model_config import ModelConfig
from gpu_backend.model_presets import init_random_weights
from gpu_backend.ops import get_backend
from simulator.core.sequence import Sequence

pytestmark = pytest.mark.usefixtures("single_thread")

SMALL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,))
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
BS = 4
BLOCK_GIB = BS * 512 / 2**30  # one GPU block of SMALL in fp32: 4 tokens x 512 bytes
PREFIX_BLOCKS = 4


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs CUDA")])


@pytest.fixture(scope="module", params=["cpu", CUDA])
def model(request) -> CausalLM:
    """The small model on the CPU and, where CUDA is present, on the GPU (pinned slots, a side stream)."""
    m = CausalLM(SMALL, backend=get_backend("torch", request.param)).to(request.param)
    init_random_weights(m, seed=5)
    return m


def tier_prompts(prefix_tokens: int, vocab: int) -> list[list[int]]:
    """A prompt with a prefix of `prefix_tokens`, three unrelated prompts that push it out of a small pool,
    and the prefix again with another ending (the same lengths, so every prefill has the same shape)."""
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, vocab, prefix_tokens).tolist()
    others = [rng.integers(3, vocab, prefix_tokens + 3).tolist() for _ in range(3)]
    return [prefix + rng.integers(3, vocab, 3).tolist(), *others, prefix + rng.integers(3, vocab, 3).tolist()]


def run_one_by_one(model, prompts: list[list[int]], **kw) -> tuple[LLMEngine, list[list[int]]]:
    """The prompts one after the other (each finishes before the next arrives), 4 greedy tokens each."""
    engine = LLMEngine(model, watermark=0.0, **kw)
    return engine, [engine.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]


def _prompts() -> list[list[int]]:
    return tier_prompts(PREFIX_BLOCKS * BS, 256)


def _run(model, **kw) -> tuple[LLMEngine, list[list[int]]]:
    kw.setdefault("num_blocks", 12)
    return run_one_by_one(model, _prompts(), block_size=BS, **kw)


def _sources(engine: LLMEngine) -> dict[str, int]:
    stats = engine.allocator.stats
    summary = engine.allocator.tiers.summary(stats.prefix_query_tokens, stats.prefix_hit_tokens)
    return summary["tokens_by_source"]


def _prefix_kv(engine: LLMEngine) -> list[torch.Tensor]:
    """The K and V of every layer of the last prompt's prefix blocks, from the GPU pool."""
    seq_blocks = []
    pool = engine.allocator.pool
    prompt = _prompts()[-1]
    seq = Sequence(0, len(prompt), token_ids=prompt)
    for _, h in engine.allocator.prefix_cache.chain(seq, 0, PREFIX_BLOCKS):
        seq_blocks.append(pool.cached[h])
    cache = engine.cache.device_cache
    return [t[seq_blocks] for t in (*cache.k, *cache.v)]


@pytest.fixture(scope="module")
def recomputed(model):
    """The small pool without tiers: the last prompt recomputes its evicted prefix."""
    engine, tokens = _run(model)
    assert engine.allocator.stats.prefix_hits == 0 and engine.allocator.stats.evictions > 0
    return tokens, _prefix_kv(engine)


@pytest.fixture(scope="module")
def roomy(model):
    """A pool that never evicts: the last prompt hits its prefix on the GPU."""
    engine, tokens = _run(model, num_blocks=200)
    assert engine.allocator.stats.prefix_hits == PREFIX_BLOCKS
    return tokens


def _check_load_equals_recompute(engine, tokens, recomputed, roomy, source: str) -> None:
    assert _sources(engine)[f"{source}_hit"] == PREFIX_BLOCKS * BS
    assert engine.cache.tiers.copied_in[source] == PREFIX_BLOCKS
    assert tokens == recomputed[0] == roomy
    for loaded, computed in zip(_prefix_kv(engine), recomputed[1], strict=True):
        assert torch.equal(loaded, computed)
    engine.cache.settle_tiers()
    assert engine.cache.tiers.problems() == []  # the slots in use are the tiers' keys: none leaked


@pytest.mark.parametrize("store", ["lazy", "eager"])
def test_cpu_tier_load_gives_the_tokens_and_kv_of_recompute(model, recomputed, roomy, store):
    engine, tokens = _run(model, kv_offloading_size=64 * BLOCK_GIB, kv_offloading_store=store)
    _check_load_equals_recompute(engine, tokens, recomputed, roomy, "cpu")


def test_disk_tier_load_after_a_spill_gives_the_tokens_and_kv_of_recompute(model, recomputed, roomy,
                                                                           tmp_path):
    engine, tokens = _run(model, kv_offloading_size=BLOCK_GIB, kv_offloading_disk_size=64 * BLOCK_GIB,
                          kv_offloading_disk_path=str(tmp_path))
    assert engine.allocator.tiers.cpu.stats.evicted_blocks > 0  # the one-block CPU tier spilled to disk
    assert _sources(engine)["cpu_hit"] == 0
    _check_load_equals_recompute(engine, tokens, recomputed, roomy, "disk")
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].stat().st_size == engine.cache.tiers.slots["disk"].data.numel() * 4
    engine.close()
    assert list(tmp_path.iterdir()) == []


def test_a_tier_block_of_two_gpu_blocks_loads_whole_and_gives_recomputed_kv(model, recomputed, roomy):
    engine, tokens = _run(model, kv_offloading_size=64 * BLOCK_GIB, kv_offloading_block_size=2 * BS)
    assert engine.allocator.tiers.cpu.spec.blocks_per_tier_block == 2
    _check_load_equals_recompute(engine, tokens, recomputed, roomy, "cpu")


def test_the_tier_holds_the_bytes_the_gpu_block_had(model):
    engine, _ = _run(model, kv_offloading_size=64 * BLOCK_GIB, num_blocks=200, kv_offloading_store="eager")
    engine.cache.settle_tiers()
    pool, cache = engine.allocator.pool, engine.cache.device_cache
    assert engine.allocator.tiers.cpu.keys
    for h in engine.allocator.tiers.cpu.keys:  # eager: every released block is in the tier and on the GPU
        bid = pool.cached[h]
        held = engine.cache.tiers.block("cpu", h)
        for layer in range(cache.num_layers):
            assert torch.equal(held[layer, 0], cache.k[layer][bid])
            assert torch.equal(held[layer, 1], cache.v[layer][bid])


def test_tier_options_are_checked_and_recorded_only_when_given():
    assert "kv_offloading_size" not in EngineConfig().to_dict()
    assert EngineConfig(kv_offloading_size=1.0).to_dict()["kv_offloading_size"] == 1.0
    with pytest.raises(EngineInputError, match="kv_offloading_block_size must be a multiple of block_size 4"):
        EngineConfig(block_size=4, kv_offloading_size=1.0, kv_offloading_block_size=6)
    with pytest.raises(EngineInputError, match="kv_offloading_store must be one of lazy, eager"):
        EngineConfig(kv_offloading_size=1.0, kv_offloading_store="sometimes")


def test_a_disk_path_that_cannot_hold_the_tier_is_a_clear_error(model, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(EngineInputError, match=f"kv_offloading_disk_path {not_a_dir}: cannot create"):
        LLMEngine(model, block_size=BS, num_blocks=12, kv_offloading_disk_size=BLOCK_GIB * 4,
                  kv_offloading_disk_path=str(not_a_dir))
    with pytest.raises(EngineInputError, match="holds no KV block"):
        LLMEngine(model, block_size=BS, num_blocks=12, kv_offloading_size=BLOCK_GIB / 2)


def test_a_disk_without_room_for_the_tier_is_a_clear_error(model, small_tmpfs):
    mount = small_tmpfs("64k")
    message = rf"kv_offloading_disk_path {mount}: the disk tier needs 0.0001221 GiB "
    message += r"\(kv_offloading_disk_size\), "
    with pytest.raises(EngineInputError, match=message + r"6.1\d*e-05 GiB are free"):
        LLMEngine(model, block_size=BS, num_blocks=12, kv_offloading_disk_size=BLOCK_GIB * 64,
                  kv_offloading_disk_path=str(mount))
    assert list(mount.iterdir()) == []


@given(st.lists(st.tuples(st.sampled_from(["cpu", "disk", None]), st.integers(0, 12)), max_size=40))
def test_slot_runs_cover_every_key_once_in_maximal_runs_of_consecutive_slots(keys):
    tiers = {"cpu": object(), "disk": object(), None: None}
    keys = [(tiers[t], s) for t, s in keys]
    runs = slot_runs(keys)
    assert [i for start, n in runs for i in range(start, start + n)] == list(range(len(keys)))
    for start, n in runs:
        tier, slot = keys[start]
        assert n == 1 or tier is not None
        assert all(keys[start + j] == (tier, slot + j) for j in range(n))
    for (a, n), (b, _) in pairwise(runs):  # maximal: the next key does not continue the run
        tier, slot = keys[a]
        assert tier is None or keys[b] != (tier, slot + n)

"""LLMEngine mechanics on a small random-weight model (CPU, fp32, torch backend).

The reference for greedy tokens is `gpu_backend.testing.generate_simple` (the model with trivially
assigned blocks, itself checked against transformers in test_model.py); token-for-token parity with
transformers through the engine lives in test_engine_parity.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_backend import EngineInputError, LLMEngine, SamplingParams
from gpu_backend.cache_engine import CacheEngine
from gpu_backend.engine.model_setup import device_holds
from gpu_backend.model import CausalLM
from gpu_backend.model_config import ModelConfig
from gpu_backend.model_presets import init_random_weights
from gpu_backend.ops import get_backend
from gpu_backend.testing import generate_simple
from simulator.core.invariants import check_invariants

pytestmark = pytest.mark.usefixtures("single_thread")

SMALL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,))
LENS = (5, 23, 40, 9)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _model(config: ModelConfig = SMALL) -> CausalLM:
    model = CausalLM(config, backend=get_backend("torch", "cpu"))
    init_random_weights(model, seed=5)
    return model


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return _model()


def _prompts(lens=LENS, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lens]


@pytest.fixture(scope="module")
def reference(model):
    return generate_simple(model, _prompts(), GREEDY.max_tokens)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _samples(outputs) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in outputs]


def _engine(model, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 4)
    return LLMEngine(model, **kw)


def _checked_engine(model, **kw) -> LLMEngine:
    """An engine whose allocator checks every invariant after each change, with a CPU pool of ~5k blocks:
    the default 4 GiB is 2M of SMALL's, which every check would read."""
    return _engine(model, debug=True, swap_space_gb=0.01, **kw)


def test_greedy_batch_matches_reference_and_frees_everything(model, reference):
    engine = _checked_engine(model)
    assert _tokens(engine.generate(_prompts(), GREEDY)) == reference
    assert engine.allocator.breakdown().allocated == 0
    assert not engine.has_unfinished()
    check_invariants(engine.allocator)


@pytest.mark.parametrize("options", [
    {"enable_chunked_prefill": True, "max_num_batched_tokens": 16, "max_num_seqs": 4},
    {"max_num_seqs": 2},
    {"block_size": 7, "num_blocks": 80},
], ids=["chunked-prefill", "two-at-a-time", "block-size-7"])
def test_scheduler_options_do_not_change_greedy_tokens(model, reference, options):
    assert _tokens(_engine(model, **options).generate(_prompts(), GREEDY)) == reference


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_tokens(model, reference, mode):
    # 22 blocks of 4 slots cannot hold the four requests (up to 49 tokens each) at once.
    engine = _engine(model, num_blocks=22, preemption_mode=mode, swap_space_gb=0.001, watermark=0.1)
    assert _tokens(engine.generate(_prompts(), GREEDY)) == reference
    assert engine.scheduler.num_preemptions > 0
    stats = engine.allocator.stats
    assert (stats.swapped_out_blocks > 0) == (mode == "swap")
    assert (engine.cache.cpu_bytes > 0) == (mode == "swap")
    assert engine.allocator.breakdown().allocated == 0


def test_the_default_swap_space_grows_with_what_is_swapped_out(model, reference):
    # vLLM's 4 GiB, as the simulator sizes it: the pool's bookkeeping has all of it, memory only the blocks
    # swapped out so far.
    engine = _engine(model, num_blocks=22, preemption_mode="swap", watermark=0.1)
    assert engine.allocator.num_cpu_blocks == 4 * 2**30 // (engine.bytes_per_token * 4)
    assert _tokens(engine.generate(_prompts(), GREEDY)) == reference
    assert engine.allocator.stats.swapped_out_blocks > 0
    assert 0 < engine.cache.cpu_cache.num_blocks <= 2 * engine.allocator.stats.swapped_out_blocks


def test_the_cpu_pool_keeps_swapped_blocks_as_it_grows(model):
    cache = CacheEngine(model, contiguous=False, block_size=4, num_blocks=8, num_cpu_blocks=100)
    dev = cache.device_cache
    for i, pool in enumerate(dev.k_pools + dev.v_pools):
        pool.copy_(torch.arange(pool.numel(), dtype=pool.dtype).reshape(pool.shape) + 1000 * i)
    want = [pool.clone() for pool in dev.k_pools + dev.v_pools]
    cache.swap_out([(0, 0), (1, 1)])
    assert cache.cpu_cache.num_blocks == 2
    cache.swap_out([(2, 6)])  # past the pool: it grows to 7 blocks, keeping blocks 0 and 1
    assert cache.cpu_cache.num_blocks == 7
    for pool in dev.k_pools + dev.v_pools:
        pool.zero_()
    cache.swap_in([(0, 5), (1, 6), (6, 7)])
    for pool, before in zip(dev.k_pools + dev.v_pools, want, strict=True):
        assert torch.equal(pool[5:8], before[0:3])


def test_a_group_swapped_out_in_a_step_that_computes_nothing_comes_back_with_its_kv(model):
    # Four samples share one partly filled block of a 4-block pool: their first decode asks for 4 copies
    # with 3 blocks free, so the only running group is swapped out and that step computes nothing.
    prompt = _prompts((9,))[0]
    want = generate_simple(model, [prompt], 3)[0]
    engine = _engine(model, block_size=16, num_blocks=4, preemption_mode="swap", swap_space_gb=0.001)
    [out] = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, n=4, ignore_eos=True))
    assert engine.scheduler.num_preemptions == 1 and engine.allocator.stats.swapped_out_blocks == 1
    assert [o.token_ids for o in out.outputs] == [want] * 4


@pytest.mark.parametrize("allocator", ["contiguous-max", "contiguous-pow2", "contiguous-oracle"])
def test_contiguous_allocators_give_the_paged_tokens(model, reference, allocator):
    engine = LLMEngine(model, capacity_tokens=600, allocator=allocator, max_model_len=128)
    assert engine.cache.block_size == 1 and engine.cache.device_cache.num_slots == 600
    assert _tokens(engine.generate(_prompts(), GREEDY)) == reference
    assert engine.allocator.breakdown().allocated == 0


@pytest.mark.parametrize("allocator", ["paged", "contiguous-max"])
def test_warmup_stays_within_a_short_max_model_len(model, allocator):
    engine = LLMEngine(model, capacity_tokens=512, allocator=allocator, max_model_len=48)
    engine.warmup()  # its decode reads at most max_model_len slots: one contiguous region
    (out,) = engine.generate(_prompts((30,)), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 5 and engine.allocator.breakdown().allocated == 0


def test_engine_pow2_reservation_is_capped_at_max_model_len(model):
    # 70 prompt tokens + 50 outputs: uncapped Pow2 would reserve 70 + 64 = 134 > max_model_len 128 slots,
    # more than this 128-slot pool; capped, the request is admitted into one 128-slot region.
    engine = LLMEngine(model, capacity_tokens=128, allocator="contiguous-pow2", max_model_len=128)
    params = SamplingParams(max_tokens=51, temperature=0.0, ignore_eos=True)
    engine.add_request(_prompts((70,), seed=3)[0], params)
    engine.step()
    (group,) = engine.scheduler.running
    assert group.seqs[0].region[1] == 128 and engine.allocator.breakdown().allocated == 128
    while engine.has_unfinished():
        engine.step()
    assert engine.allocator.breakdown().allocated == 0


def test_prefix_cache_hits_are_skipped_and_exact(model):
    shared = _prompts((24,), seed=9)[0]
    prompts = [shared + tail for tail in _prompts((5, 11, 3), seed=10)]
    reference = generate_simple(model, prompts, GREEDY.max_tokens)
    engine = _engine(model)
    first = engine.generate(prompts[:1], GREEDY)  # fills the cache
    rest = engine.generate(prompts[1:], GREEDY)
    assert _tokens(first + rest) == reference
    assert engine.allocator.stats.prefix_hits >= 2 * (24 // 4)


def test_seeded_samples_are_reproducible_and_share_the_prompt(model):
    params = SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=11, ignore_eos=True)
    prompts = _prompts()
    a = _engine(model).generate(prompts, params)
    engine = _engine(model)
    b = engine.generate(prompts[::-1], params)[::-1]  # other batch order, other request ids
    samples = _samples(a)
    assert samples == _samples(b)
    assert all(len(s) == 3 and len({tuple(t) for t in s}) > 1 for s in samples)
    assert engine.allocator.stats.cow_copies > 0  # samples shared the prompt's partial last block
    other = _engine(model).generate(prompts, SamplingParams(max_tokens=8, n=3, seed=12, ignore_eos=True))
    assert _samples(other) != samples


def test_seeded_samples_survive_recompute_preemption(model):
    params = SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=3, ignore_eos=True)
    prompts = _prompts()
    roomy = _engine(model).generate(prompts, params)
    tight = _engine(model, num_blocks=28, watermark=0.0)  # the samples diverge before they are preempted
    outputs = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert _samples(outputs) == _samples(roomy)


@pytest.mark.parametrize("caching", [True, False])
def test_samples_recomputed_after_diverging_are_admitted_only_where_they_can_come_back(model, caching):
    """Two samples preempted by recompute after diverging come back holding a copy of their tokens each
    (2 x 15 blocks): a pool of 30 admits the request and finishes it with its tokens; a pool of 29 refuses
    it up front rather than rejecting it once it has run."""
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    samples = SamplingParams(max_tokens=20, temperature=1.0, n=2, seed=7, ignore_eos=True)
    short, long = _prompts((24, 40), seed=4)
    alone = _engine(model, num_blocks=64, enable_prefix_caching=caching).generate([long], samples)
    engine = _engine(model, num_blocks=30, watermark=0.0, enable_prefix_caching=caching)
    outputs = engine.generate([short, long], [greedy, samples])
    assert engine.scheduler.num_preemptions > 0
    assert _samples(outputs[1:]) == _samples(alone)
    assert engine.allocator.breakdown().allocated == 0
    small = _engine(model, num_blocks=29, watermark=0.0, enable_prefix_caching=caching)
    with pytest.raises(EngineInputError, match="needs up to 30 KV blocks but the pool has 29"):
        small.generate([long], samples)


def test_contiguous_requests_buddy_placement_can_never_hold_are_refused_up_front(model):
    # Two regions of 17 + 16 = 33 slots fit 120 slots, but buddy placement rounds each to 64.
    engine = LLMEngine(model, capacity_tokens=120, allocator="contiguous-pow2", max_model_len=64)
    samples = SamplingParams(max_tokens=13, temperature=1.0, n=2, seed=1, ignore_eos=True)
    with pytest.raises(EngineInputError, match=r"2 KV region\(s\) of 33 slots \(64 once buddy placement"):
        engine.add_request(_prompts((17,))[0], samples)
    engine.add_request(_prompts((17,))[0], SamplingParams(max_tokens=13, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.allocator.breakdown().allocated == 0


def test_beam_width_one_is_greedy(model, reference):
    params = SamplingParams(max_tokens=10, beam_width=1, ignore_eos=True)
    outputs = _engine(model).generate(_prompts(), params)
    assert _tokens(outputs) == reference
    assert all(o.outputs[0].cumulative_logprob < 0 for o in outputs)


def test_beam_search_returns_width_sequences_best_first(model):
    engine = _checked_engine(model)
    outputs = engine.generate(_prompts(), SamplingParams(max_tokens=6, beam_width=3, ignore_eos=True))
    for out in outputs:
        scores = [o.cumulative_logprob for o in out.outputs]
        assert len(out.outputs) == 3 and scores == sorted(scores, reverse=True)
        assert len({tuple(o.token_ids) for o in out.outputs}) == 3
        assert all(len(o.token_ids) == 6 for o in out.outputs)
    assert engine.allocator.breakdown().allocated == 0


def test_beam_search_survives_recompute_preemption(model):
    params = SamplingParams(max_tokens=6, beam_width=2, ignore_eos=True)
    prompts = _prompts()
    roomy = _engine(model).generate(prompts, params)
    tight = _engine(model, num_blocks=26, watermark=0.0)
    outputs = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert _samples(outputs) == _samples(roomy)


def test_eos_stops_a_sequence_unless_ignored():
    model = _model()
    probe = generate_simple(model, _prompts()[:1], 6)[0]
    eos = probe[3]  # the 4th greedy token becomes EOS
    stopping = _model(SMALL.replace(eos_token_ids=(eos,)))
    params = SamplingParams(max_tokens=6, temperature=0.0)
    out = _engine(stopping).generate(_prompts()[:1], params)[0].outputs[0]
    assert out.token_ids == probe[: probe.index(eos) + 1] and out.finish_reason == "stop"
    full = _engine(stopping).generate(_prompts()[:1], GREEDY)[0].outputs[0]
    assert len(full.token_ids) == GREEDY.max_tokens and full.finish_reason == "length"


@pytest.mark.parametrize("prompt,params,match", [
    ([1] * 250, GREEDY, "max_model_len"),
    ([1, 999], GREEDY, "outside the vocabulary"),
    ([], GREEDY, "empty prompt"),
    ([1] * 30, SamplingParams(max_tokens=200, ignore_eos=True), "pool has"),
])
def test_bad_requests_are_refused_before_any_work(model, prompt, params, match):
    engine = _engine(model, num_blocks=40)
    with pytest.raises(EngineInputError, match=match):
        engine.generate([[5, 6, 7], prompt], params)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("kwargs,match", [
    ({"allocator": "buddy"}, "allocator must be one of"),
    ({"block_size": 0}, "block_size must be > 0"),
    ({"preemption_mode": "drop"}, "preemption_mode"),
    ({"frobnicate": 1}, "unknown engine option"),
    ({"device": "tpu"}, "unknown device"),
])
def test_bad_engine_options_are_typed_errors(model, kwargs, match):
    with pytest.raises(EngineInputError, match=match):
        LLMEngine("tiny" if "device" in kwargs else model, **kwargs)


@pytest.mark.parametrize("requested,actual,holds", [
    ("cuda", "cuda:0", True), ("cuda", "cuda:3", True), ("cuda:1", "cuda:1", True),
    ("cuda:1", "cuda:0", False), ("cpu", "cpu", True), ("cpu", "cuda:0", False), ("cuda", "cpu", False),
])
def test_plain_cuda_holds_a_model_on_any_cuda_index(requested, actual, holds):
    # A 1B preset built on "cuda" lives on "cuda:0", which `bench engine --device cuda` must accept.
    assert device_holds(torch.device(requested), torch.device(actual)) is holds


def test_a_model_on_another_device_is_refused(model):
    with pytest.raises(EngineInputError, match="the model lives on cpu, not on the requested meta"):
        LLMEngine(model, device="meta")


@pytest.mark.parametrize("kwargs,match", [
    ({"max_tokens": 0}, "max_tokens"), ({"top_p": 0.0}, "top_p"), ({"temperature": -1}, "temperature"),
    ({"n": 2, "beam_width": 2}, "beam"),
])
def test_bad_sampling_params_are_typed_errors(kwargs, match):
    with pytest.raises(EngineInputError, match=match):
        SamplingParams(**kwargs)


def test_pool_size_from_kv_memory(model):
    engine = LLMEngine(model, kv_memory_gb=0.001, block_size=8)
    per_token = SMALL.kv_bytes_per_token(model.dtype)
    assert engine.capacity_tokens == int(0.001 * (1 << 30)) // per_token
    assert engine.allocator.num_blocks == engine.capacity_tokens // 8
    assert engine.cache.bytes == engine.allocator.num_blocks * 8 * per_token


def test_beam_search_with_eos_keeps_finished_hypotheses():
    model = _model()
    probe = generate_simple(model, _prompts()[:1], 4)[0]
    stopping = _model(SMALL.replace(eos_token_ids=(probe[1],)))  # greedy's 2nd token ends a sequence
    engine = _checked_engine(stopping)
    out = engine.generate(_prompts()[:1], SamplingParams(max_tokens=6, beam_width=3))[0].outputs
    scores = [o.cumulative_logprob for o in out]
    assert len(out) == 3 and scores == sorted(scores, reverse=True)
    assert any(o.finish_reason == "stop" and o.token_ids[-1] == probe[1] for o in out)
    for o in out:
        assert len(o.token_ids) == 6 if o.finish_reason == "length" else o.token_ids[-1] == probe[1]
    assert engine.allocator.breakdown().allocated == 0

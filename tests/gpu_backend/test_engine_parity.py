"""LLMEngine against transformers, token for token (fp32, CPU, torch backend).

The checkpoints are the random-weight Llama and Qwen2 models of tests/conftest.py (`hf_model_dirs`),
loaded by our loader on one side and by transformers on the other. transformers' `generate` runs each
prompt alone (no padding), greedy or beam search; the engine runs them all together through the shared
scheduler, under block sizes, tiny pools that force preemption, prefix-cache hits and contiguous pools.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_backend import LLMEngine, SamplingParams
from gpu_backend.loader import load_model
from gpu_backend.ops import get_backend

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

LENS = (37, 3, 70, 16)  # several blocks, shorter than a block, many blocks, exactly one block of 16
NEW = 10
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def _prompts(vocab: int, lens=LENS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lens]


@pytest.fixture(scope="module")
def pair(hf_model_dirs):
    """name -> (our CausalLM, transformers model), loaded once per module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            path = hf_model_dirs[name]
            ours = load_model(path, dtype="float32", backend=get_backend("torch", "cpu"))
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            hf.generation_config.eos_token_id = None  # exactly max_new_tokens, like ignore_eos
            cache[name] = (ours, hf)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def hf_greedy(pair):
    """(name, prompts) -> transformers' greedy continuations, memoized across tests."""
    memo = {}

    def get(name: str, prompts: list[list[int]]) -> list[list[int]]:
        key = (name, tuple(map(tuple, prompts)))
        if key not in memo:
            _, hf = pair(name)
            outs = []
            for prompt in prompts:
                ids = torch.tensor([prompt])
                ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                  do_sample=False, pad_token_id=0)
                outs.append(ref[0, len(prompt):].tolist())
            memo[key] = outs
        return memo[key]

    return get


def _greedy(engine: LLMEngine, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]


@pytest.mark.parametrize("block_size", [1, 16, 5])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_greedy_batch_equals_transformers(pair, hf_greedy, name, block_size):
    ours, _ = pair(name)
    prompts = _prompts(ours.config.vocab_size)
    engine = LLMEngine(ours, block_size=block_size, num_blocks=800 // block_size)
    assert _greedy(engine, prompts) == hf_greedy(name, prompts)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_preemption_by_a_tiny_pool_equals_transformers(pair, hf_greedy, name, mode):
    ours, _ = pair(name)
    prompts = _prompts(ours.config.vocab_size)
    # 12 blocks of 8 slots hold at most 96 tokens: the four requests (up to 79 tokens) must take turns.
    engine = LLMEngine(ours, block_size=8, num_blocks=12, preemption_mode=mode, swap_space_gb=0.001,
                       watermark=0.1, enable_prefix_caching=False)
    assert _greedy(engine, prompts) == hf_greedy(name, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert (engine.allocator.stats.swapped_in_blocks > 0) == (mode == "swap")


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_prefix_cache_hits_equal_transformers(pair, hf_greedy, name):
    ours, _ = pair(name)
    vocab = ours.config.vocab_size
    system = _prompts(vocab, (35,), seed=1)[0]
    prompts = [system + tail for tail in _prompts(vocab, (4, 12, 1, 20), seed=2)]
    engine = LLMEngine(ours, block_size=8, num_blocks=100)
    got = _greedy(engine, prompts[:1]) + _greedy(engine, prompts[1:])  # the second batch hits the cache
    assert got == hf_greedy(name, prompts)
    stats = engine.allocator.stats
    assert stats.prefix_hits >= 3 * (35 // 8)  # every later request reuses the system prompt's 4 blocks


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_swap_in_resharing_cached_prefix_equals_transformers(pair, hf_greedy, name):
    """Swapped requests sharing a system prompt come back onto the still-cached prefix blocks (copying
    only the rest): the K/V they read there must be theirs."""
    ours, _ = pair(name)
    vocab = ours.config.vocab_size
    system = _prompts(vocab, (24,), seed=5)[0]
    prompts = [system + tail for tail in _prompts(vocab, (5, 9, 2, 12), seed=6)]
    engine = LLMEngine(ours, block_size=8, num_blocks=9, preemption_mode="swap", swap_space_gb=0.001)
    assert _greedy(engine, prompts) == hf_greedy(name, prompts)
    stats = engine.allocator.stats
    assert engine.scheduler.num_preemptions > 0 and stats.swapped_in_blocks > 0
    assert stats.swapped_in_blocks < stats.swapped_out_blocks  # some blocks were shared again, not copied


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_chunked_prefill_preempted_midway_equals_transformers(pair, hf_greedy, name):
    """A long prompt preempted in the middle of its chunked prefill (11 blocks of 4: the short request's
    decode needs the room) must not find its never-computed blocks in the prefix cache on re-admission."""
    ours, _ = pair(name)
    vocab = ours.config.vocab_size
    prompts = [_prompts(vocab, (4,), seed=3)[0], _prompts(vocab, (33,), seed=4)[0]]
    engine = LLMEngine(ours, block_size=4, num_blocks=11, enable_chunked_prefill=True,
                       max_num_batched_tokens=4, max_num_seqs=2)
    preempted_midway = []
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, GREEDY, request_id=i)
    got: dict[int, list[int]] = {}
    while engine.has_unfinished():
        left = dict(engine.scheduler.prefill_left)
        result = engine.step()
        preempted_midway += [(g.request_id, 33 - left[g.request_id]) for g in result.out.preempted
                             if g.request_id in left]
        for out in result.finished:
            got[out.request_id] = out.outputs[0].token_ids
    assert [rid for rid, _ in preempted_midway] == [1]
    assert [got[0], got[1]] == hf_greedy(name, prompts)
    # The re-admitted prompt hit only blocks whose K/V the first attempt had computed (and did hit them).
    computed = preempted_midway[0][1]
    assert 0 < engine.allocator.stats.preempted_hit_tokens <= computed


@pytest.mark.parametrize("allocator", ["contiguous-max", "contiguous-pow2", "contiguous-oracle"])
def test_contiguous_allocators_equal_transformers(pair, hf_greedy, allocator):
    ours, _ = pair("llama")
    prompts = _prompts(ours.config.vocab_size)
    engine = LLMEngine(ours, allocator=allocator, capacity_tokens=700, max_model_len=160)
    assert _greedy(engine, prompts) == hf_greedy("llama", prompts)


def test_beam_search_equals_transformers(pair):
    ours, hf = pair("llama")
    prompts = _prompts(ours.config.vocab_size, (9, 30))
    width, new = 3, 6
    engine = LLMEngine(ours, block_size=4, num_blocks=200)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=new, beam_width=width, ignore_eos=True))
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        # length_penalty 0: transformers then ranks beams by their plain sum of log-probs, as we do.
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, num_beams=width,
                          num_return_sequences=width, do_sample=False, length_penalty=0.0,
                          early_stopping=False, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True)
        assert [o.token_ids for o in out.outputs] == ref.sequences[:, len(prompt):].tolist()
        scores = [o.cumulative_logprob for o in out.outputs]
        assert np.allclose(scores, ref.sequences_scores.tolist(), atol=1e-4)


_TRITON_SCRIPT = """
import numpy as np
from gpu_backend import LLMEngine, SamplingParams
from gpu_backend.ops import get_backend
from gpu_backend.model_presets import build_preset
model = build_preset("tiny", backend=get_backend("torch", "cpu"))
prompts = [np.random.default_rng(0).integers(0, 1024, n).tolist() for n in (9, 3, 20)]
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
def run():
    engine = LLMEngine(model, block_size=8, num_blocks=12, enable_chunked_prefill=True,
                       max_num_batched_tokens=8, max_num_seqs=3)
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
ref = run()
model.set_backend(get_backend("triton", "cpu"))
got = run()
print("tokens", ref == got, ref, got)
"""


@pytest.mark.slow
def test_triton_backend_under_interpreter_matches_torch():
    """The engine's mixed chunk/decode steps through the Triton kernels (interpreted on CPU).

    A subprocess, because TRITON_INTERPRET must be set before the kernels are defined.
    """
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])  # the repo root
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tokens True" in proc.stdout, proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("allocator", ["paged", "contiguous-oracle"])
def test_gpu_engine_equals_transformers(hf_model_dirs, hf_greedy, allocator):
    """fp32 on the GPU, the pool sized from measured free memory (torch backend: head_dim 16 is below
    what the Triton kernels support; they are checked on the GPU by their own tests)."""
    model = load_model(hf_model_dirs["llama"], dtype="float32", device="cuda",
                       backend=get_backend("torch", "cuda"))
    prompts = _prompts(model.config.vocab_size)
    engine = LLMEngine(model, allocator=allocator, gpu_memory_utilization=0.3, max_model_len=256)
    assert engine.capacity_source == "measured free GPU memory"
    assert _greedy(engine, prompts) == hf_greedy("llama", prompts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_triton_engine_matches_cpu_engine():
    """The tiny preset (head_dim 64) through the Triton kernels on the GPU gives the CPU engine's tokens."""
    from gpu_backend.model_presets import build_preset

    prompts = _prompts(1024, (9, 40, 130))
    cpu = build_preset("tiny", dtype="float32", backend=get_backend("torch", "cpu"))
    gpu = build_preset("tiny", dtype="float32", device="cuda", backend=get_backend("triton", "cuda"))
    gpu.load_state_dict(cpu.state_dict())
    ref = _greedy(LLMEngine(cpu, num_blocks=64), prompts)
    assert _greedy(LLMEngine(gpu, num_blocks=64), prompts) == ref

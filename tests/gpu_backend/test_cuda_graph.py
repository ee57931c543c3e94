"""Decode CUDA graphs: bucket choice, padding to the bucket (CPU, eager replay of the static buffers),
and tokens identical with and without graphs (GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_backend import LLMEngine, SamplingParams
from gpu_backend.engine.cuda_graph import DecodeGraphRunner, bucket_for, graph_batch_sizes
from gpu_backend.engine.decode_step import DecodeStepper
from gpu_backend.model import CausalLM
from gpu_backend.model_config import ModelConfig
from gpu_backend.model_presets import init_random_weights
from gpu_backend.ops import get_backend

SMALL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,))


def test_bucket_sizes_and_choice():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = graph_batch_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 3, 8, 9, 17, 64)] == [1, 4, 8, 16, 32, 64]
    assert bucket_for(65, sizes) is None


def _prompts(lens, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in lens]


def _engine(model, allocator, device="cpu", **options):
    return LLMEngine(model, device=device, allocator=allocator, capacity_tokens=4096, max_num_seqs=8,
                     max_model_len=128, **options)


@pytest.mark.parametrize("allocator", ["paged", "contiguous-max"])
def test_padded_static_buffers_give_the_same_tokens_on_cpu(allocator):
    """What a graph computes (inputs copied into bucket-sized buffers, padding rows) changes no token."""
    torch.manual_seed(0)
    model = CausalLM(SMALL, backend=get_backend("torch", "cpu"))
    init_random_weights(model, seed=3)
    prompts = _prompts((5, 23, 40, 9, 17))  # 5 sequences: padded to the bucket of 8, then fewer
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 3, 7, 9, 5)]
    want = [o.outputs[0].token_ids for o in _engine(model, allocator).generate(prompts, params)]
    # Graphs fed by the exact step, by the decode batch's buffers, and by its copying (GPU) path.
    for decode_batch, mirror in ((False, False), (True, False), (True, True)):
        engine = _engine(model, allocator, decode_batch=decode_batch)
        if mirror:
            engine.decoder = DecodeStepper(engine, mirror=True)
        buffers = engine.decoder.buffers if decode_batch else None
        runner = DecodeGraphRunner(engine._forward, 8, 128 // 16 + 1, 128, engine.cache.contiguous, "cpu",
                                   capture=False, buffers=buffers)
        engine.graph_runner = runner
        calls: list[int] = []
        real_replay = runner.replay
        runner.replay = lambda n, longest=None, real=real_replay, seen=calls: \
            seen.append(n) or real(n, longest)
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        assert got == want
        assert 5 in calls and min(calls) < 5  # the runner served full and shrinking decode batches


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("allocator", ["paged", "contiguous-max"])
def test_cuda_graphs_give_identical_tokens(allocator):
    model = CausalLM(SMALL, dtype=torch.float16, device="cuda", backend=get_backend("triton", "cuda"))
    init_random_weights(model, seed=3)
    prompts = _prompts((5, 23, 40, 9, 17))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 3, 7, 9, 5)]
    outs = {}
    for eager in (True, False):
        for decode_batch in (False, True):  # steps through schedule(), and through the decode batch
            engine = _engine(model, allocator, device="cuda", enforce_eager=eager, decode_batch=decode_batch)
            assert (engine.graph_runner is None) == eager
            outs[eager, decode_batch] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert len({tuple(map(tuple, tokens)) for tokens in outs.values()}) == 1

"""Sliding-window and hybrid models against transformers, token for token (fp32, CPU).

Tiny random checkpoints of transformers' MistralForCausalLM (every layer slides), Gemma2ForCausalLM
(sliding and full layers alternate; attention and final logit soft-caps, query_pre_attn_scalar, sandwich
(1 + w) norms, embeddings scaled by sqrt(hidden)) and Gemma3ForCausalLM (the same layout plus q/k norms,
a local RoPE base for sliding layers and linear RoPE scaling on full ones) are loaded by our loader and by
transformers (eager attention). The window (12 tokens) is shorter than every generation, and block sizes
of 4 and 5 put the window's start inside a block, so the kernels both skip whole blocks and mask a head.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gpu_backend import LLMEngine, SamplingParams
from gpu_backend.engine.params import EngineInputError
from gpu_backend.loader import load_model
from gpu_backend.model import CausalLM
from gpu_backend.model_config import ModelConfig
from gpu_backend.ops import get_backend
from gpu_backend.testing import prompt_logits
from simulator.core.paged import BlockManager
from simulator.core.paged.kv_groups import GroupedBlockManager

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

WINDOW = 12
ALTERNATING = ["sliding_attention", "full_attention"] * 2
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
             sliding_window=WINDOW)
GEMMA = dict(query_pre_attn_scalar=48, final_logit_softcapping=8.0, tie_word_embeddings=False)
VARIANTS = {
    "mistral": ("MistralForCausalLM", "MistralConfig", {}),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(GEMMA, attn_logit_softcapping=5.0)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(GEMMA, layer_types=ALTERNATING, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # Tied embeddings as Gemma ships them; attn_logit_softcapping is set but transformers' Gemma 3 never
    # applies it, so neither does the engine.
    "gemma3-tied": ("Gemma3ForCausalLM", "Gemma3TextConfig",
                    dict(GEMMA, layer_types=ALTERNATING, tie_word_embeddings=True,
                         attn_logit_softcapping=3.0)),
}
NEW = 24
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory of the random checkpoint, the transformers model)."""
    out = {}
    for seed, (name, (arch, config_cls, extra)) in enumerate(VARIANTS.items()):
        config = getattr(transformers, config_cls)(**SHAPE, **extra)
        model = getattr(transformers, arch)(config)
        gen = torch.Generator().manual_seed(2000 + seed)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                noise = torch.randn(param.shape, generator=gen)
                if "norm" in pname:  # Gemma applies (1 + w): keep its gains near 1 as well
                    param.copy_((0.0 if "Gemma" in arch else 1.0) + 0.1 * noise)
                else:
                    param.copy_(noise / param.shape[1] ** 0.5)
        path = tmp_path_factory.mktemp(f"hf-{name}")
        model.save_pretrained(path, safe_serialization=True)
        hf = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
        hf.generation_config.eos_token_id = None
        out[name] = (path, hf)
    return out


def _prompts(lens, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, SHAPE["vocab_size"], n).tolist() for n in lens]


def _hf_greedy(hf, prompts) -> list[list[int]]:
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                          pad_token_id=0)
        outs.append(ref[0, len(prompt):].tolist())
    return outs


def test_configs_read_layer_types_and_what_gemma_adds(checkpoints):
    mistral = ModelConfig.from_model_dir(checkpoints["mistral"][0])
    assert [mistral.layer_window(i) for i in range(4)] == [WINDOW] * 4
    gemma2 = ModelConfig.from_model_dir(checkpoints["gemma2"][0])
    assert [gemma2.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (5.0, 8.0)
    assert gemma2.attention_scale == 48 ** -0.5 and gemma2.hidden_act == "gelu_pytorch_tanh"
    gemma3 = ModelConfig.from_model_dir(checkpoints["gemma3"][0])
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.rope_scaling.factor) == (1e6, 1e4, 2.0)
    assert gemma3.qk_norm and not gemma2.qk_norm
    assert ModelConfig.from_model_dir(checkpoints["gemma3-tied"][0]).attn_logit_softcapping is None
    # The engine runs the window itself, so the window does not cap the sequence length.
    assert mistral.max_model_len == SHAPE["max_position_embeddings"]
    for name, (_, hf) in checkpoints.items():
        config = ModelConfig.from_model_dir(checkpoints[name][0])
        assert config.num_parameters() == sum(p.numel() for p in hf.parameters()), name


@pytest.mark.parametrize("name", VARIANTS)
def test_prompt_logits_equal_transformers_beyond_the_window(checkpoints, name):
    """Every position of a 40-token prompt fed in three chunks (cached prefix + window), blocks of 5."""
    path, hf = checkpoints[name]
    ours = load_model(path, dtype="float32", backend=get_backend("torch", "cpu"))
    prompt = _prompts([40], seed=3)[0]
    got = prompt_logits(ours, [prompt], block_size=5, chunks=3)[0]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # The same weights attending fully differ past the window: the test sees the window.
    full = CausalLM(dataclasses.replace(ours.config, sliding_window=None, layer_types=None),
                    backend=ours.attn_backend)
    full.load_state_dict(ours.state_dict())
    assert not torch.allclose(prompt_logits(full, [prompt], block_size=5)[0][WINDOW:], want[WINDOW:],
                              atol=1e-2)


@pytest.mark.parametrize("block_size", [4, 5])
@pytest.mark.parametrize("name", VARIANTS)
def test_engine_greedy_longer_than_the_window_equals_transformers(checkpoints, name, block_size):
    path, hf = checkpoints[name]
    ours = load_model(path, dtype="float32")
    prompts = _prompts([5, 19, 33, 1])
    engine = LLMEngine(ours, backend="torch", block_size=block_size, num_blocks=200)
    assert isinstance(engine.allocator, GroupedBlockManager)  # sliding groups hand blocks back
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]
    assert got == _hf_greedy(hf, prompts)
    # One group keeping every token on every layer (a model without full layers keeps its window).
    one = LLMEngine(ours, backend="torch", block_size=block_size, num_blocks=200,
                    disable_hybrid_kv_cache_manager=True)
    assert isinstance(one.allocator, GroupedBlockManager if name == "mistral" else BlockManager)
    assert [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)] == got


_TRITON_SCRIPT = """
import json, sys
from gpu_backend import LLMEngine, SamplingParams
from gpu_backend.engine.params import EngineInputError
from gpu_backend.loader import load_model
from gpu_backend.ops import get_backend
path, prompts, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model = load_model(path, dtype="float32", backend=get_backend("triton", "cpu"))
engine = LLMEngine(model, backend="triton", block_size=4, num_blocks=64, enable_chunked_prefill=True,
                   max_num_batched_tokens=8, max_num_seqs=2)
params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
print("tokens", json.dumps([o.outputs[0].token_ids for o in engine.generate(prompts, params)]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_triton_engine_under_interpreter_equals_transformers(checkpoints, name):
    """The Triton kernels (interpreted on CPU) with windows, soft-caps and chunked prefill: transformers'
    tokens. A subprocess, because TRITON_INTERPRET must be set before the kernels are defined."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    path, hf = checkpoints[name]
    prompts = _prompts([19, 3])
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT, str(path), json.dumps(prompts), "16"],
                          env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2])  # the repo root
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.split("tokens ", 1)[1])
    want = [tokens[:16] for tokens in _hf_greedy(hf, prompts)]
    assert got == want


def test_tiny_hybrid_preset_runs_in_the_engine_past_its_window():
    """tiny-hybrid alternates 32-token windows with full layers; the engine's batched, paged steps give
    the tokens of the engine-independent reference loop, and attending fully would give others."""
    from gpu_backend.model_presets import build_preset
    from gpu_backend.testing import generate_simple

    model = build_preset("tiny-hybrid", backend=get_backend("torch", "cpu"))
    assert [model.config.layer_window(i) for i in range(4)] == [32, None, 32, None]
    prompts = np.random.default_rng(4).integers(0, 1024, (2, 40)).tolist() + [[7, 8, 9]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(model, backend="torch", block_size=16, num_blocks=64)
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert got == generate_simple(model, prompts, 40, block_size=16)
    full = CausalLM(dataclasses.replace(model.config, sliding_window=None, layer_types=None),
                    backend=model.attn_backend)
    full.load_state_dict(model.state_dict())
    assert generate_simple(full, prompts, 40, block_size=16) != got


@pytest.mark.parametrize("options", [
    {"allocator": "contiguous-oracle", "num_blocks": 400, "block_size": 1},
    # 16 x 4 slots of every layer: sliding groups hand their old blocks back, yet six requests (up to 57
    # tokens, the short prompts growing) outgrow the pool and take turns, preempted mid-way.
    {"num_blocks": 16, "block_size": 4, "preemption_mode": "recompute", "watermark": 0.0},
    {"num_blocks": 16, "block_size": 4, "preemption_mode": "swap", "swap_space_gb": 0.001, "watermark": 0.0},
    # 12 x 4 slots, prompts in chunks of up to 8 tokens, each chunk's blocks taken as it is scheduled: a
    # chunk short of blocks preempts the latest running request (or its own, recomputed later).
    {"num_blocks": 12, "block_size": 4, "preemption_mode": "recompute", "watermark": 0.0,
     "enable_chunked_prefill": True, "max_num_batched_tokens": 8, "max_num_seqs": 6},
], ids=["contiguous", "recompute", "swap", "chunked"])
@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_engine_pools_and_preemption_with_windows_equal_transformers(checkpoints, name, options):
    path, hf = checkpoints[name]
    ours = load_model(path, dtype="float32")
    prompts = _prompts([5, 19, 33, 1, 2, 3], seed=1)
    engine = LLMEngine(ours, backend="torch", enable_prefix_caching=False, **options)
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]
    assert got == _hf_greedy(hf, prompts)
    if "preemption_mode" in options:
        assert engine.scheduler.num_preemptions > 0


def test_chunked_prefill_serves_a_prompt_the_pool_cannot_hold_whole_and_equals_transformers(checkpoints):
    """A 40-token prompt in chunks of 4 over 16 pages of 4 tokens (8 blocks of all four layers): whole, it
    takes 10 pages in each of the two groups (20 > 16); by chunks the window (12 tokens) hands back what
    it passed before each chunk, so it holds at most 10 + 5 (16 with the decode token), and the tokens
    are transformers' (pages of the window freed mid-prompt)."""
    path, hf = checkpoints["gemma3"]
    ours = load_model(path, dtype="float32")
    prompt = _prompts([40], seed=5)[0]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    whole = LLMEngine(ours, backend="torch", block_size=4, num_blocks=8, watermark=0.0, max_model_len=64)
    with pytest.raises(EngineInputError, match="needs up to 20 KV blocks"):
        whole.generate([prompt], params)
    engine = LLMEngine(ours, backend="torch", block_size=4, num_blocks=8, watermark=0.0, max_model_len=64,
                       enable_chunked_prefill=True, max_num_batched_tokens=4, max_num_seqs=2)
    assert isinstance(engine.allocator, GroupedBlockManager) and engine.allocator.prefill_chunk == 4
    got = engine.generate([prompt], params)[0].outputs[0].token_ids
    assert got == _hf_greedy(hf, [prompt])[0][:2]

"""The paged Llama-family decoder against transformers (fp32, CPU, torch attention backend).

Reference: the same random-weight checkpoints (tests/conftest.py, hf_model_dirs) run by transformers'
LlamaForCausalLM / Qwen2ForCausalLM. Observed max |logit difference| is about 3e-6 (fp32, logits of
order 1); the tolerance below leaves ~30x headroom while a wrong weight, bias, rope or mask gives
differences of order 0.1-1.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gpu_backend.engine.input_batch import SequenceInput, build_model_input
from gpu_backend.loader import load_model
from gpu_backend.model_config import ModelConfig, ModelLoadError
from gpu_backend.model_presets import ENGINE_PRESETS, PRESETS, REGISTRY_PRESETS, build_preset
from gpu_backend.ops import get_backend
from gpu_backend.rope import compute_inv_freq
from gpu_backend.testing import generate_simple, make_kv_cache, prompt_logits
from simulator.core.models import ModelSpec, get_model

LOGITS_ATOL = 1e-4
PROMPT_LENS = (37, 3, 70)  # one packed batch: several blocks, shorter than one block, many blocks
NEW_TOKENS = 12

transformers = pytest.importorskip("transformers")


def _prompts(vocab_size: int, seed: int = 0, lens=PROMPT_LENS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, n).tolist() for n in lens]


@pytest.fixture(scope="module")
def pair(hf_model_dirs):
    """name -> (our CausalLM, transformers model), loaded once per module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            path = hf_model_dirs[name]
            ours = load_model(path, dtype="float32", backend=get_backend("torch", "cpu"))
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like generate_simple
            cache[name] = (ours, hf)
        return cache[name]

    return get


def _hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("name", ["llama", "qwen2", "llama3-rope", "linear-rope", "mistral"])
def test_prompt_logits_match_transformers(pair, name, block_size):
    ours, hf = pair(name)
    prompts = _prompts(ours.config.vocab_size)
    got = prompt_logits(ours, prompts, block_size)  # all prompts in one packed step
    for prompt, logits in zip(prompts, got, strict=True):
        ref = _hf_logits(hf, prompt)
        assert logits.shape == ref.shape
        assert (logits - ref).abs().max().item() < LOGITS_ATOL


@pytest.mark.parametrize("chunks,block_size", [(2, 16), (3, 5), (2, 1)])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_chunked_prefill_equals_one_pass(pair, name, chunks, block_size):
    ours, _ = pair(name)
    prompts = _prompts(ours.config.vocab_size, seed=1)
    whole = prompt_logits(ours, prompts, block_size, chunks=1)
    chunked = prompt_logits(ours, prompts, block_size, chunks=chunks)
    for a, b in zip(whole, chunked, strict=True):
        assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("block_size,chunk", [(16, None), (5, None), (1, 8)])
@pytest.mark.parametrize("name", ["llama", "qwen2", "llama3-rope"])
def test_greedy_generation_matches_transformers(pair, name, block_size, chunk):
    ours, hf = pair(name)
    prompts = _prompts(ours.config.vocab_size, seed=2)
    got = generate_simple(ours, prompts, NEW_TOKENS, block_size=block_size, prefill_chunk_size=chunk)
    for prompt, tokens in zip(prompts, got, strict=True):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=0)
        assert tokens == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["llama", "llama3-rope", "linear-rope"])
def test_inv_freq_matches_transformers(pair, name):
    ours, hf = pair(name)
    rope_type = hf.config.rope_parameters["rope_type"]
    scaling = ours.config.rope_scaling
    assert (scaling is None) if rope_type == "default" else (scaling.rope_type == rope_type)
    torch.testing.assert_close(ours.rotary.inv_freq, hf.model.rotary_emb.inv_freq.float(), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["llama", "llama3-rope"])
def test_copy_into_transformers_gives_the_checkpoint_logits(pair, name):
    # `bench engine` copies a preset into transformers, Llama 3 rope_scaling included (llama-1b-shape has
    # it). The copy must compute what transformers computes from the checkpoint.
    from bench.engine import to_transformers

    ours, hf = pair(name)
    prompt = _prompts(ours.config.vocab_size)[2]
    copy = to_transformers(ours)
    assert copy.config.rope_parameters["rope_type"] == hf.config.rope_parameters["rope_type"]
    assert (_hf_logits(copy, prompt) - _hf_logits(hf, prompt)).abs().max().item() < LOGITS_ATOL


def test_copy_into_transformers_refuses_qkv_bias(pair):
    from bench.engine import to_transformers

    with pytest.raises(ValueError, match="with qkv bias"):
        to_transformers(pair("qwen2")[0])


def test_rope_scaling_changes_frequencies():
    base = compute_inv_freq(64, 500000.0)
    llama3 = compute_inv_freq(64, 500000.0, PRESETS["llama-1b-shape"].rope_scaling)
    assert llama3[0] == base[0]  # highest frequency untouched
    assert torch.isclose(llama3[-1], base[-1] / 32.0)  # lowest frequency slowed by `factor`


def test_forward_without_backend_is_an_error():
    model = build_preset("tiny")
    step = build_model_input([SequenceInput([1, 2], 0, [0])], 16)
    with pytest.raises(RuntimeError, match="attention backend"):
        model(step.input_ids, step.positions, step.attn_metadata, make_kv_cache(model, 1, 16))


# -- presets ------------------------------------------------------------------------------------------

def test_preset_weights_are_seeded():
    a, b, c = build_preset("tiny", seed=3), build_preset("tiny", seed=3), build_preset("tiny", seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name


def test_every_preset_is_listed_once():
    assert sorted(ENGINE_PRESETS) == sorted(PRESETS) and len(set(ENGINE_PRESETS)) == len(ENGINE_PRESETS)


@pytest.mark.parametrize("name", REGISTRY_PRESETS)
def test_engine_presets_are_registry_entries(name):
    config, entry = PRESETS[name], get_model(name)
    assert isinstance(config, ModelSpec)
    shared = {f.name for f in dataclasses.fields(ModelSpec)}
    assert {k: v for k, v in dataclasses.asdict(config).items() if k in shared} == dataclasses.asdict(entry)
    # The engine's own fields keep Llama's defaults, so the entry runs exactly its registry numbers.
    assert all(config.layer_window(i) is None for i in range(config.num_hidden_layers))
    assert (config.hidden_act, config.attention_scale) == ("silu", config.head_dim ** -0.5)
    assert config.num_parameters() == entry.num_params
    # The engine sizes its KV pool in the dtype it runs; the simulator in the checkpoint's.
    per_element = entry.bytes_per_token // entry.dtype_bytes
    assert config.kv_bytes_per_token(torch.float32) == 4 * per_element
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * per_element


def test_only_runnable_registry_entries_become_engine_configs():
    with pytest.raises(ModelLoadError, match="unsupported architecture 'OPTForCausalLM'"):
        ModelConfig.from_spec(get_model("opt-13b"))


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2", "tiny-hybrid"])
def test_preset_parameter_count_matches_config(name):
    model = build_preset(name)
    count = sum(p.numel() for p in model.parameters())
    assert count == PRESETS[name].num_parameters() == PRESETS[name].num_params


def test_llama_1b_shape_has_llama_3_2_1b_parameter_count():
    # meta-llama/Llama-3.2-1B: 1,235,814,400 parameters (tied embeddings).
    assert PRESETS["llama-1b-shape"].num_parameters() == 1_235_814_400


def test_tiny_qwen2_preset_uses_biases_and_tied_head():
    model = build_preset("tiny-qwen2", backend=get_backend("torch", "cpu"))
    assert model.lm_head is None
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    assert model.layers[0].self_attn.o_proj.bias is None
    out = generate_simple(model, _prompts(model.config.vocab_size, lens=(9, 20)), 4, block_size=8)
    assert all(len(o) == 4 and all(0 <= t < model.config.vocab_size for t in o) for o in out)


def test_bf16_forward_tracks_fp32():
    backend = get_backend("torch", "cpu")
    fp32 = build_preset("tiny", dtype=torch.float32, backend=backend)
    bf16 = build_preset("tiny", dtype="bf16", backend=backend)
    bf16.load_state_dict(fp32.state_dict())  # same weights, rounded to bf16
    prompts = _prompts(fp32.config.vocab_size, lens=(30,))
    ref = prompt_logits(fp32, prompts, 16)[0]
    got = prompt_logits(bf16, prompts, 16)[0]
    assert bf16.dtype == torch.bfloat16 and got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 0.1 * ref.abs().max().item()


# -- packed inputs -------------------------------------------------------------------------------------

def test_packed_inputs_match_per_token_definition():
    rng = np.random.default_rng(7)
    block_size = 5
    seqs = []
    for _ in range(6):
        start, q_len = int(rng.integers(0, 30)), int(rng.integers(1, 12))
        num_blocks = -(-(start + q_len) // block_size) + int(rng.integers(0, 2))
        table = rng.permutation(100)[:num_blocks].tolist()
        seqs.append(SequenceInput(rng.integers(0, 50, q_len).tolist(), start, table,
                                  num_logits=int(rng.integers(0, q_len + 1))))
    step = build_model_input(seqs, block_size)
    meta = step.attn_metadata
    want_ids, want_pos, want_slots, want_logits, offset = [], [], [], [], 0
    for s in seqs:
        for j, token in enumerate(s.token_ids):
            pos = s.start_pos + j
            want_ids.append(token)
            want_pos.append(pos)
            want_slots.append(s.block_table[pos // block_size] * block_size + pos % block_size)
        offset += len(s.token_ids)
        want_logits.extend(range(offset - s.num_logits, offset))
    assert step.input_ids.tolist() == want_ids
    assert step.positions.tolist() == want_pos
    assert meta.slot_mapping.tolist() == want_slots
    assert meta.logits_indices.tolist() == want_logits
    assert meta.context_lens.tolist() == [s.start_pos + len(s.token_ids) for s in seqs]
    q_lens = [len(s.token_ids) for s in seqs]
    assert meta.cu_seqlens_q.tolist() == np.concatenate([[0], np.cumsum(q_lens)]).tolist()
    for i, s in enumerate(seqs):
        assert meta.block_tables[i, : len(s.block_table)].tolist() == list(s.block_table)
    assert meta.block_tables.dtype == torch.int64 and meta.slot_mapping.dtype == torch.int64
    assert meta.max_q_len == max(len(s.token_ids) for s in seqs)
    assert not meta.is_decode_only


def test_decode_only_batch_is_flagged():
    step = build_model_input([SequenceInput([4], 9, [2, 3]), SequenceInput([5], 0, [7])], 8)
    assert step.attn_metadata.is_decode_only
    assert step.attn_metadata.slot_mapping.tolist() == [3 * 8 + 1, 7 * 8]


@pytest.mark.parametrize("bad,match", [
    (SequenceInput([1, 2, 3], 14, [0, 1]), "need 4 blocks"),
    (SequenceInput([], 0, [0]), "no tokens"),
    (SequenceInput([1, 2], 0, [0], num_logits=3), "num_logits"),
])
def test_bad_sequence_descriptions_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        build_model_input([SequenceInput([1], 0, [0]), bad], 5)

"""The engine's decode-batch step against its exact step: the same tokens, decisions and memory, step by step.

Each case runs a workload twice on the same model, with the decode batch (`decode_batch=True`, the
default) and without (every step through `Scheduler.schedule()`), and compares what every step did.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_backend import LLMEngine, SamplingParams
from gpu_backend.engine.decode_step import DecodeStepper
from gpu_backend.engine.input_buffers import InputBuffers
from gpu_backend.model import CausalLM
from gpu_backend.model_config import ModelConfig
from gpu_backend.model_presets import init_random_weights
from gpu_backend.ops import get_backend
from simulator.core.invariants import check_invariants

pytestmark = pytest.mark.usefixtures("single_thread")

SMALL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def model() -> CausalLM:
    m = CausalLM(SMALL, backend=get_backend("torch", "cpu"))
    init_random_weights(m, seed=7)
    return m


def _workload(num: int = 14, seed: int = 0, shared: int = 0):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 64, shared).tolist()
    prompts = [prefix + rng.integers(3, 64, n).tolist() for n in rng.integers(2, 40, num)]
    return prompts, rng.integers(1, 30, num).tolist()


def _greedy(lens, ignore_eos=True):
    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=ignore_eos) for m in lens]


def _run(model, prompts, params, decode_batch: bool, mirror: bool = False, buffers: dict | None = None,
         **options):
    """Every step's decisions and memory, the outputs, and how many steps the decode batch took."""
    options = {"block_size": 4, "num_blocks": 300, "max_num_seqs": 6, **options}
    engine = LLMEngine(model, track_memory=True, decode_batch=decode_batch, **options)
    if mirror:
        engine.decoder = DecodeStepper(engine, mirror=True)
    for name, value in (buffers or {}).items():  # smaller buffers than the engine's, to reach rare paths
        setattr(engine.decoder.buffers, name, value)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, request_id=i)
    steps, outputs, fast = [], {}, 0
    while engine.has_unfinished():
        batched = decode_batch and engine.scheduler.decode is not None and engine.decoder.loaded
        result = engine.step()
        fast += batched or (decode_batch and engine.decoder.loaded)
        steps.append((result.counts, result.breakdown, result.out.num_batched_tokens,
                      result.num_computed_tokens, sorted(result.first_token),
                      sorted(o.request_id for o in result.finished),
                      sorted(np.asarray(result.context_lens).tolist())))
        for o in result.finished:
            outputs[o.request_id] = [(c.token_ids, c.finish_reason) for c in o.outputs]
        if mirror and engine.decoder.loaded:  # the device table, with the cells the next copy carries
            rows, buffers = engine.decoder.rows, engine.decoder.buffers
            device = buffers.device_table.clone()
            device.view(-1)[torch.tensor(buffers._idx, dtype=torch.int64)] = torch.tensor(buffers._val,
                                                                                           dtype=torch.int64)
            for r, s in enumerate(rows.seqs[:rows.n]):
                k = len(s.block_table) if not engine.cache.contiguous else 1
                assert buffers._stale or torch.equal(device[r, :k], torch.from_numpy(buffers.table[r, :k]))
    check_invariants(engine.allocator)
    assert engine.allocator.breakdown().allocated == 0
    return steps, [outputs[i] for i in range(len(prompts))], fast


def _same(model, prompts, params, min_fast: int = 10, **options):
    exact = _run(model, prompts, params, False, **options)
    batched = _run(model, prompts, params, True, **options)
    assert batched[0] == exact[0]  # every step: counts, memory, tokens computed, first tokens, finishes
    assert batched[1] == exact[1]  # every request's tokens and finish reasons
    assert exact[2] == 0 and batched[2] >= min_fast  # the decode batch took steps (mixed ones included)
    return batched


@pytest.mark.parametrize("options", [
    {},
    {"block_size": 1, "num_blocks": 1200},
    {"block_size": 7, "num_blocks": 200},
    {"num_blocks": 60},  # tight: recompute preemptions
    {"num_blocks": 60, "preemption_mode": "swap", "swap_space_gb": 0.001},
    {"allocator": "contiguous-max", "num_blocks": None, "capacity_tokens": 800, "max_model_len": 128},
    {"allocator": "contiguous-oracle", "num_blocks": None, "capacity_tokens": 500, "max_model_len": 128},
    {"enable_chunked_prefill": True, "max_num_batched_tokens": 16},
], ids=["paged", "block-1", "block-7", "preempt", "swap", "contiguous-max", "contiguous-oracle", "chunked"])
def test_greedy_steps_equal_the_exact_steps(model, options):
    prompts, lens = _workload()
    _same(model, prompts, _greedy(lens), min_fast=5, **options)


def test_prefix_hits_and_published_decode_blocks_equal_the_exact_steps(model):
    prompts, lens = _workload(shared=13)
    prompts = prompts + prompts[:4]  # repeats: their decode blocks were published by the first ones
    _same(model, prompts, _greedy(lens + lens[:4]), max_num_seqs=4)


def test_eos_finishes_a_row_early_and_max_tokens_when_ignored(model):
    prompts, lens = _workload(seed=2)
    probe = _run(model, prompts, _greedy(lens), False)[1]
    counts = np.bincount([t for o in probe for t in o[0][0][1:]], minlength=SMALL.vocab_size)
    stopping = CausalLM(SMALL.replace(eos_token_ids=(int(counts.argmax()),)),
                        backend=get_backend("torch", "cpu"))
    stopping.load_state_dict(model.state_dict())  # the same weights: a frequent token ends sequences
    params = _greedy([m + 20 for m in lens], ignore_eos=False)
    params[::3] = _greedy([m + 20 for m in lens[::3]])
    _, outputs, _ = _same(stopping, prompts, params)
    reasons = [o[0][1] for o in outputs]
    assert "stop" in reasons and "length" in reasons


def test_seeded_sampling_equals_the_exact_steps(model):
    prompts, lens = _workload(seed=3)
    settings = zip(lens, [0.7, 1.0, 1.5] * 5, [0, 5, 0] * 5, [1.0, 0.9] * 7, strict=False)
    params = [SamplingParams(max_tokens=m, temperature=t, top_k=k, top_p=p, seed=i, ignore_eos=True)
              for i, (m, t, k, p) in enumerate(settings)]
    _, outputs, _ = _same(model, prompts, params)
    again = _run(model, prompts[::-1], params[::-1], True)[1][::-1]  # another order: the same samples
    assert outputs == again


def test_parallel_samples_and_beams_settle_the_batch_and_it_comes_back(model):
    prompts, lens = _workload(seed=4)
    params = _greedy(lens)
    params[3] = SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=5, ignore_eos=True)
    params[8] = SamplingParams(max_tokens=5, beam_width=2, ignore_eos=True)
    _same(model, prompts, params, min_fast=5)


def test_unseeded_sampling_runs_through_the_batch(model):
    prompts, lens = _workload(seed=5)
    params = [SamplingParams(max_tokens=m, temperature=1.0, ignore_eos=True) for m in lens]
    _, outputs, fast = _run(model, prompts, params, True)
    assert fast > 10 and [len(o[0][0]) for o in outputs] == lens


@pytest.mark.parametrize("options", [{}, {"allocator": "contiguous-max", "num_blocks": None,
                                          "capacity_tokens": 800, "max_model_len": 128}])
def test_copying_buffers_and_spilled_tables_give_the_same_steps(model, options):
    """The copying path a GPU takes (staging, one copy, table cells applied on the device), run on the
    CPU; steps with more sequences than table rows (their tables are sent whole); steps larger than the
    staging buffer (they get their own)."""
    prompts, lens = _workload(seed=6)
    exact = _run(model, prompts, _greedy(lens), False, **options)
    for mirror in (False, True):
        for small in ({}, {"table_rows": 1}, {"capacity": 0}):
            got = _run(model, prompts, _greedy(lens), True, mirror=mirror, buffers=small, **options)
            assert got[:2] == exact[:2] and got[2] > 10


def test_more_table_changes_than_a_copy_carries_upload_the_table(model, monkeypatch):
    prompts, lens = _workload(seed=7)
    exact = _run(model, prompts, _greedy(lens), False)
    uploads = []
    real = InputBuffers._upload_table
    monkeypatch.setattr(InputBuffers, "_upload_table", lambda self: uploads.append(1) or real(self))
    monkeypatch.setattr(InputBuffers, "__init__", _small_sends(InputBuffers.__init__))
    got = _run(model, prompts, _greedy(lens), True, mirror=True)
    assert got[:2] == exact[:2] and got[2] > 10
    assert uploads  # a joining row's table alone is more than 3 cells


def _small_sends(init):
    def small(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "max_deltas": 3})
    return small


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("allocator", ["paged", "contiguous-max"])
def test_gpu_decode_batch_gives_the_exact_steps_tokens(allocator):
    """On a GPU (pinned staging, one copy, table cells applied on the device, CUDA graphs replayed over the
    persistent buffers): greedy, seeded and EOS-stopping requests as the exact step samples them."""
    config = SMALL.replace(vocab_size=256, head_dim=64, max_position_embeddings=512)
    model = CausalLM(config, dtype=torch.float16, device="cuda", backend=get_backend("triton", "cuda"))
    init_random_weights(model, seed=3)
    prompts, lens = _workload(num=20, seed=8)
    params = _greedy(lens, ignore_eos=False)
    params[1::3] = [SamplingParams(max_tokens=m, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
                    for i, m in enumerate(lens[1::3])]
    options = {"device": "cuda", "max_num_seqs": 8, "max_model_len": 256}
    if allocator != "paged":
        options |= {"allocator": allocator, "num_blocks": None, "capacity_tokens": 4096}
    exact = _run(model, prompts, params, False, **options)
    for eager in (False, True):
        got = _run(model, prompts, params, True, enforce_eager=eager, **options)
        assert got[1] == exact[1] and got[2] > 10

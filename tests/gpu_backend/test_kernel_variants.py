"""One compiled kernel per attention path (and per layer op), whatever the step: counted with Triton's own
specializer.

Triton compiles a kernel once per specialization key: constexprs, dtypes, whether each pointer is
16-byte aligned and whether each int is a multiple of 16. On an H200 each new key costs a 0.4-0.7 s
compile inside a measured step (docs/calibration.md), and keys change from step to step wherever the
metadata views start at offsets that move with the step's sizes, or the block table's width or the split
count changes class. Here the launchers run on CPU tensors against a recording stand-in for the kernel, and
the arguments they would launch with go through Triton's binder for an sm_90 target: the key a GPU
would compile for, no GPU needed.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_backend.engine.input_batch import SequenceInput, build_model_input
from gpu_backend.ops import triton_cache, triton_decode, triton_layer, triton_prefill

pytest.importorskip("triton")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

BLOCK_SIZE, HQ, HKV, D = 16, 32, 8, 64  # llama-1b-shape's attention
NUM_SMS = 132  # an H100 / H200


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _keys(kernel, calls) -> set[str]:
    """The distinct specialization keys Triton would compile `kernel` for over `calls` (sm_90)."""
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    sm90 = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(jit.signature, jit.params, sm90)
    return {repr(binder(*args, **kwargs)[1]) for args, kwargs in calls}


def _record(monkeypatch, module, name) -> tuple[object, Recorder]:
    kernel, recorder = getattr(module, name), Recorder()
    monkeypatch.setattr(module, name, recorder)
    return kernel, recorder


def _steps(rng, num, decode_only=False, max_start=6000):
    """Engine steps of every shape a replay makes: prompts, prefix hits, chunks, decodes, mixes (contexts
    up to max_start + 700 tokens)."""
    for _ in range(num):
        seqs = []
        for _ in range(int(rng.integers(1, 65 if decode_only else 6))):
            start = int(rng.integers(0, max_start))
            q_len = 1 if decode_only or rng.random() < 0.4 else int(rng.integers(1, 700))
            table = list(range(-(-(start + q_len) // BLOCK_SIZE)))
            seqs.append(SequenceInput([1] * q_len, start, table))
        yield seqs, build_model_input(seqs, BLOCK_SIZE, "cpu")


def test_prefill_and_cache_writes_compile_once_for_every_step(monkeypatch):
    prefill, prefills = _record(monkeypatch, triton_prefill, "_paged_prefill_kernel")
    store, stores = _record(monkeypatch, triton_cache, "_store_kv_kernel")
    k_cache = torch.zeros(4, BLOCK_SIZE, HKV, D, dtype=torch.bfloat16)
    for _, step in _steps(np.random.default_rng(0), 300):
        meta = step.attn_metadata
        num_tokens = step.input_ids.shape[0]
        # As the model makes them: q, k, v split from one projection, q and k rotated into new tensors.
        qkv = torch.zeros(num_tokens, (HQ + 2 * HKV) * D, dtype=torch.bfloat16)
        v = qkv[:, (HQ + HKV) * D:].reshape(num_tokens, HKV, D)
        k = torch.zeros(num_tokens, HKV, D, dtype=torch.bfloat16)
        triton_cache.store_kv(k, v, k_cache, k_cache, meta.slot_mapping)
        q = torch.zeros(num_tokens, HQ, D, dtype=torch.bfloat16)
        triton_prefill.paged_prefill(q, k_cache, k_cache, meta.block_tables, meta.cu_seqlens_q,
                                     meta.context_lens, 0.125, max_query_len=meta.max_q_len)
    assert len(prefills.calls) == len(stores.calls) == 300
    assert len(_keys(prefill, prefills.calls)) == 1
    assert len(_keys(store, stores.calls)) == 1


def test_eager_decode_compiles_one_kernel_per_split_choice(monkeypatch):
    decode, decodes = _record(monkeypatch, triton_decode, "_paged_decode_kernel")
    reduce, reduces = _record(monkeypatch, triton_decode, "_split_reduce_kernel")
    k_cache = torch.zeros(4, BLOCK_SIZE, HKV, D, dtype=torch.bfloat16)
    splits = set()
    for seqs, step in _steps(np.random.default_rng(1), 300, decode_only=True):
        meta = step.attn_metadata
        q = torch.zeros(len(seqs), HQ, D, dtype=torch.bfloat16)
        num_splits = triton_decode.choose_num_splits(len(seqs), HKV, meta.max_context_len, NUM_SMS)
        splits.add(num_splits)
        triton_decode.paged_decode(q, k_cache, k_cache, meta.block_tables, meta.context_lens, 0.125,
                                   num_splits, meta.max_context_len)
    assert len(splits) >= 4 and 1 in splits  # the heuristic picked several split counts, 1 among them
    assert len(_keys(decode, decodes.calls)) == 2  # SPLIT is a constexpr: one-pass and split-K
    assert len(_keys(reduce, reduces.calls)) == 1


def test_engine_warmup_compiles_every_kernel_a_later_step_launches(monkeypatch):
    """After warmup() an eager replay compiles nothing: every key a step's launch has was warmed up."""
    from gpu_backend.engine.llm_engine import LLMEngine
    from gpu_backend.ops import triton_backend

    # The launchers' own code runs as on a GPU; only the device checks and SM count stand in for one.
    monkeypatch.setattr(triton_backend, "check_device", lambda *args: None)
    monkeypatch.setattr(triton_backend, "_check_runnable", lambda *tensors: None)
    monkeypatch.setattr(triton_backend, "_num_sms", lambda device: NUM_SMS)
    kernels = {name: _record(monkeypatch, module, name) for module, name in (
        (triton_prefill, "_paged_prefill_kernel"), (triton_cache, "_store_kv_kernel"),
        (triton_decode, "_paged_decode_kernel"), (triton_decode, "_split_reduce_kernel"),
        (triton_layer, "_rms_norm_kernel"), (triton_layer, "_rope_kernel"),
        (triton_layer, "_silu_mul_kernel"))}
    engine = LLMEngine("tiny", device="cpu", backend="triton", capacity_tokens=8192, max_model_len=4096)
    engine.warmup()
    warm = {name: _keys(kernel, rec.calls) for name, (kernel, rec) in kernels.items()}
    for _, rec in kernels.values():
        rec.calls.clear()
    rng = np.random.default_rng(2)
    model, cache = engine.model, engine.cache.device_cache
    for decode_only in (False, True):
        for _, step in _steps(rng, 60, decode_only, max_start=4096 - 700):  # within max_model_len
            model(step.input_ids, step.positions, step.attn_metadata, cache)
    later = {name: _keys(kernel, rec.calls) for name, (kernel, rec) in kernels.items()}
    assert all(kernels[name][1].calls for name in kernels)  # every kernel ran after warmup too
    expected = {"_paged_prefill_kernel": 1, "_store_kv_kernel": 1, "_paged_decode_kernel": 2,
                "_split_reduce_kernel": 1, "_rms_norm_kernel": 2, "_rope_kernel": 1, "_silu_mul_kernel": 1}
    assert {name: len(keys) for name, keys in warm.items()} == expected
    for name, keys in later.items():
        assert keys <= warm[name], f"{name} compiles a new kernel after warmup"


def _attention_kernels() -> tuple:
    return (triton_prefill._paged_prefill_kernel, triton_cache._store_kv_kernel,
            triton_decode._paged_decode_kernel, triton_decode._split_reduce_kernel,
            triton_layer._rms_norm_kernel, triton_layer._rope_kernel, triton_layer._silu_mul_kernel)


def _num_compiled() -> dict[str, int]:
    """Kernels Triton has loaded in this process so far, per attention kernel (every device)."""
    return {k.fn.__name__: sum(len(caches[0]) for caches in k.device_caches.values())
            for k in _attention_kernels()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_gpu_generation_compiles_nothing_after_warmup(enforce_eager):
    from gpu_backend import LLMEngine, SamplingParams
    from gpu_backend.model import CausalLM
    from gpu_backend.model_config import ModelConfig
    from gpu_backend.model_presets import init_random_weights
    from gpu_backend.ops import get_backend

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=128,
                         intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, bos_token_id=1,
                         eos_token_ids=(2,))
    model = CausalLM(config, dtype=torch.bfloat16, device="cuda", backend=get_backend("triton", "cuda"))
    init_random_weights(model, seed=5)
    for kernel in _attention_kernels():  # what other tests compiled must not stand in for warmup()
        kernel.device_caches.clear()
    engine = LLMEngine(model, device="cuda", capacity_tokens=32768, max_num_seqs=8, max_model_len=4096,
                       enforce_eager=enforce_eager)
    engine.warmup()
    warm = _num_compiled()
    assert warm["_paged_decode_kernel"] == 2 and warm["_split_reduce_kernel"] == 1  # one-pass and split-K
    rng = np.random.default_rng(4)
    # Long contexts with few sequences (split-K decode), then short ones (one pass), prompts chunked.
    for lens in ((7, 300, 2100, 3500), (5, 40, 90)):
        prompts = [rng.integers(3, 256, n).tolist() for n in lens]
        engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert _num_compiled() == warm


class _Launches(TorchDispatchMode):
    """Counts the torch ops that launch a kernel on a GPU (views and allocations launch none)."""

    FREE = {"view", "_unsafe_view", "split", "split_with_sizes", "slice", "select", "unsqueeze", "expand",
            "t", "transpose", "reshape", "alias", "detach", "as_strided", "squeeze", "permute", "empty",
            "empty_like", "empty_strided", "lift_fresh"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.split(".")[0] not in self.FREE
        return func(*args, **(kwargs or {}))


def test_a_decode_forward_with_the_triton_layer_ops_launches_about_a_dozen_kernels_a_layer(monkeypatch):
    """What a CUDA-graph decode step pays for per launch: the fused layer ops cut torch's ~38 a layer."""
    from gpu_backend.kv_cache import KVCache
    from gpu_backend.model_presets import build_preset
    from gpu_backend.ops import get_backend, triton_backend
    from gpu_backend.ops.layer_ops import TorchLayerOps

    monkeypatch.setattr(triton_backend, "check_device", lambda *args: None)
    monkeypatch.setattr(triton_backend, "_check_runnable", lambda *tensors: None)
    monkeypatch.setattr(triton_backend, "_num_sms", lambda device: NUM_SMS)
    kernels = [_record(monkeypatch, module, name)[1] for module, name in (
        (triton_cache, "_store_kv_kernel"), (triton_decode, "_paged_decode_kernel"),
        (triton_decode, "_split_reduce_kernel"), (triton_layer, "_rms_norm_kernel"),
        (triton_layer, "_rope_kernel"), (triton_layer, "_silu_mul_kernel"))]
    model = build_preset("tiny", dtype="float32", backend=get_backend("triton", "cpu"))
    cfg = model.config
    cache = KVCache(cfg.num_hidden_layers, 64 * 11, 16, cfg.num_key_value_heads, cfg.head_dim,
                    dtype=torch.float32, device="cpu")
    seqs = [SequenceInput([5], 100 + i, list(range(11 * i, 11 * i + 11))[:(116 + i) // 16], seq_id=i)
            for i in range(64)]
    step = build_model_input(seqs, 16, "cpu")
    per_layer = {}
    for ops in (TorchLayerOps(), model.layer_ops):
        model.layer_ops = ops
        for rec in kernels:
            rec.calls.clear()
        with _Launches() as aten:
            model(step.input_ids, step.positions, step.attn_metadata, cache)
        per_layer[ops.name] = (aten.count + sum(len(rec.calls) for rec in kernels)) / cfg.num_hidden_layers
    assert per_layer["triton"] <= 15 and per_layer["torch"] >= 2.5 * per_layer["triton"], per_layer

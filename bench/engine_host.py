"""Host work per engine step (scheduling, packing, sampling, bookkeeping): what a fast GPU step cannot hide.

Measured two ways, on the CPU, at the engine's max_model_len (4096 by default):
- `model="stub"`: the tiny preset whose forward returns zero logits at once (`StubLM`), so a step's wall
  time is the engine's own work around the model;
- `model="tiny"`: the real tiny preset; each step's wall time minus the time spent in its forward.
Each batch size runs `num_seqs` requests of `prompt_len` tokens to steady decode (every sequence running,
none finishing while timed), then times `steps` decode steps. The median (p50) and p90 per step are
reported: the minimum of a few dozen steps on a shared machine says how fast a step can be, not how
fast steps are.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from gpu_backend.model import CausalLM
from gpu_backend.model_input import AttentionMetadata
from gpu_backend.model_presets import PRESETS, build_preset
from gpu_backend.ops import get_backend

HOST_MODELS = ("stub", "tiny")


class StubLM(CausalLM):
    """The tiny preset with an instant forward: zero logits for every requested row."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache) -> torch.Tensor:
        """Zero logits [len(logits_indices), vocab] (reads the inputs' shapes only)."""
        return torch.zeros(attn_metadata.logits_indices.shape[0], self.config.vocab_size)


def stub_model() -> StubLM:
    """A StubLM on the CPU (fp32, torch backend)."""
    return StubLM(PRESETS["tiny"], dtype=torch.float32, device="cpu", backend=get_backend("torch", "cpu"))


def record_forward_times(engine) -> list[float]:
    """Seconds of each forward call of `engine` from now on (an eager forward or a CUDA-graph replay;
    on CUDA the call returns once its kernels are queued); `del engine._forward` and, with graphs,
    `del engine.graph_runner.replay` stop it."""
    times: list[float] = []

    def timed(call):
        def run(*args):
            start = time.perf_counter()
            out = call(*args)
            times.append(time.perf_counter() - start)
            return out
        return run

    engine._forward = timed(engine._forward)
    if engine.graph_runner is not None:
        engine.graph_runner.replay = timed(engine.graph_runner.replay)
    return times


def capacity_tokens(num_seqs: int, steps: int, allocator: str, max_model_len: int,
                    prompt_len: int = 128) -> int:
    """KV slots the host benchmark's engine holds: room for every sequence (contiguous allocators reserve
    up to max_model_len slots per sequence) and one more full-length request."""
    per_seq = 2 * (prompt_len + steps + 64) if allocator == "paged" else max_model_len
    return num_seqs * per_seq + max_model_len


def kv_bytes_per_token() -> int:
    """KV cache bytes one token takes in the host benchmark's engine (both models: tiny's shape, fp32)."""
    return PRESETS["tiny"].kv_bytes_per_token(torch.float32)


def host_time_per_step(num_seqs: int, steps: int = 50, prompt_len: int = 128, allocator: str = "paged",
                       block_size: int = 16, model: str = "stub", max_model_len: int = 4096,
                       decode_batch: bool = True) -> dict:
    """p50/p90 host ms of a steady decode step with `num_seqs` running sequences (module docstring)."""
    from gpu_backend.engine.llm_engine import LLMEngine
    from gpu_backend.engine.params import SamplingParams

    if model not in HOST_MODELS:
        raise ValueError(f"host model must be one of {', '.join(HOST_MODELS)}, got {model!r}")
    lm = stub_model() if model == "stub" else build_preset("tiny", dtype="float32",
                                                           backend=get_backend("torch", "cpu"))
    engine = LLMEngine(lm, device="cpu", allocator=allocator, block_size=block_size,
                       capacity_tokens=capacity_tokens(num_seqs, steps, allocator, max_model_len, prompt_len),
                       max_num_seqs=max(num_seqs, 1), max_model_len=max_model_len,
                       max_num_batched_tokens=num_seqs * prompt_len + max_model_len,
                       decode_batch=decode_batch)
    forward_s = record_forward_times(engine)
    params = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request([1 + (i + j) % 100 for j in range(prompt_len)], params)
    for _ in range(4):  # prefill everything and settle into decode
        engine.step()
    forward_s.clear()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        result = engine.step()
        times.append(time.perf_counter() - start)
        if result.num_computed_tokens != num_seqs or result.finished:
            raise RuntimeError(f"expected {num_seqs} decoding sequences, got {result.num_computed_tokens}")
    host = np.asarray(times) - (np.asarray(forward_s) if model == "tiny" else 0.0)
    p50, p90 = np.percentile(host, [50, 90])
    return {"num_seqs": num_seqs, "model": model, "allocator": allocator, "steps": steps,
            "max_model_len": max_model_len, "p50_ms": 1e3 * float(p50), "p90_ms": 1e3 * float(p90)}

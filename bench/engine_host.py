"""Host work per engine step (scheduling, packing, sampling, bookkeeping) with the model taken out.

`StubLM` is the tiny preset whose forward returns zero logits at once, so a step's wall time on the CPU
is the engine's own work around the model: what a GPU server pays per step before the device even starts.
Each batch size runs `num_seqs` requests of `prompt_len` tokens to steady decode (every sequence
running), then times `steps` decode steps; the median and min per step are reported.
"""
from __future__ import annotations

import statistics
import time

import torch

from gpu_backend.model import CausalLM
from gpu_backend.model_input import AttentionMetadata
from gpu_backend.model_presets import PRESETS
from gpu_backend.ops import get_backend


class StubLM(CausalLM):
    """The tiny preset with an instant forward: zero logits for every requested row."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache) -> torch.Tensor:
        """Zero logits [len(logits_indices), vocab] (reads the inputs' shapes only)."""
        return torch.zeros(attn_metadata.logits_indices.shape[0], self.config.vocab_size)


def stub_model() -> StubLM:
    """A StubLM on the CPU (fp32, torch backend)."""
    return StubLM(PRESETS["tiny"], dtype=torch.float32, device="cpu", backend=get_backend("torch", "cpu"))


def host_time_per_step(num_seqs: int, steps: int = 50, prompt_len: int = 128, allocator: str = "paged",
                       block_size: int = 16) -> dict:
    """Median/min wall ms of a steady decode step with `num_seqs` running sequences and a stub model."""
    from gpu_backend.engine.llm_engine import LLMEngine
    from gpu_backend.engine.params import SamplingParams

    engine = LLMEngine(stub_model(), device="cpu", allocator=allocator, block_size=block_size,
                       capacity_tokens=num_seqs * (prompt_len + steps + 64) * 2,
                       max_num_seqs=max(num_seqs, 1), max_num_batched_tokens=num_seqs * prompt_len,
                       max_model_len=prompt_len + steps + 64)
    params = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request([1 + (i + j) % 100 for j in range(prompt_len)], params)
    for _ in range(4):  # prefill everything and settle into decode
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        result = engine.step()
        times.append(time.perf_counter() - start)
        if len(result.out.scheduled) != num_seqs:
            raise RuntimeError(f"expected {num_seqs} decoding sequences, got {len(result.out.scheduled)}")
    return {"num_seqs": num_seqs, "allocator": allocator, "steps": steps,
            "p50_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}

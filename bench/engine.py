"""Output throughput of the engine vs transformers' padded batched `generate` on the same requests.

Both sides get the same prompts (seeded random tokens of a trace's prompt lengths, clipped like the
replay does) and must produce each request's trace output length; arrivals are ignored (all requests are
available at once). transformers runs static batches of `hf_batch_size` requests in trace order, left-
padded to the longest prompt of the batch, each generating the batch's longest output; only the tokens a
request asked for count as output. The engine runs them all with continuous batching. Same weights on
both sides (the preset copied into a transformers LlamaForCausalLM), greedy; fp32 tiny on the CPU by
default, any preset, device and dtype on request (bf16 llama-1b-shape on a GPU).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from gpu_backend.engine.llm_engine import LLMEngine
from gpu_backend.engine.params import SamplingParams
from gpu_backend.model import CausalLM
from gpu_backend.replay import clip_prompts, make_prompts


@dataclass(frozen=True)
class BenchRequests:
    """Prompts and forced output lengths of a benchmark workload."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens the workload asks for."""
        return int(sum(self.output_lens))


def bench_requests(model: CausalLM, trace: str = "azure-conv", limit: int = 64, seed: int = 0,
                   max_model_len: int | None = None) -> BenchRequests:
    """The first `limit` requests of a trace as token prompts for `model`."""
    from traces import load_trace

    return requests_of(model, load_trace(trace).iloc[:limit].reset_index(drop=True), seed, max_model_len)


def requests_of(model: CausalLM, df, seed: int = 0, max_model_len: int | None = None) -> BenchRequests:
    """The requests of a trace table as token prompts for `model` (prompts clipped as the replay clips)."""
    lens, _ = clip_prompts(df, max_model_len or model.config.max_model_len)
    prompts = make_prompts(df, lens, model.config.vocab_size, seed)
    return BenchRequests(prompts, df["output_len"].astype(int).tolist())


def run_engine(model: CausalLM, work: BenchRequests, **engine_options) -> dict:
    """Wall time and output throughput of `LLMEngine.generate` on the workload (after a warmup)."""
    engine = LLMEngine(model, **engine_options)
    engine.warmup()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
    start = time.perf_counter()
    outputs = engine.generate(work.prompts, params)
    engine.synchronize()
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "output_tokens": produced, "tokens_per_s": produced / seconds,
            "num_preemptions": engine.scheduler.num_preemptions}


def to_transformers(model: CausalLM):
    """A transformers LlamaForCausalLM holding the same weights as `model` (a Llama-architecture CausalLM)."""
    import transformers

    cfg = model.config
    if cfg.architecture != "LlamaForCausalLM" or cfg.qkv_bias:
        raise ValueError(f"to_transformers handles Llama configs without qkv bias, not {cfg.architecture}"
                         + " with qkv bias" * cfg.qkv_bias)
    # config.json's rope_scaling block (llama-1b-shape has Llama 3's); transformers 5 maps it to
    # rope_parameters itself.
    rope = {} if cfg.rope_scaling is None else {"rope_scaling": {
        k: v for k, v in dataclasses.asdict(cfg.rope_scaling).items() if v is not None}}
    hf_config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings, **rope)
    hf = transformers.LlamaForCausalLM(hf_config).to(device=model.device, dtype=model.dtype).eval()
    ours = dict(model.named_parameters())
    state = {}
    for name, pieces in model.hf_weight_sources().items():
        row = 0
        for hf_name, rows in pieces:
            state[hf_name] = ours[name].detach()[row:row + rows].clone()
            row += rows
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise ValueError(f"weight mapping mismatch: missing {missing}, unexpected {unexpected}")
    hf.generation_config.eos_token_id = None
    return hf


@torch.inference_mode()
def run_transformers(hf_model, work: BenchRequests, batch_size: int = 16,
                     deadline: float | None = None) -> dict:
    """Wall time and output throughput of padded static batches through `hf_model.generate`. With
    `deadline` (a `time.perf_counter()` reading), no batch starts after it: the batches run are counted."""
    device = next(hf_model.parameters()).device
    hf_model.generate(torch.tensor([[1, 2, 3]], device=device),
                      attention_mask=torch.ones(1, 3, dtype=torch.long, device=device),
                      max_new_tokens=2, do_sample=False, pad_token_id=0)  # warmup
    start = time.perf_counter()
    produced = batches = 0
    for lo in range(0, len(work.prompts), batch_size):
        if deadline is not None and batches and time.perf_counter() > deadline:
            break
        prompts = work.prompts[lo:lo + batch_size]
        outs = work.output_lens[lo:lo + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        new = max(outs)
        hf_model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, pad_token_id=0)
        produced += sum(outs)
        batches += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": produced, "tokens_per_s": produced / seconds,
            "batch_size": batch_size, "batches": batches,
            "requests": min(batches * batch_size, len(work.prompts))}


def compare(model_name: str = "tiny", trace: str = "azure-conv", limit: int = 64, hf_batch_size: int = 16,
            seed: int = 0, max_model_len: int | None = None, progress=None, device: str = "cpu",
            dtype: str | None = None, backend: str = "auto", **engine_options) -> dict:
    """Engine vs transformers on one workload (default CPU, fp32, tiny): both results and the speed-up.

    `max_model_len` clips prompts (as the replay does) so that prompt + output fit in it;
    `progress(message)`, when given, is told when each phase starts (the runs take minutes).
    """
    say = progress or (lambda message: None)
    from gpu_backend.model_presets import build_preset
    from gpu_backend.ops import get_backend

    dev = torch.device(device)
    torch_dtype = getattr(torch, dtype) if dtype else (torch.float32 if dev.type == "cpu" else torch.bfloat16)
    model = build_preset(model_name, dtype=torch_dtype, device=dev, backend=get_backend(backend, dev),
                         seed=seed)
    work = bench_requests(model, trace, limit, seed, max_model_len)
    say(f"engine: {len(work.prompts)} requests, {work.num_output_tokens} output tokens")
    engine = run_engine(model, work, device=device, **engine_options)
    say(f"engine: {engine['tokens_per_s']:.1f} tok/s; transformers: batches of {hf_batch_size}")
    hf = run_transformers(to_transformers(model), work, hf_batch_size)
    say(f"transformers: {hf['tokens_per_s']:.1f} tok/s")
    return {"workload": {"trace": trace, "limit": limit, "max_model_len": max_model_len,
                         "prompt_tokens": int(sum(map(len, work.prompts))),
                         "output_tokens": work.num_output_tokens,
                         "max_prompt": int(max(map(len, work.prompts)))},
            "engine": engine, "transformers": hf, "speedup": engine["tokens_per_s"] / hf["tokens_per_s"],
            "threads": torch.get_num_threads(), "mean_output": float(np.mean(work.output_lens)),
            "model": model_name, "device": str(dev), "dtype": str(torch_dtype).removeprefix("torch."),
            "backend": model.attn_backend.name}

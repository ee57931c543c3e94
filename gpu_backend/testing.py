"""Test utilities: greedy generation on the paged model with trivially assigned blocks (no BlockManager).

An engine-independent reference: tests check the model, the kernels and the packed-batch plumbing with it,
without a scheduler or a block manager.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_backend.engine.input_batch import SequenceInput, build_model_input
from gpu_backend.kv_cache import KVCache
from gpu_backend.model import CausalLM


def interleaved_block_tables(num_seqs: int, blocks_per_seq: int) -> list[list[int]]:
    """Block tables where sequence i owns blocks i, i + B, i + 2B...: every table is non-contiguous,
    so a kernel that assumes contiguous blocks gives wrong answers."""
    return [[j * num_seqs + i for j in range(blocks_per_seq)] for i in range(num_seqs)]


def make_kv_cache(model: CausalLM, num_blocks: int, block_size: int, poison: bool = True) -> KVCache:
    """A KV pool matching `model`; poisoned with NaN so reading a slot nobody wrote shows up in the output."""
    cfg = model.config
    cache = KVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                    dtype=model.dtype, device=model.device)
    if poison:
        for tensor in (*cache.k, *cache.v):
            tensor.fill_(float("nan"))
    return cache


def generate_simple(model: CausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    block_size: int = 16, prefill_chunk_size: int | None = None,
                    poison: bool = True) -> list[list[int]]:
    """Greedy decoding of every prompt for exactly `max_new_tokens` tokens (no EOS stop).

    All sequences run in one packed batch per step. With `prefill_chunk_size`, prompts are fed in
    chunks of at most that many tokens, so steps mix prefill chunks of long prompts with decodes of
    short ones — the batch shape the engine's scheduler produces.
    """
    num_seqs = len(prompts)
    max_len = max(len(p) for p in prompts) + max_new_tokens
    blocks_per_seq = -(-max_len // block_size)
    tables = interleaved_block_tables(num_seqs, blocks_per_seq)
    cache = make_kv_cache(model, num_seqs * blocks_per_seq, block_size, poison)
    tokens = [list(p) for p in prompts]
    computed = [0] * num_seqs
    outputs: list[list[int]] = [[] for _ in range(num_seqs)]
    chunk = prefill_chunk_size or max_len
    while any(len(out) < max_new_tokens for out in outputs):
        batch, members, owners = [], [], []
        for i in range(num_seqs):
            if len(outputs[i]) >= max_new_tokens:
                continue
            new = tokens[i][computed[i]: computed[i] + chunk]
            finishes_prompt = computed[i] + len(new) == len(tokens[i])
            batch.append(SequenceInput(new, computed[i], tables[i], num_logits=int(finishes_prompt)))
            members.append(i)
            if finishes_prompt:
                owners.append(i)
        step = build_model_input(batch, block_size, model.device)
        logits = model(step.input_ids, step.positions, step.attn_metadata, cache)
        next_ids = logits.argmax(dim=-1).tolist()
        for i, seq in zip(members, batch, strict=True):
            computed[i] += len(seq.token_ids)
        for i, token in zip(owners, next_ids, strict=True):
            tokens[i].append(token)
            outputs[i].append(token)
    return outputs


@torch.inference_mode()
def prompt_logits(model: CausalLM, prompts: Sequence[Sequence[int]], block_size: int,
                  chunks: int = 1) -> list[torch.Tensor]:
    """Logits [len(prompt), vocab] at every position of each prompt, computed in `chunks` packed steps
    through the paged cache (chunk c of every prompt in step c)."""
    num_seqs = len(prompts)
    blocks_per_seq = -(-max(len(p) for p in prompts) // block_size)
    tables = interleaved_block_tables(num_seqs, blocks_per_seq)
    cache = make_kv_cache(model, num_seqs * blocks_per_seq, block_size)
    pieces: list[list[torch.Tensor]] = [[] for _ in range(num_seqs)]
    for c in range(chunks):
        batch, owners = [], []
        for i, prompt in enumerate(prompts):
            lo, hi = len(prompt) * c // chunks, len(prompt) * (c + 1) // chunks
            if hi > lo:
                batch.append(SequenceInput(prompt[lo:hi], lo, tables[i], num_logits=hi - lo))
                owners.append(i)
        step = build_model_input(batch, block_size, model.device)
        logits = model(step.input_ids, step.positions, step.attn_metadata, cache)
        for i, rows in zip(owners, logits.split([len(s.token_ids) for s in batch]), strict=True):
            pieces[i].append(rows)
    return [torch.cat(p) for p in pieces]

"""The engine's KV cache groups: the layout the simulator derives for the same model, and its pool.

A model mixing sliding-window and full-attention layers (Gemma 2 and 3, tiny-hybrid), or one whose every
layer slides (Mistral), runs on the GroupedBlockManager (simulator/core/paged/kv_groups.py), as vLLM v1's
hybrid KV cache manager runs it: one pool of blocks shared by the groups, a block table per group, and
sliding groups handing back the blocks that leave their window. The choice and the pool's block count
come from `kv_capacity` (simulator/presets.py), the function that sizes the simulator's pool, so both
build the same allocator for the same model, pool bytes and block size. The pool's bytes are the same as
with one group: `capacity_tokens` (or `num_blocks` x block_size) slots of every layer, split into blocks
of group_size layer pages (`KVLayout.num_blocks`).

The decode batch (simulator/core/decode.py) keeps one block table per sequence, so a grouped engine takes
every step through `Scheduler.schedule()`; its decode steps replay CUDA graphs whose buffers hold a table
per group (cuda_graph.py).
"""
from __future__ import annotations

import dataclasses

from gpu_backend.model_config import ModelConfig
from simulator.core.kv_layout import KVLayout
from simulator.presets import KVCapacity, kv_capacity


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def layer_types(config: ModelConfig) -> tuple[str, ...]:
    """Each layer's attention as the engine runs it (layer_types None with a window: every layer slides)."""
    return tuple("full_attention" if config.layer_window(i) is None else "sliding_attention"
                 for i in range(config.num_hidden_layers))


def grouped_pool(config, model, capacity_tokens: int, sched_config) -> KVCapacity | None:
    """The grouped pool of a paged engine over `capacity_tokens` slots of every layer of `model` (a
    CausalLM; its layout and block count), or None where its layers form one full-attention group."""
    if not config.is_paged:
        return None
    dtype = str(model.dtype).removeprefix("torch.")  # the KV cache is in the weights' dtype
    spec = dataclasses.replace(model.config, layer_types=layer_types(model.config), torch_dtype=dtype)
    pool = kv_capacity(spec, capacity_tokens=capacity_tokens, block_size=config.block_size,
                       max_model_len=sched_config.max_model_len,
                       max_num_batched_tokens=sched_config.token_budget,
                       hybrid=not config.disable_hybrid_kv_cache_manager)
    return pool if pool.grouped else None


def layer_slots(layout: KVLayout) -> tuple[int, ...]:
    """The pool tensor of each layer: its place in its group (vLLM shares tensor i among the groups' i-th
    layers, since a block belongs to one group at a time)."""
    slots = [0] * sum(len(g.layers) for g in layout.groups)
    for group in layout.groups:
        for i, layer in enumerate(group.layers):
            slots[layer] = i
    return tuple(slots)


def group_of_layer(layout: KVLayout) -> tuple[int, ...]:
    """The KV cache group of each layer."""
    out = [0] * sum(len(g.layers) for g in layout.groups)
    for g, group in enumerate(layout.groups):
        for layer in group.layers:
            out[layer] = g
    return tuple(out)


def blocks_needed(allocator, prompt_len: int, final_len: int, width: int) -> int:
    """Blocks of the grouped pool a request of `width` sequences holds at most: the prompt in every group
    (by chunk: a window frees what it passed before each chunk), or its decode peak, where a sliding group
    holds at most the blocks its window spans, plus two. Several sequences re-admitted after a recompute
    take every block of their tokens in every group, each its own, before any window frees one: that
    bounds their decode peak."""
    tables, total = allocator.tables, _cdiv(final_len, allocator.block_size)
    if width > 1:  # the re-admission bounds every decode peak
        decode = width * total * tables.num_groups
    else:
        decode = sum(total if spec.window is None else min(total, spec.need + 2) for spec in tables.specs)
    if allocator.by_chunk(width):
        return max(tables.peak_blocks(prompt_len, allocator.prefill_chunk), decode)
    return max(tables.prompt_blocks(prompt_len, 0), decode)

"""Sizing the KV pool (measured on a GPU, configured on a CPU) and building the shared allocator over it.

On CUDA the pool gets what is left of `gpu_memory_utilization * total` once the weights, the activation
peak and memory held outside torch are accounted for. The activation peak is measured, not guessed: one
dummy forward of `max_num_batched_tokens` tokens split over `max_num_seqs` sequences (the largest step the
scheduler can produce) runs against a throw-away cache, and `torch.cuda.max_memory_allocated()` minus the
memory allocated before it (weights) minus that cache's own bytes is the activation peak, as in vLLM.
"""
from __future__ import annotations

import torch

from gpu_backend.engine.engine_config import DEFAULT_CPU_KV_MEMORY_GB, EngineConfig
from gpu_backend.engine.input_batch import SequenceInput, build_model_input
from gpu_backend.engine.params import EngineInputError
from gpu_backend.kv_cache import KVCache
from gpu_backend.model import CausalLM
from simulator.core.allocator import KVAllocator
from simulator.core.config import build_allocator, swap_pool_bytes
from simulator.core.errors import ConfigError
from simulator.core.scheduler import SchedulerConfig

GIB = 1 << 30
MEASURED = "measured free GPU memory"


def kv_capacity_tokens(config: EngineConfig, model: CausalLM,
                       sched_config: SchedulerConfig) -> tuple[int, str]:
    """Pool capacity in token slots and how it was chosen (for the run's config); a pool that cannot fit
    the device's memory with the largest step is refused here, before it is made (memory_budget.py)."""
    tokens, source = _capacity_tokens(config, model, sched_config)
    if source != MEASURED:  # a measured pool was sized to fit
        from gpu_backend.memory_budget import check_fits

        bpt = model.config.kv_bytes_per_token(model.dtype)
        check_fits(model, tokens * bpt, sched_config.token_budget, sched_config.max_num_seqs)
    return tokens, source


def _capacity_tokens(config: EngineConfig, model: CausalLM, sched_config: SchedulerConfig) -> tuple[int, str]:
    bpt = model.config.kv_bytes_per_token(model.dtype)
    if config.capacity_tokens is not None:
        return config.capacity_tokens, "capacity_tokens"
    if config.num_blocks is not None:
        return config.num_blocks * config.block_size, "num_blocks"
    if config.kv_memory_gb is not None:
        return int(config.kv_memory_gb * GIB) // bpt, "kv_memory_gb"
    if model.device.type != "cuda":
        return int(DEFAULT_CPU_KV_MEMORY_GB * GIB) // bpt, f"default {DEFAULT_CPU_KV_MEMORY_GB} GiB on CPU"
    kv_bytes = profile_free_kv_bytes(model, sched_config, config.block_size, config.gpu_memory_utilization)
    return kv_bytes // bpt, MEASURED


@torch.inference_mode()
def profile_free_kv_bytes(model: CausalLM, sched_config: SchedulerConfig, block_size: int,
                          utilization: float) -> int:
    """Bytes left for the KV pool on the model's GPU after weights, activation peak and non-torch memory."""
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    num_tokens = sched_config.token_budget
    num_seqs = max(1, min(sched_config.max_num_seqs, num_tokens))
    lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    lens = [n for n in lens if n > 0]
    blocks = [-(-n // block_size) for n in lens]
    cfg = model.config
    cache = KVCache(cfg.num_hidden_layers, sum(blocks), block_size, cfg.num_key_value_heads, cfg.head_dim,
                    dtype=model.dtype, device=device)
    first = [sum(blocks[:i]) for i in range(len(blocks))]
    inputs = [SequenceInput([0] * n, 0, list(range(f, f + b))) for n, f, b in zip(lens, first, blocks,
                                                                                  strict=True)]
    step = build_model_input(inputs, block_size, device)
    model(step.input_ids, step.positions, step.attn_metadata, cache)
    torch.cuda.synchronize(device)
    activation = torch.cuda.max_memory_allocated(device) - before - cache.bytes
    del cache, step
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    kv_bytes = int(total * utilization) - torch.cuda.memory_allocated(device) - activation - non_torch
    if kv_bytes <= 0:
        raise EngineInputError(
            f"no GPU memory left for the KV cache: {total / GIB:.1f} GiB x {utilization} utilization minus "
            f"weights {torch.cuda.memory_allocated(device) / GIB:.2f} GiB, activations {activation / GIB:.2f}"
            f" GiB and non-torch {non_torch / GIB:.2f} GiB; lower max_num_batched_tokens or raise "
            f"gpu_memory_utilization")
    return kv_bytes


def make_allocator(config: EngineConfig, capacity_tokens: int, bytes_per_token: int, max_model_len: int,
                   record_events: bool = False, pool=None) -> KVAllocator:
    """The shared allocator over the pool, built by the same function the simulator uses; `pool` (a
    KVCapacity with several KV cache groups, engine/kv_groups.py) makes it the grouped one."""
    cpu_bytes = swap_pool_bytes(config.swap_space_gb, config.kv_offloading_size)  # the simulator's rule
    grouped = {} if pool is None else dict(layout=pool.layout, num_blocks=pool.num_blocks)
    try:
        return build_allocator(config, capacity_tokens, cpu_bytes=cpu_bytes, bytes_per_token=bytes_per_token,
                               max_model_len=max_model_len, record_events=record_events, **grouped)
    except ConfigError as exc:
        raise EngineInputError(str(exc)) from None
